"""Datasets read exactly as the Rust client reads them."""

from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

import numpy as np

from . import _hora


class Dataset(NamedTuple):
    """A training split, an optional test split (each ``(features, labels)``), and the class
    count."""

    train: Tuple[np.ndarray, np.ndarray]
    test: Optional[Tuple[np.ndarray, np.ndarray]]
    num_classes: int


def load_dataset(spec: str, client_index: Optional[int] = None, holdout: float = 0.0) -> Dataset:
    """Loads ``spec`` the way ``hora-client --data`` does, so Python and Rust clients can train
    on the same bytes.

    ``spec`` is ``FILE.csv[?label=COLUMN]``, ``mnist:DIR``,
    ``synthetic:alpha=1,beta=1,clients=10,seed=0`` or ``synthetic-iid:clients=10,seed=0``;
    synthetic data needs ``client_index`` (the shard). ``holdout`` is the fraction of a CSV file
    kept as the test split. Features are float32 ``(n, *sample_shape)``, labels int64.
    """
    train, test, classes = _hora.load_dataset(spec, client_index, holdout)
    return Dataset(train, test, classes)
