"""Hora for Python: federated learning and synchronous data-parallel training on Hora's Rust core.

- :class:`Client` takes part in a federated task with a training function of your own (or a
  :class:`TorchTrainer`); enrolment, sealing, uploads, retries and resuming after a crash are the
  Rust client's.
- :class:`Admin` drives a server's admin API from a script or a notebook: models from and to
  ``state_dict``, tasks, enrolment tokens, round history.
- :mod:`hora.sync` is Horovod's API (``init``, ``DistributedOptimizer``,
  ``broadcast_parameters``, ``allreduce``) on Hora's allreduce ring.
- :mod:`hora.spark` runs a :mod:`hora.sync` training function on Spark barrier tasks.
- :mod:`hora.simulation` simulates a federation of virtual clients, trained by your
  ``train_fn`` or :class:`TorchTrainer`, on the server's round engine, before you deploy it.

Errors are :class:`HoraError` and its subclasses; their messages say what to do.
"""

from ._hora import (
    HoraError,
    Refused,
    SyncFailed,
    TaskEnded,
    Unavailable,
    __version__,
)
from .admin import Admin
from .client import Client, TrainResult, to_numpy
from .data import load_dataset
from .trainer import TorchTrainer

__all__ = [
    "Admin",
    "Client",
    "HoraError",
    "Refused",
    "SyncFailed",
    "TaskEnded",
    "TorchTrainer",
    "TrainResult",
    "Unavailable",
    "load_dataset",
    "to_numpy",
    "__version__",
]
