"""The simulation benchmark's Python path: the same federation as `flower_simulation.py`, run by
`hora.simulation.run` with a Python `train_fn` (the training Flower's clients run: the same
`simulation_common.train_linear`).

`benches/simulation.rs` runs this with the Python of the package `hora` (`make
bench-simulation` installs its release build):

    python benches/hora_simulation.py --data DIR --clients 1000 --per-round 100 \
        --rounds 10 --initial DIR/initial.bin --out DIR/hora-python.bin [--workers 2]

DIR is the Rust benchmark's: `features.npy`, `labels.npy` and `offsets.npy` (client k's rows are
offsets[k]..offsets[k+1]), memory-mapped by the workers, each taking its client's rows as its
job comes (`data=` a function of the client). Prints one line, `RESULT {json}`, with the wall
time of `run`.
"""

import json
import os
import time

import numpy as np

from simulation_common import arguments, read_linear, train_linear, write_linear


class Shards:
    """Client k's training rows, from the memory-mapped arrays (opened once per worker)."""

    def __init__(self, data):
        self.data = data
        self.arrays = None

    def __getstate__(self):
        return {"data": self.data, "arrays": None}

    def __call__(self, k):
        from hora.simulation import Shard

        if self.arrays is None:
            load = lambda name: np.load(os.path.join(self.data, name), mmap_mode="r")
            self.arrays = load("offsets.npy"), load("features.npy"), load("labels.npy")
        offsets, x, y = self.arrays
        lo, hi = int(offsets[k]), int(offsets[k + 1])
        return Shard(k, (np.array(x[lo:hi]), np.array(y[lo:hi])), None)


def fit(weights, config):
    """Flower's client's fit: the same `train_linear` on the client's rows."""
    x, y = config["data"].train
    weight, bias, loss = train_linear(x, y, weights["weight"], weights["bias"])
    return {"weight": weight, "bias": bias}, len(y), {"loss": loss}


def main():
    args = arguments("--workers", os.cpu_count())

    from hora.simulation import run

    task = {"id": "bench", "rounds": args.rounds, "min_clients": 1, "target_clients": args.per_round,
            "round_deadline_secs": 600, "training": {"epochs": 1, "batch_size": 10, "learning_rate": 0.05}}
    started = time.perf_counter()
    weight, bias = read_linear(args.initial)
    result = run(task, args.clients, model={"weight": weight, "bias": bias}, data=Shards(os.path.abspath(args.data)),
                 train_fn=fit, workers=args.workers, seed=args.seed, progress=False)
    wall = time.perf_counter() - started
    write_linear(args.out, result.model["weight"], result.model["bias"])
    print("RESULT " + json.dumps({"wall_seconds": wall, "updates": result.updates}), flush=True)


if __name__ == "__main__":
    main()
