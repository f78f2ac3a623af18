"""A hora.sync worker process for the tests. Modes:

allreduce: rank r holds r+1 everywhere (and a ramp); prints the averages.
train:     the MLP on its slice of each global batch; prints a digest of the final weights.
die:       rank 1 exits abruptly before the first allreduce; the others print the error.
"""

import argparse
import json
import os
import sys

import numpy as np
import torch

import hora
import hora.sync as hs
from client_main import MLP

DATA = "synthetic-iid:clients=1,seed=3,min_samples=400,max_samples=400"


def fit(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, batch: int, epochs: int) -> None:
    """Trains `model` in lock-step: rank 0's parameters first, then every rank its slice of
    each global batch of `size() × batch` (one seeded permutation per epoch, on every rank), SGD
    with momentum through the DistributedOptimizer."""
    hs.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    opt = hs.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    world, r = hs.size(), hs.rank()
    g = batch * world
    for epoch in range(epochs):
        order = torch.randperm(len(y), generator=torch.Generator().manual_seed(epoch))
        for start in range(0, len(y) - g + 1, g):
            mine = order[start + r * batch: start + (r + 1) * batch]
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x[mine]), y[mine]).backward()
            opt.step()


def train(batch: int, epochs: int) -> dict:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    (x, y), _, _ = hora.load_dataset(DATA, 0)
    x, y = torch.from_numpy(x), torch.from_numpy(y)
    model = MLP() if hs.rank() == 0 else MLP(hidden=32)
    if hs.rank() != 0:  # other ranks start elsewhere: broadcast must make them equal
        torch.nn.init.constant_(model.fc1.weight, 0.3)
    fit(model, x, y, batch, epochs)
    return {k: v.flatten().tolist() for k, v in model.state_dict().items()}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("mode")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--epochs", type=int, default=2)
    args = p.parse_args()
    hs.init(timeout_secs=float(os.environ.get("TIMEOUT", "10")))
    if args.mode == "allreduce":
        r = hs.rank()
        a = np.full(1_000_003, r + 1, np.float32)
        hs.allreduce_(a)
        t = torch.arange(10, dtype=torch.float32) * (r + 1)
        mean = hs.allreduce(t)
        total = hs.allreduce(t, average=False)
        objs = hs.allgather_object({"rank": r})
        # Rank 0's checkpoint (written by it alone), read back by every rank through rank 0; an
        # optimizer's state (momentum buffers) from rank 0 to all.
        wrote = hs.save_checkpoint(os.environ["CKPT"], {"step": 7, "w": torch.full((3,), 1.5 + r)})
        hs.barrier()
        state = hs.load_checkpoint(os.environ["CKPT"])
        w = torch.nn.Parameter(torch.ones(3))
        opt = torch.optim.SGD([w], lr=0.1, momentum=0.9)
        w.grad = torch.full((3,), float(r + 1))
        opt.step()
        hs.broadcast_optimizer_state(opt, root_rank=0)
        print("RESULT " + json.dumps({
            "min": float(a.min()), "max": float(a.max()),
            "mean": mean.tolist(), "sum": total.tolist(), "ranks": [o["rank"] for o in objs],
            "wrote": wrote, "step": state["step"], "w": state["w"].tolist(),
            "momentum": opt.state[w]["momentum_buffer"].tolist(),
        }), flush=True)
    elif args.mode == "train":
        result = train(args.batch, args.epochs)
        print("RESULT " + json.dumps(result), flush=True)
    elif args.mode == "die":
        if hs.rank() == 1:
            os._exit(3)
        try:
            hs.allreduce(torch.ones(1000))
        except hora.SyncFailed as e:
            print("RESULT " + json.dumps({"rank": e.rank, "message": str(e)}), flush=True)
            return
        print("RESULT " + json.dumps({"rank": None, "message": "no error"}), flush=True)


if __name__ == "__main__":
    sys.exit(main())
