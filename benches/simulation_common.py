"""What the simulation benchmark's Python runs share (`flower_simulation.py`, with Flower's
Python, and `hora_simulation.py`, with Hora's): their command line, the model's layout, and a
client's training, so both frameworks run the very same code."""

import argparse

import numpy as np


def arguments(workers_flag: str, workers_default: int) -> argparse.Namespace:
    """`--data DIR --clients N --per-round K --rounds R --initial FILE --out FILE --seed S` and
    the run's `workers_flag` (its worker processes or CPUs)."""
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--clients", type=int, required=True)
    p.add_argument("--per-round", type=int, required=True)
    p.add_argument("--rounds", type=int, required=True)
    p.add_argument("--initial", required=True)
    p.add_argument("--out", required=True)
    p.add_argument(workers_flag, type=int, default=workers_default)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def read_linear(path):
    """The weight (10 × 60) and the bias, float32, as the Rust benchmark writes them."""
    flat = np.fromfile(path, dtype=np.float32)
    return flat[:600].reshape(10, 60).copy(), flat[600:610].copy()


def write_linear(path, weight, bias):
    np.concatenate([np.asarray(weight, np.float32).ravel(), np.asarray(bias, np.float32).ravel()]).tofile(path)


def train_linear(x, y, weight, bias):
    """A client's local training: logistic regression 60 → 10 from `weight` and `bias`, one
    epoch of SGD at 0.05 in reshuffled batches of 10, on cross-entropy. Returns the trained
    weight and bias (NumPy) and the last batch's loss."""
    import torch

    x, y = torch.from_numpy(np.ascontiguousarray(x)), torch.from_numpy(np.ascontiguousarray(y))
    model = torch.nn.Linear(60, 10)
    with torch.no_grad():
        model.weight.copy_(torch.from_numpy(np.asarray(weight)))
        model.bias.copy_(torch.from_numpy(np.asarray(bias)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    order = torch.randperm(len(y))
    for start in range(0, len(y), 10):
        idx = order[start : start + 10]
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x[idx]), y[idx])
        loss.backward()
        opt.step()
    return model.weight.detach().numpy().copy(), model.bias.detach().numpy().copy(), float(loss.detach())
