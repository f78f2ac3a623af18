"""Simulate a federation before deploying it: :func:`run`.

A simulated federation runs Hora's real round engine (the one ``hora-server`` runs: strategies,
differential privacy with its accountant, compression, asynchronous FedBuff) in this process,
over an in-memory store, and trains its virtual clients on a pool of worker processes with
*your* training code: the same ``train_fn`` or :class:`hora.TorchTrainer` a deployed
:class:`hora.Client` runs. A client exists only while it trains: its shard is cut from the
dataset when its job comes, and what it keeps between rounds (compression's error feedback) is
a file of its own, so memory grows with the workers, not the clients.

Time is simulated: each client has a device speed, a network and an availability window drawn
from ``profile`` (``uniform``, ``heterogeneous[:dropout=P]`` or ``trace:FILE.csv``), rounds end
at their simulated deadlines, and the history reports simulated time beside wall time, so a
synchronous task and FedBuff can be compared on the same clients.

    >>> from hora.simulation import Partition, run
    >>> result = run(task={"rounds": 10, "target_clients": 10},
    ...              clients=100, model=Net(), data=Partition((x, y), "dirichlet:alpha=0.5"),
    ...              trainer=lambda shard: hora.TorchTrainer(Net(), loader(shard.train),
    ...                                                      eval_loader=loader(shard.test)),
    ...              evaluate_clients=20)
    >>> result.history[["round", "sim_time_s", "eval_accuracy"]]
    >>> result.plot()

``hora-server simulate`` runs the same engine from the command line with the built-in Rust
trainers, no Python.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pickle
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Union

import numpy as np

from .. import _hora
from ..client import EvaluateFn, TrainFn, to_numpy
from .data import Data, Partition, Shard

__all__ = ["Partition", "Result", "Shard", "run"]

#: The history's columns, in order.
COLUMNS = [
    "round", "attempt", "outcome", "sim_time_s", "wall_time_s", "participants", "dropouts",
    "examples", "loss", "eval_loss", "eval_accuracy", "epsilon", "bytes_down", "bytes_up",
    "federated_loss", "federated_accuracy",
]


@dataclass
class Result:
    """What a simulation ends with.

    Attributes:
        history: one row per round attempt (an asynchronous task: per version), a
            ``pandas.DataFrame`` with the columns of :data:`COLUMNS`: simulated and wall
            seconds when it closed, participants, dropouts (selected clients that sent nothing
            the round took), examples, the participants' training loss, the federated
            evaluation's loss and accuracy, ε under differential privacy, bytes down and up.
        model: the last published model, float32 arrays by name.
        wall_seconds: the run's wall time.
        updates: updates the engine took.
    """

    history: Any
    model: Dict[str, np.ndarray]
    wall_seconds: float
    updates: int
    rows: List[Dict[str, Any]] = field(default_factory=list, repr=False)

    def state_dict(self) -> Dict[str, Any]:
        """The model as a ``state_dict`` of torch tensors (``module.load_state_dict(...)``)."""
        import torch

        return {name: torch.from_numpy(np.array(value)) for name, value in self.model.items()}

    def time_to_accuracy(self, target: float) -> Optional[float]:
        """The simulated seconds at which the federated evaluation first reached ``target``
        accuracy, or None."""
        for row in self.rows:
            accuracy = row.get("eval_accuracy")
            if accuracy is not None and accuracy >= target:
                return float(row["sim_time_s"])
        return None

    def plot(self, metric: str = "eval_accuracy", axes: Any = None) -> Any:
        """Draws ``metric`` (a history column) against the round and against simulated time,
        with matplotlib, and returns the figure."""
        import matplotlib.pyplot as plt

        if metric not in COLUMNS:
            raise ValueError(f"{metric!r} is not a column of the history ({', '.join(COLUMNS)})")
        published = self.history[self.history["outcome"] == "published"]
        published = published[published[metric].notna()]
        if axes is None:
            figure, axes = plt.subplots(1, 2, figsize=(10, 4), constrained_layout=True)
        else:
            figure = axes[0].figure
        for ax, x, label in ((axes[0], "round", "round"), (axes[1], "sim_time_s", "simulated time (s)")):
            ax.plot(published[x].to_numpy(), published[metric].to_numpy(), marker="o")
            ax.set_xlabel(label)
            ax.set_ylabel(metric.replace("_", " "))
            ax.grid(True, alpha=0.3)
        return figure


def run(
    task: Union[Mapping[str, Any], str, "os.PathLike[str]"],
    clients: Optional[int] = None,
    *,
    model: Any,
    data: Data,
    train_fn: Optional[TrainFn] = None,
    trainer: Optional[Callable[[Shard], Any]] = None,
    evaluate_fn: Optional[EvaluateFn] = None,
    profile: str = "uniform",
    backend: str = "local",
    workers: Optional[int] = None,
    seed: int = 0,
    evaluate_clients: int = 0,
    progress: bool = True,
    checkpoint: Optional[Union[str, "os.PathLike[str]"]] = None,
    on_round: Optional[Callable[[Dict[str, Any]], None]] = None,
) -> Result:
    """Simulates a federation of ``clients`` virtual clients to the end of ``task``.

    Args:
        task: the task as ``Admin.create_task`` or ``POST /admin/v1/tasks`` take it (a dict, or
            the path of a JSON file): ``rounds``, ``target_clients``, ``training``, ``strategy``,
            ``asynchronous``, ``differential_privacy``, ``compression``…; ``round_deadline_secs``
            (default 600) is in simulated seconds; ``id`` and ``model`` may be left out.
        clients: virtual clients in the federation (a natural partition's by default).
        model: the initial model: a ``torch.nn.Module``, a ``state_dict`` or float32 arrays.
        data: a :class:`Partition`, or ``client -> Shard`` for data split already.
        train_fn: ``train_fn(weights, config) -> (weights, num_examples, metrics)``, as
            :meth:`hora.Client.run` takes it; ``config`` also holds ``client`` (its id) and
            ``data`` (its :class:`Shard`).
        trainer: instead of ``train_fn``: ``trainer(shard)`` makes the client's training
            function, a :class:`hora.TorchTrainer` say (whose ``evaluate_fn`` answers federated
            evaluation when it has an ``eval_loader``).
        evaluate_fn: ``evaluate_fn(weights, config) -> (num_examples, metrics)`` on a client's
            held-out data (``config["data"].test``).
        profile: ``uniform[:speed=S,mbps=M]``, ``heterogeneous[:dropout=P]`` or
            ``trace:FILE.csv``.
        backend: ``local`` (worker processes on this machine).
        workers: worker processes (default: one per core).
        seed: the seed of the data split, devices, sampling and training: the same seed gives
            the same model, bit for bit, with any number of workers (Python's, NumPy's and
            torch's generators are seeded per client and round before each call).
        evaluate_clients: after each published round, the model is evaluated on this many
            clients' held-out data (drawn once from the seed); 0: none.
        progress: show a progress bar (tqdm).
        on_round: called with each round's row (a dict of the history's columns) as the round
            closes; an exception it raises stops the run and propagates.
        checkpoint: a folder: a checkpoint is kept there after every round (the engine's
            state, the clients' and the history), and a run given a folder that holds one
            resumes from it, to the same model as an uninterrupted run. Resume with the same
            arguments: another task, federation, seed, profile, dataset, partition or training
            code is refused. The folder must be new, empty or one of Hora's checkpoint folders
            (what is in it is replaced). Synchronous tasks only.

    Returns:
        a :class:`Result`.

    Raises:
        ValueError: a task, profile or data that cannot be simulated (the message says why).
        HoraError: the run failed: every worker exited, or the training failed for client after
            client (the message has the last error).
        KeyboardInterrupt: Ctrl-C stops the run and its workers.
    """
    if (train_fn is None) == (trainer is None):
        raise ValueError("give one of train_fn= and trainer=")
    if backend != "local":
        raise ValueError(f"backend {backend!r}: this release simulates on the local backend only")
    body = _task(task)
    if isinstance(data, Partition) and data.natural:
        groups = data.groups()
        if clients is None:
            clients = groups
    if clients is None or int(clients) < 1:
        raise ValueError("clients= must be at least 1")
    clients = int(clients)
    initial = to_numpy(model.state_dict() if hasattr(model, "state_dict") else model)
    workers = int(workers or os.cpu_count() or 1)
    with _scratch(checkpoint) as scratch:
        if isinstance(data, Partition):
            data = data.written(scratch)
            data.plan(clients, seed)  # here first: a split that cannot be made fails now
        spec_path = _write_spec(scratch, {"data": data, "train_fn": train_fn, "trainer": trainer,
                                          "evaluate_fn": evaluate_fn})
        # (The package's own directory first: the worker imports this `hora`, wherever it is.)
        package = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        command = [sys.executable, "-c", f"import sys; sys.path.insert(0, {package!r}); "
                   "from hora.simulation.worker import main; main()"]
        bar = _progress(progress, int(body.get("rounds", 0)))

        def row(r: Dict[str, Any]) -> None:
            if bar:
                bar.row(r)
            if on_round is not None:
                on_round(r)

        try:
            done = _hora.simulate(
                json.dumps(body), clients, command, spec_path, seed=seed, workers=workers,
                profile=profile, evaluate_clients=evaluate_clients, initial=initial,
                on_row=row,
                checkpoint=None if checkpoint is None else os.fspath(checkpoint),
            )
        finally:
            if bar:
                bar.close()
    rows = list(done["history"])
    import pandas as pd

    history = pd.DataFrame(rows, columns=COLUMNS)
    numeric = ("loss", "eval_loss", "eval_accuracy", "epsilon", "federated_loss", "federated_accuracy")
    for column in numeric:
        history[column] = pd.to_numeric(history[column]).astype("float64")  # None: NaN
    return Result(history, dict(done["model"]), float(done["wall_seconds"]), int(done["updates"]), rows)


@contextlib.contextmanager
def _scratch(checkpoint: Optional[Union[str, "os.PathLike[str]"]]) -> Iterator[str]:
    """Where the workers' functions and data are written: a temporary folder, or, with a
    checkpoint, the same folder inside it every time (the engine knows the data by its path)."""
    if checkpoint is None:
        with tempfile.TemporaryDirectory(prefix="hora-simulation-") as scratch:
            yield scratch
        return
    _hora.claim_checkpoint(os.fspath(checkpoint))
    scratch = os.path.join(os.fspath(checkpoint), "python")
    shutil.rmtree(scratch, ignore_errors=True)
    os.makedirs(scratch)
    try:
        yield scratch
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _task(task: Union[Mapping[str, Any], str, "os.PathLike[str]"]) -> Dict[str, Any]:
    if isinstance(task, (str, os.PathLike)):
        with open(task, encoding="utf-8") as f:
            task = json.load(f)
    if not isinstance(task, Mapping):
        raise ValueError("task must be a dict (or the path of a JSON file) as POST /admin/v1/tasks takes it")
    body = dict(task)
    for key in ("rounds", "target_clients"):
        if key not in body:
            raise ValueError(f"the task needs {key}")
    body.setdefault("id", "simulation")
    body.setdefault("model", {"kind": "builtin", "name": "python"})
    body.setdefault("min_clients", body["target_clients"])
    body.setdefault("round_deadline_secs", 600)
    return body


def _write_spec(scratch: str, spec: Dict[str, Any]) -> str:
    """Writes the workers' import path, then the functions and data (by value where they cannot
    be imported by name: a notebook's or a script's own, with cloudpickle) into `scratch`; its
    path. The file is named by a digest of what it holds and of the data files beside it, so a
    checkpoint, which knows the run's data by that name, refuses to resume with other data or
    other training code."""
    try:
        import cloudpickle
    except ImportError:  # pragma: no cover - cloudpickle is a dependency of hora[simulation]
        cloudpickle = pickle
    code = cloudpickle.dumps(spec)
    body = pickle.dumps([p for p in sys.path if p]) + code
    digest = hashlib.sha256(code)
    for name in sorted(os.listdir(scratch)):
        with open(os.path.join(scratch, name), "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    path = os.path.join(scratch, f"spec-{digest.hexdigest()[:16]}.pickle")
    with open(path, "wb") as f:
        f.write(body)
    return path


class _Bar:
    def __init__(self, rounds: int) -> None:
        from tqdm.auto import tqdm

        self.bar = tqdm(total=rounds or None, unit="round", desc="simulating", dynamic_ncols=True)

    def row(self, row: Dict[str, Any]) -> None:
        self.bar.update(max(0, int(row["round"]) - self.bar.n))
        shown = {"sim": f"{row['sim_time_s']:.0f}s"}
        for key, name in (("loss", "loss"), ("eval_accuracy", "acc")):
            if row.get(key) is not None:
                shown[name] = f"{row[key]:.4f}"
        self.bar.set_postfix(shown, refresh=True)

    def close(self) -> None:
        self.bar.close()


def _progress(enabled: bool, rounds: int) -> Optional[_Bar]:
    if not enabled:
        return None
    try:
        return _Bar(rounds)
    except ImportError:
        return None
