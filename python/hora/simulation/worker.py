"""A worker process of a simulated federation (``hora.simulation.worker.main``, which
:func:`hora.simulation.run` starts in a Python of its own): it trains the virtual clients the engine sends it, one at a time,
with the user's ``train_fn`` or ``trainer``.

The protocol with the engine, the global model, ``local − global``, compression and error
feedback are the Rust core's (``_hora.simulate_worker``); this half makes a client's shard and
trainer when a job names the client. The engine's pipes are moved off standard input and
output first, so whatever the user's code prints goes to standard error instead of into the
protocol.
"""

from __future__ import annotations

import logging
import os
import pickle
import random
import signal
import sys
from typing import Any, Callable, Dict, Optional, Tuple

import numpy as np

log = logging.getLogger("hora.simulation")


def client_seed(seed: int, client: int, round: int) -> int:
    """The seed of client ``client``'s training in ``round``: Python's, NumPy's and torch's
    generators are seeded with it before each call, so a run is the same with any number of
    workers."""
    return int(np.random.SeedSequence([int(seed), int(client), int(round)]).generate_state(1)[0])


def _seed_everything(seed: int, threads: int) -> None:
    """Seeds Python's, NumPy's and torch's generators, and holds torch (imported by the user's
    code at any point) to the worker's threads: workers share the cores, and a result must not
    depend on how many threads added it up."""
    random.seed(seed)
    np.random.seed(seed)
    torch = sys.modules.get("torch")
    if torch is not None:
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        # (The CPU generator directly: torch.manual_seed also queues CUDA's seeding, with a
        # traceback each time, until CUDA starts.)
        torch.random.default_generator.manual_seed(seed)
        if torch.cuda.is_initialized():
            torch.cuda.manual_seed_all(seed)


class Population:
    """The federation's clients as this worker makes them: a shard from ``data``, a trainer
    from ``trainer(shard)`` or ``train_fn`` itself."""

    def __init__(self, spec: Dict[str, Any], setup: Dict[str, Any]) -> None:
        from ..client import checked_evaluate, checked_train
        from .data import bind

        self.seed = int(setup["seed"])
        self.threads = max(1, int(setup.get("threads", 1)))
        self.spec = spec
        self.checked_train, self.checked_evaluate = checked_train, checked_evaluate
        self.data = bind(spec["data"], int(setup["clients"]), self.seed)
        self.last: Optional[Tuple[int, Any]] = None
        self.failed = False

    def shard(self, client: int) -> Any:
        if self.last is None or self.last[0] != client:
            self.last = (client, self.data(client))
        return self.last[1]

    def examples(self, client: int) -> int:
        return self.shard(client).examples

    def trainer(self, client: int) -> Tuple[Callable, Optional[Callable]]:
        shard = self.shard(client)
        factory = self.spec.get("trainer")
        if factory is not None:
            made = factory(shard)
            train, evaluate = made, getattr(made, "evaluate_fn", None)
        else:
            train, evaluate = self.spec["train_fn"], None
        evaluate = self.spec.get("evaluate_fn") or evaluate
        seed, threads, worker = self.seed, self.threads, self

        def config_of(config: Dict[str, Any]) -> Dict[str, Any]:
            return dict(config, client=client, data=shard)

        def train_fn(weights: Dict[str, np.ndarray], config: Dict[str, Any]) -> Any:
            _seed_everything(client_seed(seed, client, int(config.get("round", 0))), threads)
            try:
                return worker.checked_train(train)(weights, config_of(config))
            except Exception:
                worker._first_failure(client)
                raise

        def evaluate_fn(weights: Dict[str, np.ndarray], config: Dict[str, Any]) -> Any:
            _seed_everything(client_seed(seed, client, 1 << 32), threads)
            return worker.checked_evaluate(evaluate)(weights, config_of(config))

        return train_fn, (evaluate_fn if evaluate is not None else None)

    def _first_failure(self, client: int) -> None:
        # The traceback once per worker: the engine says what each later failure raised.
        if not self.failed:
            self.failed = True
            log.exception("client %d's training raised", client)


def main() -> None:
    # One thread for whatever numerical library the user's code starts (the engine asks for
    # one: workers share the cores), before any of them is imported.
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[name] = "1"
    # The engine's pipes, then standard input from nowhere and output to standard error.
    engine_in, engine_out = os.dup(0), os.dup(1)
    nowhere = os.open(os.devnull, os.O_RDONLY)
    os.dup2(nowhere, 0)
    os.close(nowhere)
    os.dup2(2, 1)
    # Ctrl-C reaches the whole process group: the engine stops the workers (it closes their
    # input), so they do not die on their own with a traceback each.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=os.environ.get("HORA_SIMULATION_LOG", "WARNING"), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from .. import _hora

    def open_population(setup: Dict[str, Any]) -> Population:
        with open(setup["data"], "rb") as f:
            # First the driver's import path (so the user's modules import here), then the
            # functions and data, by value where they cannot be imported.
            sys.path[:0] = [p for p in pickle.load(f) if p not in sys.path]
            spec = pickle.load(f)
        return Population(spec, setup)

    try:
        _hora.simulate_worker(open_population, engine_in, engine_out)
    finally:
        os.close(engine_in)
        os.close(engine_out)


if __name__ == "__main__":
    main()
