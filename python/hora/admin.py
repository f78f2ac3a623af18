"""The admin API from Python: :class:`Admin`."""

from __future__ import annotations

import json
import os
from typing import Any, Dict, List, Mapping, Optional, Sequence, Union
from urllib.parse import quote

import numpy as np

from . import _hora
from .client import PathLike, _identity, load_state, to_numpy

Weights = Mapping[str, Any]


class Admin:
    """An operator's handle on a Hora server (``/admin/v1``), for scripts and notebooks.

    Args:
        url: ``https://host:port`` of the server.
        ca: the CA certificate (PEM) the server's certificate chains to.
        token: the server's admin token (``HORA_ADMIN_TOKEN`` on the server).
        cert, key: a client certificate (PEM) and its private key, for a server that requires
            mutual TLS (``--client-ca``); ``HORA_CLIENT_CERT`` and ``HORA_CLIENT_KEY`` when not
            given.

    Every method raises :class:`hora.Refused` (with ``code``) when the server refuses, and
    :class:`hora.Unavailable` when it cannot be reached within the retry budget.
    """

    def __init__(
        self,
        url: str,
        ca: PathLike,
        token: str,
        *,
        cert: Optional[PathLike] = None,
        key: Optional[PathLike] = None,
    ) -> None:
        cert, key = _identity(cert, key)
        self._conn = _hora.AdminConnection(url, os.fspath(ca), token, cert, key)

    def _json(self, method: str, path: str, body: Optional[Any] = None) -> Any:
        text = None if body is None else json.dumps(body)
        answer = self._conn.request(method, path, text)
        return json.loads(answer) if answer else None

    @staticmethod
    def _id(value: str) -> str:
        return quote(value, safe="")

    def metrics(self) -> str:
        """The server's Prometheus metrics, as text (what ``/metrics`` serves)."""
        return self._conn.request("GET", "/metrics").decode()

    # Models -----------------------------------------------------------------------------------

    def upload_model(self, state_dict: Weights) -> str:
        """Uploads weights (a ``state_dict`` or a mapping of arrays, stored as float32) and returns
        their digest, to create a task from."""
        data = _hora.encode_model(to_numpy(state_dict))
        return json.loads(self._conn.upload("/admin/v1/models", data))["digest"]

    def upload_module(self, module: Union[bytes, PathLike]) -> str:
        """Uploads a TorchScript module (``torch.jit.save``'s bytes or file) for tasks whose
        Rust clients train it; returns its digest."""
        if not isinstance(module, (bytes, bytearray)):
            with open(module, "rb") as f:
                module = f.read()
        return json.loads(self._conn.upload("/admin/v1/modules", bytes(module)))["digest"]

    def round_model(self, task: str, round: int) -> Dict[str, np.ndarray]:
        """The global model round ``round`` of ``task`` published (round 0: the initial
        weights), as float32 arrays by name; ``model.load_state_dict(
        {k: torch.from_numpy(v) for k, v in admin.round_model(t, r).items()})`` loads it."""
        data = self._conn.request("GET", f"/admin/v1/tasks/{self._id(task)}/rounds/{int(round)}/model")
        return _hora.decode_model(data)

    def base(self, task: str) -> Dict[str, np.ndarray]:
        """The frozen base of a task that trains part of its model (``trainable``): the tensors
        its rounds never change, as float32 arrays by name. Its rounds' models
        (:meth:`round_model`) hold the others."""
        return _hora.decode_model(self._conn.request("GET", f"/admin/v1/tasks/{self._id(task)}/base"))

    def load_round_model(self, module: Any, task: str, round: int) -> None:
        """Loads round ``round``'s model of ``task`` into a ``torch.nn.Module`` (every entry
        of its ``state_dict`` must be in the model, with its shape; dtypes are kept), with the
        task's frozen base when it trains part of its model."""
        weights = self.round_model(task, round)
        if self.task(task).get("frozen_base"):
            weights = {**self.base(task), **weights}
        load_state(module, weights, f"round {round} of task {task!r}")

    # Tasks ------------------------------------------------------------------------------------

    def create_task(
        self,
        task: str,
        initial: Union[str, Weights],
        *,
        rounds: int,
        target_clients: int,
        min_clients: Optional[int] = None,
        round_deadline_secs: int = 600,
        training: Optional[Mapping[str, Any]] = None,
        model: Optional[Mapping[str, Any]] = None,
        strategy: Optional[Mapping[str, Any]] = None,
        secure_aggregation: Optional[Mapping[str, Any]] = None,
        asynchronous: Optional[Mapping[str, Any]] = None,
        differential_privacy: Optional[Mapping[str, Any]] = None,
        trainable: Optional[Sequence[str]] = None,
        **settings: Any,
    ) -> Dict[str, Any]:
        """Creates a federated task and returns its status.

        ``initial`` is a ``state_dict`` (uploaded first) or the digest of an uploaded model.
        ``training`` is sent to every client each round (``epochs``, ``batch_size``,
        ``learning_rate``, ``optimizer``, ``proximal_mu``). ``model`` tells Rust clients what
        to build (e.g. ``{"kind": "builtin", "name": "mlp", "params": {...}}``); Python
        clients bring their own module, so it defaults to ``{"kind": "builtin", "name":
        "python"}``. ``strategy`` (``{"name": "fed_adam"}``, …), ``secure_aggregation``,
        ``asynchronous`` (FedBuff: ``{"buffer_size": 10}``), ``differential_privacy`` and any
        other field of the server's ``CreateTask`` (``over_selection``, ``update_bounds``) are
        passed as they are; the server checks them and says what is wrong.

        ``trainable`` lists the tensors clients train, by name or pattern (``*`` stands for any
        run of characters: ``["*lora_*"]`` for a LoRA adapter); the rest of ``initial`` is a
        frozen base that clients download once, and updates carry the trainable tensors only.
        """
        digest = initial if isinstance(initial, str) else self.upload_model(initial)
        body: Dict[str, Any] = {
            "id": task,
            "initial_model": digest,
            "model": dict(model or {"kind": "builtin", "name": "python"}),
            "rounds": rounds,
            "min_clients": min_clients if min_clients is not None else target_clients,
            "target_clients": target_clients,
            "round_deadline_secs": round_deadline_secs,
        }
        optional = {
            "training": training,
            "strategy": strategy,
            "secure_aggregation": secure_aggregation,
            "asynchronous": asynchronous,
            "differential_privacy": differential_privacy,
        }
        body.update({k: dict(v) for k, v in optional.items() if v is not None})
        if trainable is not None:
            if isinstance(trainable, str):
                raise TypeError("trainable must be a list of tensor names or patterns, not a str")
            body["trainable"] = list(trainable)
        body.update(settings)
        return self._json("POST", "/admin/v1/tasks", body)

    def task(self, task: str) -> Dict[str, Any]:
        """The task's settings, state, published rounds and open round."""
        return self._json("GET", f"/admin/v1/tasks/{self._id(task)}")

    def tasks(self) -> List[Dict[str, Any]]:
        """Every task, as :meth:`task` shows it."""
        return self._json("GET", "/admin/v1/tasks")

    def pause(self, task: str) -> Dict[str, Any]:
        """Pauses the task: the open round waits; clients wait without giving up."""
        return self._json("POST", f"/admin/v1/tasks/{self._id(task)}/pause")

    def resume(self, task: str) -> Dict[str, Any]:
        """Resumes a paused task."""
        return self._json("POST", f"/admin/v1/tasks/{self._id(task)}/resume")

    def stop(self, task: str) -> Dict[str, Any]:
        """Stops the task for good; its published rounds stay readable."""
        return self._json("POST", f"/admin/v1/tasks/{self._id(task)}/stop")

    def rounds(
        self, task: str, after: int = 0, limit: Optional[int] = None
    ) -> List[Dict[str, Any]]:
        """The task's round history, oldest first: participants, examples, metrics, outcome.

        With ``limit``, one page: at most that many entries (every attempt) of the rounds after
        ``after``, read without the rest of the history (at most 10,000 a page)."""
        query = f"?after={int(after)}" + ("" if limit is None else f"&limit={int(limit)}")
        return self._json("GET", f"/admin/v1/tasks/{self._id(task)}/rounds{query}")

    # Clients ----------------------------------------------------------------------------------

    def enrol(self, ttl_secs: Optional[int] = None, tasks: Optional[List[str]] = None,
              aggregator: bool = False, max_contributors: Optional[int] = None) -> str:
        """A one-time enrolment token for one new client (valid ``ttl_secs``, default a day;
        limited to ``tasks`` when given). ``aggregator=True`` for a regional server
        (``hora-server serve --parent``), whose updates stand for several clients: at most
        ``max_contributors`` each, when given."""
        body: Dict[str, Any] = {"ttl_secs": ttl_secs}
        if tasks is not None:
            body["tasks"] = list(tasks)
        if aggregator:
            body["aggregator"] = True
        if max_contributors is not None:
            body["max_contributors"] = max_contributors
        return self._json("POST", "/admin/v1/enrolments", body)["token"]

    def clients(self) -> List[Dict[str, Any]]:
        """Enrolled clients."""
        return self._json("GET", "/admin/v1/clients")

    def revoke(self, client: str) -> Any:
        """Revokes a client's credentials."""
        return self._json("POST", f"/admin/v1/clients/{self._id(client)}/revoke")

    def release(self, client: str) -> Any:
        """Releases a client the server quarantined after repeated refused updates (its
        ``strikes`` start again); ``clients()`` shows who is quarantined and why."""
        return self._json("POST", f"/admin/v1/clients/{self._id(client)}/release")

    # Sync jobs --------------------------------------------------------------------------------

    def create_sync_job(self, job: str, world_size: int, min_world_size: Optional[int] = None,
                        settle_ms: Optional[int] = None) -> Dict[str, Any]:
        """A sync job whose workers meet at this server; the answer holds the job's ``token``
        (shown once). With ``min_world_size`` it is elastic (:mod:`hora.elastic`): worlds of
        ``min_world_size`` to ``world_size`` workers form after ``settle_ms`` of quiet (default
        one second)."""
        body: Dict[str, Any] = {"id": job, "world_size": world_size}
        if min_world_size is not None:
            body["min_world_size"] = min_world_size
        if settle_ms is not None:
            body["settle_ms"] = settle_ms
        return self._json("POST", "/admin/v1/sync-jobs", body)

    def sync_jobs(self) -> List[Dict[str, Any]]:
        """Every sync job (no tokens): its worlds formed, who waits, and whether its training
        ``finished``."""
        return self._json("GET", "/admin/v1/sync-jobs")
