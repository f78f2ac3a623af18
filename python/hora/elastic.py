"""Elastic training: a synchronous job that survives a lost worker and takes in new ones, with the
shape of Horovod's elastic API (``hvd.elastic.TorchState``, ``hvd.elastic.run``), meeting at the
Hora server. Also reachable as ``hora.sync.elastic``.

::

    import hora.sync as hs

    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    state = hs.elastic.TorchState(model, opt, epoch=0, batch=0)
    state.on_reset(lambda: scale_lr(opt, 0.05 * hs.size()))   # after each world forms

    def train(state):
        dist = hs.DistributedOptimizer(opt, named_parameters=model.named_parameters())
        while state.epoch < 10:
            for x, y in my_shard(state.epoch, start=state.batch, rank=hs.rank(), size=hs.size()):
                dist.zero_grad(); loss_fn(model(x), y).backward(); dist.step()
                state.batch += 1
                if state.batch % 20 == 0:
                    state.commit()
            state.epoch, state.batch = state.epoch + 1, 0
            state.commit()
        return model

    hs.elastic.run(train, state)   # the job from HORA_SERVER, HORA_CA, HORA_JOB, HORA_SYNC_TOKEN

The job is created with a minimum world size (``hora-server admin sync-create JOB
--world-size 4 --min-world-size 2``). :func:`run` forms each world at the server, hands every
rank rank 0's last commit (the server gives rank 0 to the newest one), runs the ``on_reset``
callbacks and calls ``train_fn(state)``; ``run`` returns what it returns. When a worker dies or
stalls, every survivor's collective raises :class:`hora.SyncFailed` (``survivable``): the
survivors roll back to their last :meth:`State.commit`, meet again and go on in a world without
it; below the job's minimum, ``run`` raises :class:`hora.SyncFailed` naming the ranks of the last
world that did not come back. A worker started later waits for the running world's next commit,
where every rank leaves ``train_fn`` (through :class:`WorldChanging`, which must not be caught)
and the larger world forms and hands it the state. ``train_fn`` reads :func:`hora.sync.rank` and
:func:`hora.sync.size` afresh in each world, so the data shards and the global batch follow the
world size.
"""

from __future__ import annotations

import copy
import os
import sys
from typing import Any, Callable, Dict, List, Optional

from . import _hora
from . import sync as _sync


class WorldChanging(BaseException):
    """Raised by :meth:`State.commit` on every rank when workers wait to join: ``run`` leaves
    ``train_fn`` through it and forms the larger world. A ``BaseException``, so ``except
    Exception`` in a training loop does not swallow it; do not catch it yourself."""


class _Meeting:
    """Where and how the job's worlds form."""

    def __init__(self, server: str, ca: str, job: str, token: str, max_world_size: int,
                 listen: str, advertise: Optional[str], timeout_secs: float,
                 half_precision: bool, seal_frames: bool,
                 cert: Optional[str], key: Optional[str]) -> None:
        self.server, self.ca, self.job, self.token = server, ca, job, token
        self.max_world_size = max_world_size
        self.listen, self.advertise = listen, advertise
        self.timeout_secs = timeout_secs
        self.half_precision, self.seal_frames = half_precision, seal_frames
        self.cert, self.key = cert, key

    def meet(self, rejoin: Optional[tuple]) -> _hora.Ring:
        return _hora.Ring.join_elastic(
            self.server, self.ca, self.job, self.token, self.max_world_size, rejoin=rejoin,
            listen=self.listen, advertise=self.advertise, timeout_secs=self.timeout_secs,
            half_precision=self.half_precision, seal_frames=self.seal_frames,
            cert=self.cert, key=self.key,
        )

    def waiting(self) -> int:
        """Workers waiting to join (asked by rank 0, one try of at most 5 s; also tells the
        server the world is alive). A server that does not answer means nobody waits."""
        try:
            _, waiting = _hora.sync_job_status(
                self.server, self.ca, self.job, self.token, timeout_secs=self.timeout_secs,
                cert=self.cert, key=self.key,
            )
        except _hora.HoraError as e:
            print(f"hora: asking the server whether workers wait failed ({e}); going on",
                  file=sys.stderr)
            return 0
        return waiting

    def finish(self) -> None:
        """Tells the server the job's training finished: workers that join later (started
        late, or retried by Spark) learn there is nothing to do instead of waiting."""
        try:
            _hora.sync_job_finish(self.server, self.ca, self.job, self.token,
                                  timeout_secs=self.timeout_secs, cert=self.cert, key=self.key)
        except _hora.HoraError as e:
            print(f"hora: telling the server the job finished failed ({e}); workers that join "
                  "later wait for a world until their timeout", file=sys.stderr)


class State:
    """What an elastic job rolls back to and hands to the workers that join: the progress given
    as keyword arguments (``epoch=0, batch=0``: JSON values, read and written as attributes).
    Subclasses add what else they hold (:class:`TorchState`: a model and an optimizer)."""

    def __init__(self, **progress: Any) -> None:
        object.__setattr__(self, "_progress", dict(progress))
        object.__setattr__(self, "_resets", [])
        object.__setattr__(self, "_saved", None)
        object.__setattr__(self, "_commits", 0)
        object.__setattr__(self, "_meeting", None)

    def __getattr__(self, name: str) -> Any:
        progress = object.__getattribute__(self, "_progress")
        if name in progress:
            return progress[name]
        raise AttributeError(name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self._progress:
            self._progress[name] = value
        else:
            object.__setattr__(self, name, value)

    @property
    def commits(self) -> int:
        """Commits made so far, in this job's history (a worker that joined counts those it was
        handed)."""
        return self._commits

    def on_reset(self, callback: Callable[[], None]) -> None:
        """Calls ``callback()`` each time a world has formed and the state is in place, before
        ``train_fn`` runs (to scale the learning rate by :func:`hora.sync.size`, say)."""
        self._resets.append(callback)

    # -- what subclasses extend -----------------------------------------------------------

    def save(self) -> Dict[str, Any]:
        """A copy of the state, in memory."""
        return {"progress": copy.deepcopy(self._progress)}

    def load(self, saved: Dict[str, Any]) -> None:
        """Puts a copy made by :meth:`save` back."""
        self._progress.clear()
        self._progress.update(copy.deepcopy(saved["progress"]))

    def broadcast(self) -> None:
        """Makes every rank's state rank 0's."""
        theirs = _sync.broadcast_object(self._progress, root_rank=0)
        self._progress.clear()
        self._progress.update(theirs)

    # -- the cycle ------------------------------------------------------------------------

    def commit(self) -> None:
        """Keeps a copy of the state in memory, to roll back to when a worker is lost; then, in
        a running job, asks (on rank 0) whether workers wait to join, and if they do and the
        world is below the job's largest, raises :class:`WorldChanging` on every rank. Call it
        on every rank at the same points (it is a collective in a job), and more often than
        once a minute: rank 0's question is also how the server knows the world is alive (after
        a minute of silence, workers waiting alone may form a world of their own)."""
        self._saved = self.save()
        self._commits += 1
        meeting = self._meeting
        if meeting is None:
            return
        grow = 0
        if _sync.rank() == 0:
            waiting = meeting.waiting()
            grow = int(waiting > 0 and _sync.size() < meeting.max_world_size)
        if _sync.broadcast_object(grow, root_rank=0):
            raise WorldChanging()

    def restore(self) -> None:
        """Rolls back to the last commit (or to the state the current world started from)."""
        if self._saved is not None:
            self.load(self._saved)

    def _start_world(self) -> None:
        """Rank 0's state and commit count on every rank; the starting point is committed."""
        self.broadcast()
        self._commits = _sync.broadcast_object(self._commits, root_rank=0)
        self._saved = self.save()
        for callback in self._resets:
            callback()


class TorchState(State):
    """A :class:`State` holding a ``torch.nn.Module`` and its optimizer (either may be None) as
    well as the progress: their ``state_dict()`` copies are what a commit keeps and what a new
    world's rank 0 hands the others (in ``torch.save``'s format, read back with
    ``weights_only=True``)."""

    def __init__(self, model: Any = None, optimizer: Any = None, **progress: Any) -> None:
        super().__init__(**progress)
        object.__setattr__(self, "model", model)
        object.__setattr__(self, "optimizer", optimizer)

    def save(self) -> Dict[str, Any]:
        saved = super().save()
        if self.model is not None:
            saved["model"] = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        if self.optimizer is not None:
            saved["optimizer"] = copy.deepcopy(self.optimizer.state_dict())
        return saved

    def load(self, saved: Dict[str, Any]) -> None:
        super().load(saved)
        if self.model is not None:
            self.model.load_state_dict(saved["model"])
            # (Gradients of the failed step, half averaged, must not reach the next one.)
            self.model.zero_grad(set_to_none=True)
        if self.optimizer is not None:
            self.optimizer.load_state_dict(copy.deepcopy(saved["optimizer"]))

    def broadcast(self) -> None:
        super().broadcast()
        mine = {}
        if self.model is not None:
            mine["model"] = self.model.state_dict()
        if self.optimizer is not None:
            mine["optimizer"] = self.optimizer.state_dict()
        if mine:
            theirs = _sync.broadcast_state(mine if _sync.rank() == 0 else None, root_rank=0)
            if self.model is not None:
                self.model.load_state_dict(theirs["model"])
                self.model.zero_grad(set_to_none=True)
            if self.optimizer is not None:
                self.optimizer.load_state_dict(theirs["optimizer"])


def run(
    train_fn: Callable[..., Any],
    state: State,
    *args: Any,
    server: Optional[str] = None,
    ca: Optional[str] = None,
    job: Optional[str] = None,
    token: Optional[str] = None,
    max_world_size: Optional[int] = None,
    listen: str = "127.0.0.1:0",
    advertise: Optional[str] = None,
    timeout_secs: float = 30.0,
    half_precision: bool = False,
    seal_frames: bool = True,
    cert: Optional[str] = None,
    key: Optional[str] = None,
    nccl: Optional[str] = None,
    **kwargs: Any,
) -> Any:
    """Runs ``train_fn(state, *args, **kwargs)`` in as many worlds as it takes (see the module's
    documentation) and returns what it returns on this worker. A worker that comes after the
    job's training finished (started late, or retried by its launcher: the last world's rank 0
    tells the server when every rank is done) has nothing to do and returns None.

    ``server``, ``ca``, ``job``, ``token`` and ``max_world_size`` (the job's ``world_size``)
    default to ``HORA_SERVER``, ``HORA_CA``, ``HORA_JOB``, ``HORA_SYNC_TOKEN`` and
    ``HORA_WORLD_SIZE``. ``timeout_secs`` is how long a silent worker is given, and how long the
    survivors wait for each other after a loss. ``listen``, ``advertise``, ``half_precision``,
    ``seal_frames`` (and ``HORA_RING_UNSEALED``), ``cert``, ``key`` and ``nccl`` are as for
    :func:`hora.sync.init`. Build the :class:`hora.sync.DistributedOptimizer` inside
    ``train_fn``: each world needs its own (its count of backward passes starts again)."""
    server, ca, job, token, cert, key = _sync._server_job(server, ca, job, token, cert, key)
    if max_world_size is None and os.environ.get("HORA_WORLD_SIZE"):
        max_world_size = int(os.environ["HORA_WORLD_SIZE"])
    if not (server and ca and job and token and max_world_size):
        raise _hora.HoraError(
            "an elastic job meets at the server: give server, ca, job, token and max_world_size "
            "(HORA_SERVER, HORA_CA, HORA_JOB, HORA_SYNC_TOKEN, HORA_WORLD_SIZE)"
        )
    seal_frames = _sync._ring_sealed(seal_frames)
    _sync._nccl_mode(nccl)
    meeting = _Meeting(server, ca, job, token, max_world_size, listen, advertise, timeout_secs,
                       half_precision, seal_frames, cert, key)
    state._meeting = meeting
    rejoin = None
    try:
        while True:
            try:
                ring = meeting.meet(rejoin)
            except _hora.SyncFailed as e:
                if not getattr(e, "finished", False):
                    raise
                # Started (or retried by its launcher) after the others finished.
                print(f"hora: {e}; nothing to do", file=sys.stderr)
                return None
            try:
                # (Forming NCCL is a collective: a worker lost meanwhile is survivable too.)
                _sync._set_ring(ring, nccl)
                state._start_world()
                result = train_fn(state, *args, **kwargs)
                # Every rank is done before any leaves: one that exits under another's last
                # collective would fail it.
                _sync.barrier()
                if ring.rank == 0:
                    meeting.finish()
                return result
            except WorldChanging:
                # Committed just now, on every rank: the larger world starts from here.
                pass
            except _hora.SyncFailed as e:
                if not getattr(e, "survivable", False):
                    raise
                print(
                    f"hora: world {ring.generation} lost a worker ({e}); rolling back to commit "
                    f"{state.commits} and forming the next world",
                    file=sys.stderr,
                )
                state.restore()
            # (A newcomer whose first world failed before it had a state comes again as one.)
            rejoin = (ring.generation, ring.rank, state.commits) if state._saved else None
            _sync.shutdown()
            del ring
    finally:
        state._meeting = None
        _sync.shutdown()
