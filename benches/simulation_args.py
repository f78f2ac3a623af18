"""What the simulation benchmark's Python runs share (`flower_simulation.py`, with Flower's
Python, and `hora_simulation.py`, with Hora's): their command line, and the model's layout."""

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
