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
handshake that keeps strangers out, frames sealed with AES-256-GCM, timeouts); a worker that dies
or stalls fails every other worker with :class:`hora.SyncFailed`, whose ``rank`` names it.
CUDA tensors are averaged where they are, through NCCL (the library PyTorch's wheel ships),
when every worker's tensors are on a GPU: :func:`init` forms an NCCL communicator over the ring
(``nccl="auto"``, the default; ``HORA_NCCL``), pins each worker to GPU ``local_rank() %
device_count``, and every collective of CUDA tensors on that GPU then runs on PyTorch's current
stream without a copy, agreed on over the ring first like every collective. Otherwise (no GPU,
``nccl="off"``, or a worker that cannot load NCCL) collectives run on host memory: CUDA
tensors are copied to pinned host memory and back.

No bytes from another worker reach :mod:`pickle`. Objects (:func:`allgather_object`,
:func:`broadcast_object`) travel as JSON: ``None``, ``bool``, ``int``, ``float`` (NaN and
infinities included), ``str``, and ``list``, ``tuple`` and ``dict`` of those, with ``str`` keys,
nested at most 100 deep. They arrive as the same values, except that a tuple arrives as a list
and a subclass of one of these types as the type itself. Anything else (a tensor, an array, a
set, a dict with an ``int`` key, an object of your own) raises :class:`TypeError` on the worker
that tried to send it, before anything is sent, and the other workers raise
:class:`hora.HoraError` naming it: nobody waits for a value that will never come. States with
tensors (:func:`broadcast_state`, :func:`broadcast_optimizer_state`, :func:`load_checkpoint`)
travel in ``torch.save``'s format and are read with ``torch.load(weights_only=True)``, torch's
restricted unpickler, which builds tensors, numbers, strings and containers and nothing else. Every length that arrives is
checked against a limit before anything is allocated for it: :data:`MAX_OBJECT_BYTES` for an
object, :data:`MAX_STATE_BYTES` for a state.
"""

from __future__ import annotations

import io
import json
import os
import struct
import sys
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np

from . import _hora
from .client import _identity

_ring: Optional[_hora.Ring] = None
#: The CUDA device whose tensors this worker averages through NCCL (None: NCCL is not used).
_nccl_device: Optional[int] = None

#: The most bytes of JSON one object may take in :func:`broadcast_object`; a larger length
#: announced by the root is refused before anything is allocated.
MAX_OBJECT_BYTES = 64 << 20
#: The most bytes of JSON one worker's object may take in :func:`allgather_object` (the ring's
#: limit on a small frame, less one byte).
MAX_GATHERED_BYTES = (64 << 10) - 1
#: The most bytes a state may take in ``torch.save``'s format (:func:`broadcast_state`,
#: :func:`broadcast_optimizer_state`, :func:`load_checkpoint`).
MAX_STATE_BYTES = 16 << 30
#: How deep an object's lists and dicts may nest.
MAX_DEPTH = 100

# What precedes a value on the wire: JSON, a torch.save state, no state, or the sender's failure.
_JSON, _STATE, _NONE, _FAILED = b"J", b"T", b"N", b"E"

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
    seal_frames: bool = True,
    cert: Optional[str] = None,
    key: Optional[str] = None,
    nccl: Optional[str] = None,
) -> None:
    """Joins this process to its job's ring.

    Where the world comes from, first match wins:

    - ``peers`` (or ``HORA_PEERS="host:port,host:port,…"``): every worker's ring address by
      rank, with ``secret`` (or ``HORA_SYNC_SECRET``, 16+ characters, the same everywhere) and
      this worker's ``rank`` (or ``HORA_RANK``, mpirun's or Slurm's variables);
    - ``server`` (or ``HORA_SERVER``) with ``ca``, ``job`` and ``token`` (``HORA_CA``,
      ``HORA_JOB``, ``HORA_SYNC_TOKEN``): meet at the Hora server, which assigns ranks unless
      the launcher gave them; ``size`` (or the launcher's) is the world size; ``cert`` and
      ``key`` (or ``HORA_CLIENT_CERT``, ``HORA_CLIENT_KEY``) for a server that requires mutual
      TLS;
    - a job ``torchrun`` started on one host: rank r listens on ``MASTER_ADDR:MASTER_PORT+1+r``
      (with ``secret`` or ``HORA_SYNC_SECRET`` as for ``peers``);
    - otherwise, when no launcher says there are other workers, a world of one (a launcher that
      says there are, with nowhere to meet them, is an error).

    Under :func:`hora.spark.run` the world is already formed and ``init()`` does nothing.
    ``timeout_secs`` is how long a silent worker is given before the others fail and name it.
    ``seal_frames=False`` (or ``HORA_RING_UNSEALED=1``) leaves the ring's TCP frames unsealed (no
    AES-256-GCM after the handshake): only on a network nobody else can reach, and on every
    worker alike (a worker that seals and one that does not refuse each other).

    ``nccl`` (or ``HORA_NCCL``): ``auto`` (the default) averages CUDA tensors through NCCL when
    PyTorch is imported, sees a GPU on every worker and every worker can load NCCL; ``on``
    fails every worker, naming those that cannot, unless all can; ``off`` keeps collectives on
    host memory. Every worker of a job must ask alike.
    """
    global _ring
    if _ring is not None and peers is None and server is None:
        return
    _nccl_mode(nccl)
    rank, size, _, _ = _hora.launch_rank(rank, size)
    seal_frames = _ring_sealed(seal_frames)
    if peers is None and os.environ.get("HORA_PEERS"):
        peers = [p for p in os.environ["HORA_PEERS"].split(",") if p]
    server = server or os.environ.get("HORA_SERVER")
    if not peers and not server:
        peers = _hora.torchrun_peers()
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
            seal_frames=seal_frames,
        )
    elif server:
        server, ca, job, token, cert, key = _server_job(server, ca, job, token, cert, key)
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
            seal_frames=seal_frames,
            cert=cert,
            key=key,
        )
    elif size is not None and size > 1:
        raise _hora.HoraError(
            f"the launcher says this worker is one of {size}, but not where to meet the others: "
            "give server= (or HORA_SERVER, with a sync job) or peers= (or HORA_PEERS)"
        )
    else:
        _ring = _hora.Ring.single()
    _attach_nccl(_ring, nccl)


def _nccl_mode(nccl: Optional[str]) -> str:
    """``nccl``, else ``HORA_NCCL``, else ``auto``; checked before any collective."""
    mode = (nccl or os.environ.get("HORA_NCCL") or "auto").strip().lower()
    if mode not in ("auto", "on", "off"):
        raise ValueError(f"nccl={mode!r} (or HORA_NCCL): give auto, on or off")
    return mode


def _attach_nccl(ring: _hora.Ring, nccl: Optional[str] = None) -> None:
    """Forms NCCL on ``ring`` as ``nccl`` (else ``HORA_NCCL``, else ``auto``) says: every
    worker takes part (a collective), with its GPU (``local_rank() % device_count``), none, or
    saying its NCCL is off, and either all use NCCL, each on a GPU of its own, or none does.
    The GPU becomes PyTorch's current device once NCCL is formed on it."""
    global _nccl_device
    _nccl_device = None
    mode = _nccl_mode(nccl)
    torch = sys.modules.get("torch")
    if torch is None and mode == "on":
        import torch
    device = -2 if mode == "off" else -1
    if mode != "off" and torch is not None and torch.cuda.is_available():
        device = local_rank() % torch.cuda.device_count()
    if ring.use_nccl(device, required=mode == "on") is not None:
        torch.cuda.set_device(device)
        _nccl_device = device


def _ring_sealed(seal_frames: bool) -> bool:
    """``seal_frames``, unless ``HORA_RING_UNSEALED`` turns the sealing off."""
    return seal_frames and os.environ.get("HORA_RING_UNSEALED", "").lower() not in ("1", "true", "yes")


def _server_job(
    server: Optional[str], ca: Optional[str], job: Optional[str], token: Optional[str],
    cert: Optional[str], key: Optional[str],
) -> Tuple[Optional[str], Optional[str], Optional[str], Optional[str], Optional[str], Optional[str]]:
    """A sync job at the server: each setting its argument, else its variable (``HORA_SERVER``,
    ``HORA_CA``, ``HORA_JOB``, ``HORA_SYNC_TOKEN``, ``HORA_CLIENT_CERT``, ``HORA_CLIENT_KEY``)."""
    env = os.environ
    cert, key = _identity(cert, key)
    return (server or env.get("HORA_SERVER"), ca or env.get("HORA_CA"), job or env.get("HORA_JOB"),
            token or env.get("HORA_SYNC_TOKEN"), cert, key)


def _set_ring(ring: _hora.Ring, nccl: Optional[str] = None) -> None:
    global _ring
    _ring = ring
    _attach_nccl(ring, nccl)


def _the_ring() -> _hora.Ring:
    if _ring is None:
        raise _hora.HoraError("hora.sync is not initialised: call hora.sync.init() first")
    return _ring


def shutdown() -> None:
    """Leaves the ring (its connections close); :func:`init` may be called again."""
    global _ring, _nccl_device
    if _ring is not None and _nccl_device is not None:
        _ring.release_nccl()
    _ring = None
    _nccl_device = None


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


def _resized(size: int) -> ValueError:
    return ValueError(
        f"the array or tensor was resized while the collective ran (it had {size} elements): its "
        "result was not written back; do not resize what a collective is using"
    )


def _to_host(view: Any) -> Any:
    """A float32 contiguous CPU copy of the tensor ``view`` of this module's own: in pinned
    (page-locked) memory when ``view`` is on a GPU, which the copies to and from the device
    run at the full speed of the bus from (PyTorch's caching host allocator keeps the pages
    between calls)."""
    import torch

    if view.is_cuda:
        host = torch.empty(view.shape, dtype=torch.float32, pin_memory=True)
        host.copy_(view)
        return host
    return view.to(device="cpu", dtype=torch.float32, copy=True).contiguous()


def _host(tensor: Any) -> Tuple[np.ndarray, Any]:
    """A float32 C-contiguous host array of this module's own holding ``tensor``'s values (no
    other thread can reach it, so the ring may run on it with the GIL released), and a function
    that writes its values back into ``tensor`` as ``tensor`` is then. Never a view of the
    caller's memory: another thread's ``ndarray.resize(refcheck=False)``, ``Tensor.resize_()``
    or ``set_()`` would free it under the ring."""
    if isinstance(tensor, np.ndarray):
        array = np.array(tensor, dtype=np.float32, order="C", copy=True)

        def back() -> None:
            if tensor.size != array.size:
                raise _resized(array.size)
            tensor[...] = array.reshape(tensor.shape)

        return array, back
    import torch

    host = _to_host(tensor.detach())
    array = host.numpy()

    def copy_back() -> None:
        if tensor.numel() != array.size:
            raise _resized(array.size)
        with torch.no_grad():
            tensor.copy_(host.view(tensor.shape))

    return array, copy_back


def nccl_version() -> Optional[str]:
    """The NCCL version this worker averages CUDA tensors with, or None when it does not."""
    return None if _nccl_device is None else _hora.nccl_probe()[0]


def _on_nccl(tensors: Sequence[Any]) -> bool:
    """Whether ``tensors`` go through NCCL: CUDA tensors, all on the GPU NCCL was formed on."""
    if _nccl_device is None or not tensors:
        return False
    return all(
        getattr(t, "is_cuda", False) and t.device.index == _nccl_device for t in tensors
    )


_NCCL_DTYPES = ("torch.float32", "torch.float16", "torch.bfloat16", "torch.float64")


def _nccl(tensors: Sequence[Any], op: str, name: str, **kwargs: Any) -> None:
    """``op`` (allreduce or broadcast) of CUDA ``tensors`` through NCCL, in one group, on
    PyTorch's current stream. A contiguous tensor of a type NCCL reduces is passed as it is;
    any other (strided, an integer type, or sharing storage with one already listed) through a
    float32 copy on the same GPU, written back afterwards."""
    import torch

    buffers: List[Tuple[int, int, str]] = []
    staged: List[Tuple[Any, Any]] = []
    storages = set()
    with torch.no_grad():
        for t in tensors:
            view = t.detach()
            storage = view.untyped_storage().data_ptr()
            if str(view.dtype) in _NCCL_DTYPES and view.is_contiguous() and storage not in storages:
                work = view
            else:
                work = view.to(dtype=torch.float32, copy=True).contiguous()
                staged.append((t, work))
            storages.add(storage)
            buffers.append((work.data_ptr(), work.numel(), str(work.dtype)))
        stream = torch.cuda.current_stream(_nccl_device).cuda_stream
        ring = _the_ring()
        if op == "allreduce":
            ring.nccl_allreduce(buffers, stream=stream, name=name, **kwargs)
        else:
            ring.nccl_broadcast(buffers, stream=stream, name=name, **kwargs)
        for t, work in staged:
            t.copy_(work.view_as(t))


def allreduce_(tensor: Any, average: bool = True, name: Optional[str] = None) -> Any:
    """Sums (or averages) ``tensor`` over all workers, in place, and returns it. Every worker
    must call it with a tensor of the same size, in the same order. A CUDA tensor goes through
    NCCL where the ring has it, in place; otherwise the ring works on a host copy (see
    :func:`_host`), written back once it is done."""
    if _on_nccl([tensor]):
        _nccl([tensor], "allreduce", name or "allreduce", average=average)
        return tensor
    array, back = _host(tensor)
    _the_ring().allreduce(array.reshape(-1), average=average, name=name or "allreduce", copy=False)
    back()
    return tensor


def allreduce(tensor: Any, average: bool = True, name: Optional[str] = None) -> Any:
    """The mean (or sum) of ``tensor`` over all workers, as a new tensor (or array)."""
    # The result's memory is this function's own until it returns: no second copy.
    ring, name = _the_ring(), name or "allreduce"
    if isinstance(tensor, np.ndarray):
        out = np.array(tensor, dtype=np.float32, copy=True, order="C")
        ring.allreduce(out.reshape(-1), average=average, name=name, copy=False)
        return out
    import torch

    if _on_nccl([tensor]):
        out = tensor.detach().clone(memory_format=torch.contiguous_format)
        _nccl([out], "allreduce", name, average=average)
        return out
    array = _to_host(tensor.detach()).numpy()
    ring.allreduce(array.reshape(-1), average=average, name=name, copy=False)
    return torch.from_numpy(array).view(tensor.shape).to(device=tensor.device, dtype=tensor.dtype)


def broadcast_(tensor: Any, root_rank: int = 0, name: Optional[str] = None) -> Any:
    """Copies ``root_rank``'s ``tensor`` into every worker's, in place, and returns it (a CUDA
    tensor through NCCL where the ring has it)."""
    if _on_nccl([tensor]):
        _nccl([tensor], "broadcast", name or "broadcast", root=root_rank)
        return tensor
    array, back = _host(tensor)
    _the_ring().broadcast(array.reshape(-1), root=root_rank, name=name or "broadcast", copy=False)
    back()
    return tensor


def _check_json(value: Any, where: str, depth: int, open_: set) -> None:
    """Raises TypeError unless ``value`` is made of what travels as JSON (see the module)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return
    if not isinstance(value, (list, tuple, dict)):
        kind = type(value)
        raise TypeError(
            f"{where} is a {kind.__module__}.{kind.__qualname__}: hora.sync sends objects as JSON "
            "(None, bool, int, float, str, and lists, tuples and dicts with str keys of those); "
            "send tensors with broadcast_parameters, allreduce or broadcast_state"
        )
    if depth >= MAX_DEPTH:
        raise TypeError(f"{where} nests deeper than {MAX_DEPTH} lists and dicts")
    if id(value) in open_:
        raise TypeError(f"{where} contains itself")
    open_.add(id(value))
    try:
        if isinstance(value, dict):
            for k, v in value.items():
                if not isinstance(k, str):
                    raise TypeError(
                        f"{where} has the key {k!r} of type {type(k).__name__}: JSON's keys are "
                        "strings, so only str keys are sent (convert the others yourself)"
                    )
                _check_json(v, f"{where}[{k!r}]", depth + 1, open_)
        else:
            for i, v in enumerate(value):
                _check_json(v, f"{where}[{i}]", depth + 1, open_)
    finally:
        open_.discard(id(value))


def _encode_json(obj: Any) -> bytes:
    _check_json(obj, "the object", 0, set())
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def _decode_json(data: bytes, rank: int, what: str) -> Any:
    try:
        return json.loads(data.decode("utf-8"))
    except (ValueError, RecursionError) as e:
        raise _hora.HoraError(
            f"rank {rank} sent, as its {what}, what is not valid JSON ({type(e).__name__}): is "
            "every worker running the same hora version?"
        ) from None


def _failure(error: BaseException) -> bytes:
    """The note a worker sends in place of a value it could not encode."""
    return _FAILED + f"{type(error).__name__}: {error}".encode("utf-8", "replace")[:4096]


def _their_failure(note: bytes, rank: int, what: str) -> _hora.HoraError:
    text = note[1:].decode("utf-8", "replace")
    return _hora.HoraError(f"rank {rank} could not send its {what}: {text}")


def allgather_object(obj: Any) -> List[Any]:
    """Every worker's small ``obj`` (JSON: see the module; at most :data:`MAX_GATHERED_BYTES`
    bytes of it), in rank order. A worker whose ``obj`` cannot be sent raises TypeError (or
    ValueError, too large) and the others :class:`hora.HoraError` naming it."""
    ring = _the_ring()
    error: Optional[BaseException] = None
    try:
        mine = _encode_json(obj)
        if len(mine) > MAX_GATHERED_BYTES:
            raise ValueError(
                f"allgather_object carries at most {MAX_GATHERED_BYTES} bytes of JSON per worker, "
                f"and this object takes {len(mine)}: gather less, or send a large object from one "
                "worker with broadcast_object"
            )
        frame = _JSON + mine
    except (TypeError, ValueError) as e:
        error, frame = e, _failure(e)
    gathered = ring.allgather(frame)
    if error is not None:
        raise error
    values = []
    for r, data in enumerate(gathered):
        if data[:1] == _FAILED:
            raise _their_failure(data, r, "object")
        if data[:1] != _JSON:
            raise _hora.HoraError(f"rank {r} sent something other than an object to allgather_object")
        values.append(_decode_json(data[1:], r, "object"))
    return values


def _broadcast_bytes(
    encode: Callable[[], Tuple[bytes, bytes]], root_rank: int, what: str, limit: int
) -> Tuple[bytes, bytes]:
    """Root's ``encode()`` (a tag and bytes) on every worker. The root announces the length (or
    its failure to encode) first, and every worker checks it against ``limit`` before allocating;
    the bytes then travel as float32 words, which broadcast copies bit for bit."""
    ring = _the_ring()
    if not 0 <= root_rank < ring.size:
        raise ValueError(f"root_rank {root_rank} is not a rank of a world of {ring.size}")
    error: Optional[BaseException] = None
    tag, data = _NONE, b""
    announce = b""
    if ring.rank == root_rank:
        try:
            tag, data = encode()
            if len(data) > limit:
                raise ValueError(
                    f"the {what} takes {len(data)} bytes, more than the {limit} that hora.sync "
                    "sends in one piece"
                )
            announce = struct.pack("<cQ", tag, len(data))
        except Exception as e:  # noqa: BLE001 - reported to every rank, then raised here
            error, announce = e, _failure(e)
    theirs = ring.allgather(announce)[root_rank]
    if error is not None:
        raise error
    if theirs[:1] == _FAILED:
        raise _their_failure(theirs, root_rank, what)
    if len(theirs) != 9:
        raise _hora.HoraError(f"rank {root_rank} announced its {what} in a malformed header")
    tag, length = struct.unpack("<cQ", theirs)
    if length > limit:
        raise _hora.HoraError(
            f"rank {root_rank} announced {length} bytes of its {what}, more than the {limit} this "
            "worker accepts"
        )
    if length == 0:
        return tag, b""
    buffer = np.zeros((length + 3) // 4, dtype=np.float32)
    if ring.rank == root_rank:
        buffer.view(np.uint8)[:length] = np.frombuffer(data, dtype=np.uint8)
    # Its own buffer, reachable by no other thread: no copy.
    ring.broadcast(buffer, root=root_rank, name=what, copy=False)
    if ring.rank == root_rank:
        return tag, data
    return tag, buffer.view(np.uint8)[:length].tobytes()


def broadcast_object(obj: Any, root_rank: int = 0) -> Any:
    """``root_rank``'s ``obj`` (JSON: see the module; at most :data:`MAX_OBJECT_BYTES` bytes of
    it) on every worker; the others' ``obj`` is ignored. States with tensors go with
    :func:`broadcast_state`."""
    tag, data = _broadcast_bytes(lambda: (_JSON, _encode_json(obj)), root_rank, "object", MAX_OBJECT_BYTES)
    if tag != _JSON:
        raise _hora.HoraError(f"rank {root_rank} sent something other than an object to broadcast_object")
    return _decode_json(data, root_rank, "object")


def _check_loadable(saved: Any, what: str) -> None:
    """Raises TypeError if ``torch.load(weights_only=True)`` refuses the ``torch.save`` file or
    buffer ``saved``, naming the globals it refuses where this torch can list them (2.5 and
    later); an older torch tries the load itself (which builds nothing it does not allow) and
    its error says why."""
    import torch

    find = getattr(torch.serialization, "get_unsafe_globals_in_checkpoint", None)
    if find is not None:
        unsafe = list(find(saved))
        if unsafe:
            raise _refuse(
                f"{what} holds {', '.join(sorted(unsafe))}, which torch.load(weights_only=True) "
                "refuses to build"
            )
        return
    try:
        torch.load(saved, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - whatever it refused, the state is refused
        # torch says why after its advice: "... WeightsUnpickler error: Unsupported global: ...".
        reason = " ".join(str(e).split()).rpartition("WeightsUnpickler error:")[2].strip()
        reason = reason.split(". ")[0].split(" Check the documentation")[0].rstrip(".")
        raise _refuse(
            f"{what} holds what torch.load(weights_only=True) refuses to build "
            f"({reason or type(e).__name__})"
        ) from None


def _refuse(what: str) -> TypeError:
    return TypeError(
        f"{what}: keep tensors, numbers, strings, None and lists, tuples and dicts of them in it "
        "(a state_dict() is fine)"
    )


def _encode_state(state: Any) -> Tuple[bytes, bytes]:
    if state is None:
        return _NONE, b""
    import torch

    buffer = io.BytesIO()
    torch.save(state, buffer)
    _check_loadable(io.BytesIO(buffer.getvalue()), "the state")
    return _STATE, buffer.getvalue()


def _decode_state(tag: bytes, data: bytes, root_rank: int) -> Any:
    if tag == _NONE:
        return None
    if tag != _STATE:
        raise _hora.HoraError(f"rank {root_rank} sent something other than a state")
    import torch

    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - whatever the bytes were, they are refused
        raise _hora.HoraError(
            f"rank {root_rank} sent a state that torch.load(weights_only=True) refuses: {e}"
        ) from None


def broadcast_state(state: Any, root_rank: int = 0) -> Any:
    """``root_rank``'s ``state`` — tensors, numbers, strings, None, and lists, tuples and dicts
    of them (a ``state_dict()``, an optimizer's state) — on every worker, as CPU tensors; the
    others' ``state`` is ignored. It travels in ``torch.save``'s format (at most
    :data:`MAX_STATE_BYTES`) and is read with ``torch.load(weights_only=True)``; a state that
    would not load that way raises TypeError on the root, and the others :class:`hora.HoraError`."""
    tag, data = _broadcast_bytes(lambda: _encode_state(state), root_rank, "state", MAX_STATE_BYTES)
    return _decode_state(tag, data, root_rank)


def barrier() -> None:
    """Returns once every worker has called it."""
    _the_ring().allgather(b"")


def _fused(
    tensors: Sequence[Any], op: str, fusion_bytes: int, **kwargs: Any
) -> None:
    """Runs ``op`` (allreduce or broadcast) on ``tensors``, fused in buckets of up to
    ``fusion_bytes`` by the Rust core (one collective per bucket instead of one per tensor:
    Horovod's fusion). A contiguous float32 CPU tensor is handed over as a view of its own
    storage, which Rust packs from and unpacks into with the GIL held; any other (another
    dtype, a GPU's, strided, or sharing storage with one already listed) goes through a float32
    copy that is written back afterwards. CUDA tensors on the GPU the ring averages through
    NCCL go through NCCL instead, in one group, without leaving the GPU."""
    import torch

    if _on_nccl(tensors):
        _nccl(tensors, op, op, **kwargs)
        return
    arrays: List[np.ndarray] = []
    staged: List[Tuple[Any, Any]] = []
    storages = set()
    for t in tensors:
        view = t.detach()
        storage = view.untyped_storage().data_ptr() if view.device.type == "cpu" else None
        if (
            view.dtype == torch.float32
            and storage is not None
            and storage not in storages
            and view.is_contiguous()
        ):
            storages.add(storage)
            arrays.append(view.numpy())
        else:
            if storage is not None:
                storages.add(storage)
            host = _to_host(view)
            arrays.append(host.numpy())
            staged.append((t, host))
    ring = _the_ring()
    if op == "allreduce":
        ring.allreduce_fused(arrays, fusion_bytes=fusion_bytes, name=op, **kwargs)
    else:
        ring.broadcast_fused(arrays, fusion_bytes=fusion_bytes, name=op, **kwargs)
    if staged:
        with torch.no_grad():
            for t, host in staged:
                t.copy_(host.view_as(t))


Params = Union[Mapping[str, Any], Iterable[Tuple[str, Any]]]


def _named(params: Params) -> List[Tuple[str, Any]]:
    items = list(params.items()) if isinstance(params, Mapping) else list(params)
    return sorted(items, key=lambda kv: kv[0])


def broadcast_parameters(params: Params, root_rank: int = 0, fusion_mib: int = 64) -> None:
    """Copies ``root_rank``'s parameters into every worker's (a ``state_dict`` or
    ``named_parameters()``), so that every worker starts from the same model. Floating-point
    entries travel as float32; integer buffers are broadcast exactly (:func:`broadcast_state`)."""
    import torch

    named = _named(params)
    floats = [t for _, t in named if torch.is_tensor(t) and t.is_floating_point()]
    others = {k: t for k, t in named if torch.is_tensor(t) and not t.is_floating_point()}
    _fused(floats, "broadcast", fusion_mib << 20, root=root_rank)
    if others:
        theirs = broadcast_state({k: t.cpu() for k, t in others.items()}, root_rank)
        with torch.no_grad():
            for k, t in others.items():
                t.copy_(theirs[k])


def broadcast_optimizer_state(optimizer: Any, root_rank: int = 0) -> None:
    """Copies ``root_rank``'s optimizer state (momentum buffers, Adam's moments, step counts)
    into every worker's optimizer: needed when resuming from a checkpoint only rank 0 read."""
    state = optimizer.state_dict()
    optimizer.load_state_dict(broadcast_state(state if rank() == root_rank else None, root_rank))


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
    this worker wrote it.

    The checkpoint must load with ``torch.load(weights_only=True)``, as :func:`load_checkpoint`
    reads it: a state holding anything but tensors, numbers, strings, None and lists, tuples and
    dicts of them raises TypeError here, and no file is written."""
    if rank() != 0:
        return False
    import torch

    path = os.fspath(path)
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            torch.save(dict(state), f)
            f.flush()
            os.fsync(f.fileno())
        _check_loadable(tmp, "the checkpoint's state")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return True


def load_checkpoint(path: Union[str, "os.PathLike[str]"], root_rank: int = 0) -> Optional[Dict[str, Any]]:
    """``root_rank``'s checkpoint at ``path`` (None if it has none), on every worker: only the
    root reads the file, so the others need not see the same disk. It is read with
    ``torch.load(weights_only=True)`` on every worker (a checkpoint of arbitrary objects, such as
    one written by an older hora, is refused with an error that says so) and must be at most
    :data:`MAX_STATE_BYTES`."""

    def read() -> Tuple[bytes, bytes]:
        if not os.path.exists(path):
            return _NONE, b""
        size = os.path.getsize(path)
        if size > MAX_STATE_BYTES:
            raise ValueError(f"{os.fspath(path)} takes {size} bytes, more than MAX_STATE_BYTES")
        _check_loadable(
            path, f"{os.fspath(path)} (written by something other than this hora's save_checkpoint?)"
        )
        with open(path, "rb") as f:
            return _STATE, f.read()

    tag, data = _broadcast_bytes(read, root_rank, "checkpoint", MAX_STATE_BYTES)
    return _decode_state(tag, data, root_rank)


# Elastic jobs (a submodule that builds on this one): ``hora.sync.elastic.run``.
from . import elastic  # noqa: E402
