"""The simulation benchmark's baseline: the same federation in Flower's Simulation Runtime.

`benches/simulation.rs` runs this with the Python of `scripts/setup-flower.sh` (flwr with its
`simulation` extra, which brings Ray):

    python benches/flower_simulation.py --data DIR --clients 1000 --per-round 100 \
        --rounds 10 --initial DIR/initial.bin --out DIR/flower.bin [--cpus 2]

DIR holds the very Synthetic(1,1) shards the Hora workers generate, written by the Rust
benchmark as NumPy arrays: `features.npy` (every client's training samples, float32, 60 wide),
`labels.npy` (int64) and `offsets.npy` (client k's rows are offsets[k]..offsets[k+1]). A virtual
client memory-maps them and takes its own rows, as a Hora worker generates only its own shard.

The model is logistic regression 60 → 10 (`torch.nn.Linear`), trained as Hora's built-in trainer
trains it (`simulation_common.train_linear`: one epoch of SGD at 0.05, batches of 10,
reshuffled, on cross-entropy);
the server is Flower's FedAvg (weighted by examples) sampling `per-round` clients a round, with
Ray's default backend giving each client one CPU. The initial weights are Hora's (`initial.bin`:
the weight, 10 × 60, then the bias, float32); the final ones are written to `--out` in the same
layout. Prints one line, `RESULT {json}`, with the wall time of `run_simulation`.
"""

import json
import os
import time

import numpy as np

from simulation_common import arguments, read_linear, train_linear, write_linear


def main():
    args = arguments("--cpus", os.cpu_count())

    import flwr
    import torch
    from flwr.client import ClientApp, NumPyClient
    from flwr.common import Context, ndarrays_to_parameters, parameters_to_ndarrays
    from flwr.server import ServerApp, ServerAppComponents, ServerConfig
    from flwr.server.strategy import FedAvg
    from flwr.simulation import run_simulation

    data = os.path.abspath(args.data)
    torch.manual_seed(args.seed)

    class Synthetic(NumPyClient):
        def __init__(self, k):
            self.k = k

        def fit(self, parameters, config):
            torch.set_num_threads(1)
            torch.manual_seed(args.seed * 1_000_003 + self.k)
            offsets = np.load(os.path.join(data, "offsets.npy"))
            lo, hi = int(offsets[self.k]), int(offsets[self.k + 1])
            x = np.load(os.path.join(data, "features.npy"), mmap_mode="r")[lo:hi]
            y = np.load(os.path.join(data, "labels.npy"), mmap_mode="r")[lo:hi]
            weight, bias, loss = train_linear(x, y, parameters[0], parameters[1])
            return [weight, bias], len(y), {"loss": loss}

    def client_fn(context: Context):
        return Synthetic(int(context.node_config["partition-id"])).to_client()

    final = {}

    class Keeping(FedAvg):
        def aggregate_fit(self, server_round, results, failures):
            parameters, metrics = super().aggregate_fit(server_round, results, failures)
            if parameters is not None:
                final["weights"] = parameters_to_ndarrays(parameters)
            return parameters, metrics

    fraction = args.per_round / args.clients

    def server_fn(context: Context):
        strategy = Keeping(
            fraction_fit=fraction,
            fraction_evaluate=0.0,
            min_fit_clients=args.per_round,
            min_evaluate_clients=0,
            min_available_clients=args.clients,
            initial_parameters=ndarrays_to_parameters(list(read_linear(args.initial))),
        )
        return ServerAppComponents(strategy=strategy, config=ServerConfig(num_rounds=args.rounds))

    started = time.perf_counter()
    run_simulation(
        server_app=ServerApp(server_fn=server_fn),
        client_app=ClientApp(client_fn=client_fn),
        num_supernodes=args.clients,
        backend_config={
            "client_resources": {"num_cpus": 1, "num_gpus": 0.0},
            "init_args": {"num_cpus": args.cpus, "include_dashboard": False},
        },
    )
    wall = time.perf_counter() - started
    write_linear(args.out, *final["weights"])
    print("RESULT " + json.dumps({"wall_seconds": wall, "flwr": flwr.__version__}), flush=True)


if __name__ == "__main__":
    main()
