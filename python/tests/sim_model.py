"""What the simulation tests' workers import by name: the model and the trainer factory."""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import DataLoader, TensorDataset

import hora


class Softmax(torch.nn.Module):
    """Multinomial logistic regression, 16 features to 4 classes."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


def initial() -> Softmax:
    """The federation's initial model, the same in every process."""
    torch.manual_seed(7)
    return Softmax()


def blobs(n: int = 2400, seed: int = 0):
    """Four Gaussian classes in 16 dimensions, well apart."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(0.0, 2.0, size=(4, 16))
    labels = rng.integers(0, 4, size=n)
    features = centres[labels] + rng.normal(0.0, 1.0, size=(n, 16))
    return features.astype(np.float32), labels.astype(np.int64)


def loader(data, shuffle: bool) -> DataLoader:
    x, y = data
    return DataLoader(TensorDataset(torch.from_numpy(x), torch.from_numpy(y)), batch_size=16, shuffle=shuffle)


def torch_trainer(shard: hora.simulation.Shard) -> hora.TorchTrainer:
    """A client's TorchTrainer over its shard: what a deployed hora.Client would run."""
    return hora.TorchTrainer(Softmax(), loader(shard.train, True), eval_loader=loader(shard.test, False))
