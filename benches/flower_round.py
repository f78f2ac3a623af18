"""The round-latency benchmark's baseline: the same federation in Flower, real processes.

`benches/round_latency.rs` (and `benches/footprint.rs`, one client, `--mnist` data, through a
byte-counting relay) run this with the Python of `scripts/setup-flower.sh`:

    python benches/flower_round.py run --data DIR --rounds 35 --warmup 5 [--tls DIR] ...

`run` starts one Flower server process (the legacy gRPC bidirectional-streaming server,
`flwr.server.start_server`, FedAvg) and one process per client (`flwr.client.start_client`),
each training the same MLP on its own shard of the data the Rust benchmark wrote to DIR
(`shard-K.json`: the very shards the Hora clients generate), with the same local epochs, batch
size and optimizer. The server times each round as Hora's benchmark does, publish to publish:
a FedAvg subclass notes when `configure_fit` starts a round and when `aggregate_fit` returns
its new global model. Clients note how long their `fit` took (training, and evaluating on the
held-out split as the Hora client does), their peak resident memory and when their first `fit`
began. `run` prints one line, `RESULT {json}`, and ends every process it started.
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import time


def mlp(inputs, hidden, classes):
    import torch

    layers = []
    width = inputs
    for h in hidden:
        layers += [torch.nn.Linear(width, h), torch.nn.ReLU()]
        width = h
    layers.append(torch.nn.Linear(width, classes))
    return torch.nn.Sequential(*layers)


def read_certs(tls):
    with open(os.path.join(tls, "ca.pem"), "rb") as f:
        ca = f.read()
    with open(os.path.join(tls, "server.pem"), "rb") as f:
        cert = f.read()
    with open(os.path.join(tls, "server-key.pem"), "rb") as f:
        key = f.read()
    return ca, cert, key


def serve(args):
    import flwr
    from flwr.common import ndarrays_to_parameters
    from flwr.server import ServerConfig, start_server
    from flwr.server.strategy import FedAvg
    import torch

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = mlp(args.inputs, args.hidden, args.classes)
    initial = [v.detach().numpy() for v in model.state_dict().values()]
    starts, published = {}, {}

    class TimedFedAvg(FedAvg):
        def configure_fit(self, server_round, parameters, client_manager):
            starts[server_round] = time.time()
            return super().configure_fit(server_round, parameters, client_manager)

        def aggregate_fit(self, server_round, results, failures):
            out = super().aggregate_fit(server_round, results, failures)
            published[server_round] = time.time()
            return out

    def weighted(metrics):
        total = sum(n for n, _ in metrics)
        return {k: sum(n * m[k] for n, m in metrics) / total for k in ("loss", "accuracy")}

    strategy = TimedFedAvg(
        fraction_fit=1.0,
        fraction_evaluate=0.0,
        min_fit_clients=args.clients,
        min_evaluate_clients=0,
        min_available_clients=args.clients,
        initial_parameters=ndarrays_to_parameters(initial),
        fit_metrics_aggregation_fn=weighted,
    )
    certificates = read_certs(args.tls) if args.tls else None
    history = start_server(
        server_address=f"127.0.0.1:{args.port}",
        config=ServerConfig(num_rounds=args.rounds),
        strategy=strategy,
        certificates=certificates,
    )
    losses = [v for _, v in history.metrics_distributed_fit.get("loss", [])]
    with open(args.out, "w") as f:
        json.dump(
            {
                "flwr": flwr.__version__,
                "round_start_unix": [starts[r] for r in sorted(starts)],
                "published_unix": [published[r] for r in sorted(published)],
                "loss": losses,
            },
            f,
        )


def peak_rss_kb():
    """VmHWM of /proc/self/status: this program's peak resident memory, in kB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    return None


def read_idx(path):
    """An IDX file (MNIST's format) as a numpy array."""
    import numpy as np

    with open(path, "rb") as f:
        data = f.read()
    dims = data[3]
    shape = [int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(dims)]
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * dims).reshape(shape)


def client(args):
    import numpy as np
    import torch
    from flwr.client import NumPyClient, start_client

    torch.set_num_threads(1)
    torch.manual_seed(args.index)
    if args.mnist:
        # As Hora's `mnist:DIR`: pixels scaled to [0, 1], train-* to train on, t10k-* held out.
        def images(name):
            x = read_idx(os.path.join(args.mnist, f"{name}-images-idx3-ubyte"))
            return torch.from_numpy(x.astype(np.float32) / 255.0).view(x.shape[0], -1)

        def labels(name):
            y = read_idx(os.path.join(args.mnist, f"{name}-labels-idx1-ubyte"))
            return torch.from_numpy(y.astype(np.int64))

        train_x, train_y = images("train"), labels("train")
        test_x, test_y = images("t10k"), labels("t10k")
    else:
        with open(os.path.join(args.data, f"shard-{args.index}.json")) as f:
            shard = json.load(f)
        dim = shard["dim"]
        train_x = torch.tensor(shard["train_features"], dtype=torch.float32).view(-1, dim)
        train_y = torch.tensor(shard["train_labels"], dtype=torch.int64)
        test_x = torch.tensor(shard["test_features"], dtype=torch.float32).view(-1, dim)
        test_y = torch.tensor(shard["test_labels"], dtype=torch.int64)
    model = mlp(args.inputs, args.hidden, args.classes)
    keys = list(model.state_dict().keys())
    fits = []
    first_fit = []

    class ShardClient(NumPyClient):
        def get_parameters(self, config):
            return [v.detach().numpy() for v in model.state_dict().values()]

        def fit(self, parameters, config):
            started = time.time()
            first_fit.append(started)
            model.load_state_dict(
                {k: torch.from_numpy(np.copy(v)) for k, v in zip(keys, parameters)}
            )
            model.train()
            opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
            n = train_x.shape[0]
            loss_sum, seen = 0.0, 0
            for _ in range(args.epochs):
                order = torch.randperm(n)
                for start in range(0, n, args.batch_size):
                    idx = order[start : start + args.batch_size]
                    opt.zero_grad()
                    loss = torch.nn.functional.cross_entropy(model(train_x[idx]), train_y[idx])
                    loss.backward()
                    opt.step()
                    loss_sum += loss.item() * idx.shape[0]
                    seen += idx.shape[0]
            model.eval()
            with torch.no_grad():
                accuracy = (model(test_x).argmax(-1) == test_y).float().mean().item()
            weights = [v.detach().numpy().copy() for v in model.state_dict().values()]
            fits.append(time.time() - started)
            return weights, n, {"loss": loss_sum / max(seen, 1), "accuracy": accuracy}

    port = args.client_port or args.port
    kwargs = {"server_address": f"127.0.0.1:{port}", "client": ShardClient().to_client()}
    if args.tls:
        kwargs["root_certificates"] = read_certs(args.tls)[0]
    else:
        kwargs["insecure"] = True
    start_client(**kwargs)
    with open(args.out, "w") as f:
        json.dump(
            {
                "fit_seconds": fits,
                "first_fit_unix": first_fit[0] if first_fit else None,
                # This process's own high-water mark (ru_maxrss would include its parent's).
                "peak_rss_kb": peak_rss_kb(),
            },
            f,
        )


def free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tail(path, lines=30):
    with open(path, errors="replace") as f:
        return "".join(f.readlines()[-lines:])


def wait_listening(port, server, logs, timeout=120):
    """Waits until the server process accepts connections on `port`."""
    import socket

    deadline = time.time() + timeout
    while time.time() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"flower server exited ({server.returncode}):\n"
                             + tail(os.path.join(logs, "server.log")))
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.05)
    raise SystemExit(f"flower server not listening after {timeout} s")


def run(args):
    """Starts the server and the clients as processes; prints RESULT {json}."""
    port = args.port or free_port()
    common = [
        "--port", str(port),
        "--inputs", str(args.inputs),
        "--hidden", ",".join(map(str, args.hidden)),
        "--classes", str(args.classes),
        "--clients", str(args.clients),
        "--rounds", str(args.rounds),
        "--epochs", str(args.epochs),
        "--batch-size", str(args.batch_size),
        "--lr", str(args.lr),
        "--momentum", str(args.momentum),
        "--data", args.data,
    ]
    if args.tls:
        common += ["--tls", args.tls]
    if args.mnist:
        common += ["--mnist", args.mnist]
    env = dict(os.environ, GRPC_VERBOSITY="ERROR", PYTHONWARNINGS="ignore")
    me = [sys.executable, os.path.abspath(__file__)]
    logs = os.path.join(args.data, "flower-logs")
    os.makedirs(logs, exist_ok=True)
    procs = []

    def spawn(role, extra):
        log = open(os.path.join(logs, f"{role}.log"), "w")
        p = subprocess.Popen(me + [role.split("-")[0]] + common + extra, env=env,
                             stdout=log, stderr=subprocess.STDOUT)
        procs.append((role, p))
        return p

    try:
        server_out = os.path.join(args.data, "flower-server.json")
        server = spawn("server", ["--out", server_out])
        wait_listening(port, server, logs)
        spawned = []
        for k in range(args.clients):
            connect = ["--connect-port", str(args.client_port)] if args.client_port else []
            spawned.append(time.time())
            spawn(f"client-{k}", ["--index", str(k), "--out",
                                  os.path.join(args.data, f"flower-client-{k}.json")] + connect)
        deadline = time.time() + args.timeout
        while server.poll() is None:
            for role, p in procs:
                if p.poll() not in (None, 0):
                    raise SystemExit(f"flower {role} failed ({p.returncode}):\n"
                                     + tail(os.path.join(logs, f"{role}.log")))
            if time.time() > deadline:
                raise SystemExit(f"flower did not finish within {args.timeout} s; see {logs}")
            time.sleep(0.05)
        if server.returncode != 0:
            raise SystemExit(f"flower server failed ({server.returncode}); see {logs}")
        for role, p in procs:
            p.wait(timeout=30)
        with open(server_out) as f:
            result = json.load(f)
        clients = []
        for k in range(args.clients):
            with open(os.path.join(args.data, f"flower-client-{k}.json")) as f:
                clients.append(dict(json.load(f), spawned_unix=spawned[k]))
        result["client_fit_seconds"] = [c["fit_seconds"] for c in clients]
        result["clients"] = clients
        result["tls"] = bool(args.tls)
        print("RESULT " + json.dumps(result), flush=True)
    finally:
        for _, p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
                p.wait()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("role", choices=["run", "server", "client"])
    parser.add_argument("--data", required=True, help="directory with shard-K.json")
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=35)
    parser.add_argument("--inputs", type=int, default=60)
    parser.add_argument("--hidden", type=lambda s: [int(h) for h in s.split(",") if h],
                        default=[32])
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=20)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--momentum", type=float, default=0.0)
    parser.add_argument("--tls", help="directory with ca.pem, server.pem and server-key.pem "
                        "(hora-server's certificates)")
    parser.add_argument("--port", type=int, help="the server's port (run: else a free one)")
    parser.add_argument("--connect-port", "--client-port", dest="client_port", type=int,
                        help="the port clients connect to, when a relay sits before the server")
    parser.add_argument("--mnist", help="a directory of MNIST IDX files to train on instead of "
                        "shard-K.json")
    parser.add_argument("--index", type=int)
    parser.add_argument("--out")
    parser.add_argument("--timeout", type=float, default=300)
    args = parser.parse_args()
    {"run": run, "server": serve, "client": client}[args.role](args)


if __name__ == "__main__":
    main()
