"""The federated client: :class:`Client`."""

from __future__ import annotations

import os
from typing import Any, Callable, Dict, Mapping, Optional, Tuple, Union

import numpy as np

from . import _hora

#: What a training function returns: the trained weights (same names and shapes as the global
#: model), the number of examples the update should be weighted by, and optional metrics
#: (``{"loss": …, "accuracy": …}``).
TrainResult = Tuple[Mapping[str, Any], int, Optional[Mapping[str, float]]]

#: ``train_fn(global_weights, config) -> (weights, num_examples, metrics)``.
TrainFn = Callable[[Dict[str, np.ndarray], Dict[str, Any]], TrainResult]

#: What an evaluation function returns: the number of held-out examples evaluated and
#: ``{"loss": …, "accuracy": …}`` (either may be missing).
EvaluateResult = Tuple[int, Mapping[str, Optional[float]]]

#: ``evaluate_fn(global_weights, config) -> (num_examples, metrics)``.
EvaluateFn = Callable[[Dict[str, np.ndarray], Dict[str, Any]], EvaluateResult]

PathLike = Union[str, "os.PathLike[str]"]


def _identity(cert: Optional[PathLike], key: Optional[PathLike]) -> Tuple[Optional[str], Optional[str]]:
    """A client certificate and its key for mutual TLS, from the arguments or else
    ``HORA_CLIENT_CERT`` and ``HORA_CLIENT_KEY`` (the names ``hora-client`` reads)."""
    if cert is None and key is None:
        cert, key = os.environ.get("HORA_CLIENT_CERT"), os.environ.get("HORA_CLIENT_KEY")
    return (None if cert is None else os.fspath(cert), None if key is None else os.fspath(key))


def to_numpy(weights: Mapping[str, Any]) -> Dict[str, np.ndarray]:
    """Weights as C-contiguous float32 NumPy arrays.

    Accepts a ``state_dict`` (``torch.Tensor`` values, on any device) or a mapping of arrays.
    CPU float32 tensors are shared, not copied.
    """
    out: Dict[str, np.ndarray] = {}
    for name, value in weights.items():
        if hasattr(value, "detach") and hasattr(value, "numpy"):  # a torch.Tensor
            import torch

            value = value.detach().to(device="cpu", dtype=torch.float32).contiguous().numpy()
        out[str(name)] = np.ascontiguousarray(value, dtype=np.float32)
    return out


def load_state(module: Any, weights: Mapping[str, np.ndarray], what: str) -> None:
    """Loads float32 arrays by name into ``module`` (a ``torch.nn.Module``), keeping the dtypes of
    its ``state_dict``; every entry must be there, and nothing else."""
    import torch

    own = module.state_dict()
    missing = sorted(set(own) - set(weights))
    extra = sorted(set(weights) - set(own))
    if missing or extra:
        raise ValueError(f"{what} does not fit this module: missing {missing}, unexpected {extra}")
    module.load_state_dict(
        {k: torch.from_numpy(np.asarray(v)).to(own[k].dtype) for k, v in weights.items()}
    )


def checked_train(train_fn: TrainFn) -> TrainFn:
    """``train_fn`` with its result checked and its weights made float32 arrays (what the Rust
    core takes)."""

    def call(weights: Dict[str, np.ndarray], config: Dict[str, Any]) -> TrainResult:
        result = train_fn(weights, config)
        if not isinstance(result, tuple) or len(result) != 3:
            raise TypeError(
                "train_fn must return (weights, num_examples, metrics), "
                f"not {type(result).__name__}"
            )
        trained, num_examples, metrics = result
        return to_numpy(trained), int(num_examples), metrics

    return call


def checked_evaluate(evaluate_fn: EvaluateFn) -> EvaluateFn:
    """``evaluate_fn`` with its result checked."""

    def evaluate(weights: Dict[str, np.ndarray], config: Dict[str, Any]) -> EvaluateResult:
        result = evaluate_fn(weights, config)
        if not isinstance(result, tuple) or len(result) != 2:
            raise TypeError(
                "evaluate_fn must return (num_examples, metrics), "
                f"not {type(result).__name__}"
            )
        num_examples, metrics = result
        return int(num_examples), dict(metrics or {})

    return evaluate


class Client:
    """A federated client of one Hora server.

    The first time, pass the one-time enrolment ``token`` an operator made
    (``Admin.enrol()`` or ``hora-server admin enrol``); the credentials are kept in
    ``state_dir`` and later runs need no token. ``state_dir`` also holds cached models and the
    round in progress: a client restarted with the same ``state_dir`` uploads the update it had
    trained instead of training again.

    Args:
        server: ``https://host:port`` of the server; several, comma-separated, are tried in
            turn when one cannot be reached or is shutting down.
        ca: the CA certificate (PEM) the server's certificate chains to.
        state_dir: where credentials, cached models and the round in progress live.
        token: one-time enrolment token (first run only).
        label: shown to operators in the client list.
        poll_wait_secs: how long one long poll for a round may be held open.
        cert, key: a client certificate (PEM) and its private key, for a server that requires
            mutual TLS (``--client-ca``); ``HORA_CLIENT_CERT`` and ``HORA_CLIENT_KEY`` when not
            given.

    Raises:
        Refused: the server refused the enrolment (``e.code`` says why).
        Unavailable: the server could not be reached within the retry budget.
        HoraError: a bad ``ca`` file or ``state_dir``.
    """

    def __init__(
        self,
        server: str,
        ca: PathLike,
        state_dir: PathLike,
        token: Optional[str] = None,
        *,
        label: Optional[str] = None,
        poll_wait_secs: float = 30.0,
        cert: Optional[PathLike] = None,
        key: Optional[PathLike] = None,
    ) -> None:
        cert, key = _identity(cert, key)
        self._inner = _hora.Client(
            server,
            os.fspath(ca),
            os.fspath(state_dir),
            token=token,
            label=label,
            poll_wait_secs=poll_wait_secs,
            cert=cert,
            key=key,
        )

    @property
    def id(self) -> str:
        """The id the server knows this client by."""
        return self._inner.id

    def run(
        self,
        task: str,
        train_fn: TrainFn,
        *,
        rounds: Optional[int] = None,
        on_round: Optional[Callable[[Dict[str, Any]], None]] = None,
        evaluate_fn: Optional[EvaluateFn] = None,
    ) -> Dict[str, Any]:
        """Takes part in ``task`` until it ends (or ``rounds`` rounds have been contributed to).

        Each round, ``train_fn(global_weights, config)`` is called with the round's global model
        (``dict[str, np.ndarray]``, float32) and the task's training settings (``epochs``,
        ``batch_size``, ``learning_rate``, ``optimizer``, ``proximal_mu``, plus ``task``,
        ``round``, ``model`` and ``seconds_left`` before the round's deadline; and, for a task
        that trains part of its model, ``trainable``: the names of the tensors to train, the
        rest being the frozen base, which the client downloads once and keeps). It returns
        ``(weights, num_examples, metrics)``; weights may be tensors or arrays (for a task that
        trains part of its model: every tensor, or the trainable ones only). Everything else
        (``local − global``, sealing to the round key, secure aggregation's masking, the upload
        with retries, asynchronous tasks' versions) is the Rust client's, the same as
        ``hora-client train``.

        Returns ``{"rounds": [report, ...], "final_state": "finished" | "stopped"}``; each report
        is a dict with ``round``, ``attempt`` (0 first; an abandoned attempt's retry, which
        this client rejoins with the update it trained, is the next), ``outcome``
        (``uploaded``, ``resumed``, ``missed``, ``not_selected``, ``skipped``, ``abandoned``),
        ``accepted``, ``num_examples``, ``metrics``, ``train_secs`` and ``timings`` (seconds
        per phase). ``on_round(report)`` is called as each round ends. An exception raised by ``train_fn`` stops the run and propagates (one
        raised by ``on_round`` does so before the next round is trained);
        Ctrl-C stops it too, and the next run resumes where it left off.

        In a task with federated evaluation (``evaluation`` in its settings), the server asks
        some clients to evaluate published models: ``evaluate_fn(global_weights, config)``
        (``config``: ``task``, ``round``, ``model``) evaluates them on the client's held-out
        data and returns ``(num_examples, {"loss": …, "accuracy": …})``; the server averages
        the reports weighted by ``num_examples`` into the round's history. Without one (and
        without a :class:`TorchTrainer` made with ``eval_loader``, whose ``evaluate_fn`` is
        taken by default) the client declines. An exception in it is logged, and the run goes
        on.
        """
        if evaluate_fn is None:
            evaluate_fn = getattr(train_fn, "evaluate_fn", None)
        evaluate = None if evaluate_fn is None else checked_evaluate(evaluate_fn)
        return self._inner.run(
            task, checked_train(train_fn), rounds=rounds, on_round=on_round, evaluate_fn=evaluate
        )

    def __repr__(self) -> str:
        return f"hora.Client(id={self.id!r})"
