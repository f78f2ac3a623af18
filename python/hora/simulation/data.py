"""A dataset split among a simulated federation's clients: :class:`Partition` and
:class:`Shard`.

A :class:`Partition` holds a dataset (NumPy arrays, a pandas DataFrame, an Arrow table or
Parquet files) and says how it is split: ``iid``, label skew ``dirichlet:alpha=A``,
pathological ``shards:k=K`` (K classes a client), quantity skew ``quantity:sigma=S``, or
``natural`` (one client per value of the ``by`` column: a writer, a hospital, a device). The
split is made once per process from the labels, the seed and the number of clients (the same
split ``hora-server simulate --partition`` makes of the same labels and seed); a client's
:class:`Shard` is cut from it when that client trains, never every client's at once.

Before the run, the dataset is written once to the run's directory: arrays as ``.npy``, which
every worker maps (the operating system holds one copy however many workers read it), and
tables as Parquet, which each worker reads once (a copy a worker).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Tuple, Union

import numpy as np

from .. import _hora

#: What a simulation's ``data`` may be: a :class:`Partition`, or ``client -> Shard`` (or
#: ``client -> (train, test)``) for data that comes split already.
Data = Union["Partition", Callable[[int], Any]]


@dataclass(frozen=True)
class Shard:
    """One client's data: ``train`` and ``test`` (held out, for federated evaluation), each of
    the dataset's own kind: a tuple of arrays, a DataFrame or an Arrow table."""

    client: int
    train: Any
    test: Any

    @property
    def examples(self) -> int:
        """How many training examples the client has."""
        return rows(self.train)


def rows(data: Any) -> int:
    """The number of examples in ``data``: a table's rows, the length of the first of a tuple of
    columns (arrays or lists) or of a mapping's first column, else ``len(data)``."""
    if hasattr(data, "num_rows"):  # an Arrow table
        return int(data.num_rows)
    if isinstance(data, tuple) and data and all(hasattr(c, "__len__") for c in data):
        return int(len(data[0]))
    if isinstance(data, dict) and data:
        return int(len(next(iter(data.values()))))
    return int(len(data))


class Partition:
    """``data`` split among a federation's clients, as ``partitioner`` says.

    Args:
        data: ``(features, labels)`` (or any tuple of arrays of equal length), a
            ``pandas.DataFrame``, a ``pyarrow.Table``, or the path of a Parquet file or
            directory.
        partitioner: ``iid``, ``dirichlet:alpha=A``, ``shards:k=K``, ``quantity:sigma=S`` or
            ``natural``.
        label: the label column of a table (for label skew and shards); a tuple's labels are
            its last array unless ``label`` gives them (an array) or names which (an index).
        by: for ``natural``: the column whose values are the clients (a table's column name,
            or an array of keys beside a tuple). Client ``k`` is the ``k``-th value in sorted
            order, and the federation has as many clients as values.
        test_fraction: each client's share held out for federated evaluation (drawn from the
            seed and the client).

    Raises:
        ValueError: a partitioner it does not know, a missing label or ``by`` column, or (when
        the run starts) fewer samples than clients.
    """

    def __init__(
        self,
        data: Any,
        partitioner: str = "iid",
        *,
        label: Any = None,
        by: Any = None,
        test_fraction: float = 0.2,
    ) -> None:
        if not 0.0 <= float(test_fraction) < 1.0:
            raise ValueError(f"test_fraction must be in [0, 1), not {test_fraction}")
        self.partitioner = str(partitioner).strip()
        self.natural = self.partitioner == "natural"
        if self.natural and by is None:
            raise ValueError("a natural partition needs by= (the column whose values are the clients)")
        if not self.natural and by is not None:
            raise ValueError(f"by= is for the natural partitioner, not {self.partitioner}")
        self.test_fraction = float(test_fraction)
        self.label, self.by = label, by
        self.kind, self.data = _kind(data)
        if self.kind == "arrays":
            self.data = tuple(np.asarray(a) for a in self.data)
            lengths = {len(a) for a in self.data}
            if len(lengths) != 1:
                raise ValueError(f"the arrays of a dataset must have one length, not {sorted(lengths)}")
        # Filled per process: the dataset as read, and the split.
        self._table: Any = None
        self._plan: Any = None
        self._bound: Optional[Tuple[int, int]] = None

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state.update(_table=None, _plan=None, _bound=None)
        return state

    def written(self, directory: Union[str, os.PathLike]) -> "Partition":
        """This partition with its data written under ``directory`` (arrays as ``.npy``, which
        each process maps; a table as Parquet), to be read by worker processes."""
        directory = Path(directory)
        out = Partition.__new__(Partition)
        out.__dict__.update(self.__getstate__())
        if self.kind == "arrays":
            paths = []
            for i, a in enumerate(self.data):
                path = directory / f"data-{i}.npy"
                np.save(path, np.ascontiguousarray(a), allow_pickle=False)
                paths.append(str(path))
            out.kind, out.data = "npy", tuple(paths)
            out.label = self._array("label", self.label)
            out.by = self._array("by", self.by)
        elif self.kind in ("pandas", "arrow"):
            import pyarrow as pa
            import pyarrow.parquet as pq

            names = list(self.data.columns) if self.kind == "pandas" else list(self.data.column_names)
            unnamed = [n for n in names if not isinstance(n, str)]
            if unnamed:
                raise ValueError(
                    f"the table's columns {unnamed[:5]} are not named by strings, which Parquet "
                    "needs: name them (frame.columns = [str(c) for c in frame.columns])"
                )
            table = self.data if self.kind == "arrow" else pa.Table.from_pandas(self.data, preserve_index=False)
            path = directory / "data.parquet"
            pq.write_table(table, path)
            out.kind, out.data, out.as_pandas = "parquet", str(path), self.kind == "pandas"
        return out

    def _array(self, what: str, value: Any) -> Any:
        """A tuple dataset's label or key array, kept apart from the data (an index stays)."""
        if value is None or isinstance(value, (int, np.integer)):
            return value
        array = np.asarray(value)
        if len(array) != len(self.data[0]):
            raise ValueError(f"{what} has {len(array)} values for {len(self.data[0])} samples")
        return array

    # -- per process ----------------------------------------------------------------------

    def _read(self) -> Any:
        if self._table is None:
            if self.kind == "npy":
                self._table = tuple(np.load(p, mmap_mode="r") for p in self.data)
            elif self.kind == "parquet":
                import pyarrow.parquet as pq

                self._table = pq.read_table(self.data, memory_map=True)
            else:
                self._table = self.data
        return self._table

    def _column(self, what: str, spec: Any) -> np.ndarray:
        """The labels (``what="label"``) or natural keys as an array over the samples."""
        table = self._read()
        if isinstance(table, tuple):
            if spec is None:
                if what == "by":
                    raise ValueError("by= is missing")
                return np.asarray(table[-1])
            if isinstance(spec, (int, np.integer)):
                return np.asarray(table[int(spec)])
            return np.asarray(spec)
        if spec is None:
            raise ValueError(f"a table's {what} column must be named ({what}=…)")
        names = list(table.column_names) if hasattr(table, "column_names") else list(table.columns)
        if spec not in names:
            raise ValueError(f"the data has no column {spec!r} (it has {names})")
        column = table[spec]
        return column.to_numpy() if hasattr(column, "to_numpy") else np.asarray(column)

    def _rows(self) -> int:
        table = self._read()
        return rows(table) if isinstance(table, tuple) else int(len(table))

    def groups(self) -> int:
        """How many clients a natural partition makes (the ``by`` column's distinct values)."""
        return int(len(np.unique(self._column("by", self.by))))

    def plan(self, clients: int, seed: int) -> None:
        """Makes the split among ``clients`` from ``seed`` (once per process and arguments)."""
        if self._bound == (clients, seed):
            return
        if self.natural:
            _, groups = np.unique(self._column("by", self.by), return_inverse=True)
            found = int(groups.max()) + 1 if len(groups) else 0
            if found != clients:
                raise ValueError(
                    f"the natural partition by {self.by!r} makes {found} clients, not {clients}: "
                    "leave clients= out, or give it that number"
                )
            self._plan = _Natural(groups, clients)
        elif self.partitioner.split(":", 1)[0] in ("iid", "quantity"):
            # (Splits that do not look at labels: the table needs no label column.)
            codes = np.zeros(self._rows(), dtype=np.int64)
            self._plan = _hora.partition(self.partitioner, codes, 1, clients, seed)
        else:
            labels = self._column("label", self.label)
            if labels.dtype.kind in "iu" and (len(labels) == 0 or labels.min() >= 0):
                codes = labels.astype(np.int64)
            else:
                _, codes = np.unique(labels, return_inverse=True)
                codes = codes.astype(np.int64)
            classes = int(codes.max()) + 1 if len(codes) else 0
            self._plan = _hora.partition(self.partitioner, codes, classes, clients, seed)
        self._bound = (clients, seed)

    def shard(self, client: int, seed: int) -> Shard:
        """Client ``client``'s shard (the split made by :meth:`plan`)."""
        if self._plan is None:
            raise RuntimeError("Partition.plan(clients, seed) must come before shard()")
        indices = np.asarray(self._plan.indices(client), dtype=np.int64)
        rng = np.random.default_rng([int(seed), int(client), 1])
        order = rng.permutation(len(indices))
        held = int(round(len(indices) * self.test_fraction))
        if held == len(indices) and held > 0:
            held -= 1  # a client keeps one sample to train on
        train, test = np.sort(indices[order[held:]]), np.sort(indices[order[:held]])
        return Shard(client, self._take(train), self._take(test))

    def _take(self, indices: np.ndarray) -> Any:
        table = self._read()
        if isinstance(table, tuple):
            return tuple(np.asarray(a[indices]) for a in table)
        if hasattr(table, "iloc"):  # a DataFrame
            return table.iloc[indices].reset_index(drop=True)
        taken = table.take(indices)
        if getattr(self, "as_pandas", False):
            return taken.to_pandas()
        return taken

    def __repr__(self) -> str:
        return f"Partition({self.kind}, {self.partitioner!r})"


class _Natural:
    """A natural partition's split: client ``k`` is every sample of the ``k``-th key."""

    def __init__(self, groups: np.ndarray, clients: int) -> None:
        self.order = np.argsort(groups, kind="stable")
        self.starts = np.concatenate([[0], np.cumsum(np.bincount(groups, minlength=clients))])

    def indices(self, client: int) -> np.ndarray:
        return self.order[self.starts[client] : self.starts[client + 1]]


def _kind(data: Any) -> Tuple[str, Any]:
    if isinstance(data, (str, os.PathLike)):
        path = os.fspath(data)
        if not os.path.exists(path):
            raise ValueError(f"{path} does not exist (give a Parquet file or directory)")
        return "parquet", path
    if isinstance(data, (tuple, list)):
        if not data:
            raise ValueError("the dataset is an empty tuple")
        return "arrays", tuple(data)
    module = type(data).__module__
    if module.startswith("pandas"):
        return "pandas", data
    if module.startswith("pyarrow"):
        return "arrow", data
    raise ValueError(
        f"a Partition takes (features, labels) arrays, a pandas DataFrame, a pyarrow Table or a "
        f"Parquet path, not {type(data).__name__}"
    )


def bind(data: Data, clients: int, seed: int) -> Callable[[int], Shard]:
    """``data`` as ``client -> Shard``."""
    if isinstance(data, Partition):
        data.plan(clients, seed)
        return lambda client: data.shard(client, seed)

    def shard(client: int) -> Shard:
        made = data(client)
        if isinstance(made, Shard):
            return made
        if isinstance(made, tuple) and len(made) == 2:
            return Shard(client, made[0], made[1])
        raise TypeError(f"data({client}) must return a Shard or (train, test), not {type(made).__name__}")

    return shard


__all__ = ["Data", "Partition", "Shard", "bind", "rows"]
