"""Synchronous data-parallel training with Horovod's API, on Hora's allreduce ring.

::

    import hora.sync as hs
    hs.init()                                   # ranks from the launcher, Spark, or the server
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05 * hs.size())
    hs.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hs.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    for x, y in my_shard_of_each_batch:
        opt.zero_grad(); loss_fn(model(x), y).backward(); opt.step()
    if hs.rank() == 0:
        hs.save_checkpoint("ckpt.pt", {"model": model.state_dict()})

The ring is the one ``hora-client sync`` uses (pipelined reduce-scatter and allgather, a
handshake that keeps strangers out, timeouts); a worker that dies or stalls fails every other
worker with :class:`hora.SyncFailed`, whose ``rank`` names it. Collectives run on host memory:
CUDA tensors are copied to the host and back.
"""

from __future__ import annotations

import os
import pickle
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np

from . import _hora

_ring: Optional[_hora.Ring] = None

def init(
    *,
    peers: Optional[Sequence[str]] = None,
    rank: Optional[int] = None,
    size: Optional[int] = None,
    secret: Optional[str] = None,
    server: Optional[str] = None,
    ca: Optional[str] = None,
    job: Optional[str] = None,
    token: Optional[str] = None,
    listen: str = "127.0.0.1:0",
    advertise: Optional[str] = None,
    timeout_secs: float = 30.0,
    half_precision: bool = False,
) -> None:
    """Joins this process to its job's ring.

    Where the world comes from, first match wins:

    - ``peers`` (or ``HORA_PEERS="host:port,host:port,…"``): every worker's ring address by
      rank, with ``secret`` (or ``HORA_SYNC_SECRET``, 16+ characters, the same everywhere) and
      this worker's ``rank`` (or ``HORA_RANK``, mpirun's or Slurm's variables);
    - ``server`` (or ``HORA_SERVER``) with ``ca``, ``job`` and ``token`` (``HORA_CA``,
      ``HORA_JOB``, ``HORA_SYNC_TOKEN``): meet at the Hora server, which assigns ranks unless
      the launcher gave them; ``size`` (or the launcher's) is the world size;
    - otherwise a world of one.

    Under :func:`hora.spark.run` the world is already formed and ``init()`` does nothing.
    ``timeout_secs`` is how long a silent worker is given before the others fail and name it.
    """
    global _ring
    if _ring is not None and peers is None and server is None:
        return
    rank, size, _, _ = _hora.launch_rank(rank, size)
    if peers is None and os.environ.get("HORA_PEERS"):
        peers = [p for p in os.environ["HORA_PEERS"].split(",") if p]
    server = server or os.environ.get("HORA_SERVER")
    if peers:
        if rank is None:
            raise _hora.HoraError(
                "peers were given but not this worker's rank: pass rank=, or set HORA_RANK "
                "(mpirun and srun set their own)"
            )
        _ring = _hora.Ring.from_peers(
            list(peers),
            rank,
            secret or os.environ.get("HORA_SYNC_SECRET"),
            timeout_secs=timeout_secs,
            half_precision=half_precision,
        )
    elif server:
        ca = ca or os.environ.get("HORA_CA")
        job = job or os.environ.get("HORA_JOB")
        token = token or os.environ.get("HORA_SYNC_TOKEN")
        if not (ca and job and token and size):
            raise _hora.HoraError(
                "meeting at the server needs ca, job, token and the world size "
                "(HORA_CA, HORA_JOB, HORA_SYNC_TOKEN, HORA_WORLD_SIZE)"
            )
        _ring = _hora.Ring.from_server(
            server,
            ca,
            job,
            token,
            size,
            rank=rank,
            listen=listen,
            advertise=advertise,
            timeout_secs=timeout_secs,
            half_precision=half_precision,
        )
    else:
        _ring = _hora.Ring.single()


def _set_ring(ring: _hora.Ring) -> None:
    global _ring
    _ring = ring


def _the_ring() -> _hora.Ring:
    if _ring is None:
        raise _hora.HoraError("hora.sync is not initialised: call hora.sync.init() first")
    return _ring


def shutdown() -> None:
    """Leaves the ring (its connections close); :func:`init` may be called again."""
    global _ring
    _ring = None


def is_initialized() -> bool:
    return _ring is not None


def rank() -> int:
    """This worker's rank, ``0 .. size() - 1``."""
    return _the_ring().rank


def size() -> int:
    """The number of workers."""
    return _the_ring().size


def local_rank() -> int:
    """This worker's rank among those on its host (from the launcher; else its rank)."""
    local = _hora.launch_rank()[2]
    return local if local is not None else rank()


def _host(tensor: Any) -> Tuple[np.ndarray, Any]:
    """A float32 C-contiguous host array holding ``tensor``'s values, and a function that
    writes the array's values back into ``tensor`` (a no-op when they share memory)."""
    if isinstance(tensor, np.ndarray):
        if tensor.dtype == np.float32 and tensor.flags.c_contiguous and tensor.flags.writeable:
            return tensor, lambda: None
        array = np.ascontiguousarray(tensor, dtype=np.float32)

        def back() -> None:
            tensor[...] = array.astype(tensor.dtype, copy=False)

        return array, back
    import torch

    t = tensor.detach()
    if t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous():
        return t.numpy(), lambda: None
    array = t.to(device="cpu", dtype=torch.float32).contiguous().numpy()

    def copy_back() -> None:
        with torch.no_grad():
            tensor.copy_(torch.from_numpy(array))

    return array, copy_back


def allreduce_(tensor: Any, average: bool = True, name: Optional[str] = None) -> Any:
    """Sums (or averages) ``tensor`` over all workers, in place, and returns it. Every worker
    must call it with a tensor of the same size, in the same order."""
    array, back = _host(tensor)
    _the_ring().allreduce(array.reshape(-1), average=average, name=name or "allreduce")
    back()
    return tensor


def allreduce(tensor: Any, average: bool = True, name: Optional[str] = None) -> Any:
    """The mean (or sum) of ``tensor`` over all workers, as a new tensor (or array)."""
    if isinstance(tensor, np.ndarray):
        out = np.array(tensor, dtype=np.float32, copy=True, order="C")
    else:
        out = tensor.detach().clone()
    return allreduce_(out, average=average, name=name)


def broadcast_(tensor: Any, root_rank: int = 0, name: Optional[str] = None) -> Any:
    """Copies ``root_rank``'s ``tensor`` into every worker's, in place, and returns it."""
    array, back = _host(tensor)
    _the_ring().broadcast(array.reshape(-1), root=root_rank, name=name or "broadcast")
    back()
    return tensor


def allgather_object(obj: Any) -> List[Any]:
    """Every worker's (small, picklable) ``obj``, in rank order."""
    return [pickle.loads(b) for b in _the_ring().allgather(pickle.dumps(obj))]


def broadcast_object(obj: Any, root_rank: int = 0) -> Any:
    """``root_rank``'s picklable ``obj`` (of any size: a state dict, an optimizer's state) on
    every worker."""
    ring = _the_ring()
    data = pickle.dumps(obj) if ring.rank == root_rank else b""
    length = pickle.loads(ring.allgather(pickle.dumps(len(data)))[root_rank])
    # The bytes travel as float32 words: broadcast copies exact bits.
    buffer = np.zeros((length + 3) // 4, dtype=np.float32)
    if ring.rank == root_rank:
        buffer.view(np.uint8)[:length] = np.frombuffer(data, dtype=np.uint8)
    ring.broadcast(buffer, root=root_rank, name="broadcast_object")
    return pickle.loads(buffer.view(np.uint8)[:length].tobytes())


def barrier() -> None:
    """Returns once every worker has called it."""
    _the_ring().allgather(b"")


def _fused(
    tensors: Sequence[Any], op: str, fusion_bytes: int, **kwargs: Any
) -> None:
    """Runs ``op`` (allreduce or broadcast) on ``tensors`` in fused host buffers of up to
    ``fusion_bytes``: one collective per bucket instead of one per tensor (Horovod's fusion)."""
    import torch

    ring = _the_ring()
    bucket: List[Any] = []
    nbytes = 0

    def flush(index: int) -> None:
        if not bucket:
            return
        flat = torch.cat([t.detach().reshape(-1).to(device="cpu", dtype=torch.float32) for t in bucket])
        array = flat.numpy()
        shapes = ";".join("x".join(map(str, t.shape)) for t in bucket)
        name = f"{op}:{index}:{shapes}"
        if op == "allreduce":
            ring.allreduce(array, name=name, **kwargs)
        else:
            ring.broadcast(array, name=name, **kwargs)
        at = 0
        with torch.no_grad():
            for t in bucket:
                n = t.numel()
                t.copy_(flat[at : at + n].view_as(t))
                at += n

    index = 0
    for t in tensors:
        size = t.numel() * 4
        if bucket and nbytes + size > fusion_bytes:
            flush(index)
            index += 1
            bucket, nbytes = [], 0
        bucket.append(t)
        nbytes += size
    flush(index)


Params = Union[Mapping[str, Any], Iterable[Tuple[str, Any]]]


def _named(params: Params) -> List[Tuple[str, Any]]:
    items = list(params.items()) if isinstance(params, Mapping) else list(params)
    return sorted(items, key=lambda kv: kv[0])


def broadcast_parameters(params: Params, root_rank: int = 0, fusion_mib: int = 64) -> None:
    """Copies ``root_rank``'s parameters into every worker's (a ``state_dict`` or
    ``named_parameters()``), so that every worker starts from the same model. Floating-point
    entries travel as float32; integer buffers are broadcast exactly through pickling."""
    import torch

    named = _named(params)
    floats = [t for _, t in named if torch.is_tensor(t) and t.is_floating_point()]
    others = {k: t for k, t in named if torch.is_tensor(t) and not t.is_floating_point()}
    _fused(floats, "broadcast", fusion_mib << 20, root=root_rank)
    if others:
        theirs = broadcast_object({k: t.cpu() for k, t in others.items()}, root_rank)
        with torch.no_grad():
            for k, t in others.items():
                t.copy_(theirs[k])


def broadcast_optimizer_state(optimizer: Any, root_rank: int = 0) -> None:
    """Copies ``root_rank``'s optimizer state (momentum buffers, Adam's moments, step counts)
    into every worker's optimizer: needed when resuming from a checkpoint only rank 0 read."""
    state = optimizer.state_dict()
    optimizer.load_state_dict(broadcast_object(state if rank() == root_rank else None, root_rank))


class DistributedOptimizer:
    """Wraps a ``torch.optim`` optimizer so that ``step()`` first averages the gradients over
    all workers (in fused buffers of up to ``fusion_mib``), as Horovod's does.

    With ``backward_passes_per_step = k``, gradients of ``k`` local backward passes accumulate
    before each allreduce and the inner step runs every ``k``-th call of ``step()``.
    Scale the learning rate by :func:`size` yourself (Horovod's rule) when the global batch
    grows with the world. Every other attribute is the wrapped optimizer's.
    """

    def __init__(
        self,
        optimizer: Any,
        named_parameters: Optional[Iterable[Tuple[str, Any]]] = None,
        backward_passes_per_step: int = 1,
        fusion_mib: int = 64,
    ) -> None:
        if backward_passes_per_step < 1:
            raise ValueError("backward_passes_per_step must be at least 1")
        self._optimizer = optimizer
        if named_parameters is not None:
            self._params = [p for _, p in _named(named_parameters)]
        else:
            self._params = [p for g in optimizer.param_groups for p in g["params"]]
        self._passes = backward_passes_per_step
        self._count = 0
        self._fusion = fusion_mib << 20

    def synchronize(self) -> None:
        """Averages the gradients now (``step()`` does it itself)."""
        import torch

        grads = []
        for p in self._params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grads.append(p.grad)
        _fused(grads, "allreduce", self._fusion, average=True)
        if self._passes > 1:
            with torch.no_grad():
                for g in grads:
                    g.div_(self._passes)

    def step(self, closure: Any = None) -> Any:
        self._count += 1
        if self._count % self._passes:
            return None
        self.synchronize()
        return self._optimizer.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._count % self._passes == 0:
            self._optimizer.zero_grad(set_to_none=set_to_none)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._optimizer, name)


def save_checkpoint(path: Union[str, "os.PathLike[str]"], state: Mapping[str, Any]) -> bool:
    """On rank 0, writes ``state`` with ``torch.save`` atomically (a temporary file, then a
    rename, so a crash never leaves half a checkpoint); other ranks do nothing. Returns whether
    this worker wrote it."""
    if rank() != 0:
        return False
    import torch

    path = os.fspath(path)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        torch.save(dict(state), f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return True


def load_checkpoint(path: Union[str, "os.PathLike[str]"], root_rank: int = 0) -> Optional[Dict[str, Any]]:
    """``root_rank``'s checkpoint at ``path`` (None if it has none), on every worker: only the
    root reads the file, so the others need not see the same disk."""
    state = None
    if rank() == root_rank and os.path.exists(path):
        import torch

        state = torch.load(path, map_location="cpu", weights_only=False)
    return broadcast_object(state, root_rank)
