"""Runs a :mod:`hora.sync` training function on Spark barrier tasks, like Databricks'
``HorovodRunner``::

    import hora.spark, hora.sync as hs

    def main(epochs):
        hs.init()                      # the world is already formed: rank, size, the ring
        ...train with hs.DistributedOptimizer...
        return accuracy                # rank 0's result is what run() returns

    accuracy = hora.spark.run(main, args=(10,), num_proc=4)

Each of the ``num_proc`` tasks of one barrier stage is a worker: its rank is the task's
partition id, and the workers learn each other's ring addresses through the barrier's
all-gather, with a fresh random session secret from the driver. A task that raises (or dies)
fails the whole stage; :func:`run` raises :class:`hora.HoraError` naming the rank.

:func:`run_elastic` runs an elastic job (:mod:`hora.sync.elastic`) on ordinary tasks instead,
meeting at the Hora server: a task that dies no longer fails the others, who roll back to their
last commit and go on without it, and Spark retries the failed task where the cluster allows
(``spark.task.maxFailures``; a ``local[N, F]`` master retries F − 1 times), which joins the
running world at its next commit and is handed its state. A task Spark retries after the others
finished has nothing to do and returns at once.
"""

from __future__ import annotations

import re
import secrets
import socket
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

from . import _hora

_RANK_FAILED = re.compile(r"hora worker rank (\d+) failed: (.*)")


def run(
    main: Callable[..., Any],
    args: Sequence[Any] = (),
    kwargs: Optional[Dict[str, Any]] = None,
    *,
    num_proc: Optional[int] = None,
    spark: Any = None,
    host: Optional[str] = None,
    timeout_secs: float = 60.0,
    half_precision: bool = False,
    all_results: bool = False,
) -> Any:
    """Runs ``main(*args, **kwargs)`` on ``num_proc`` Spark barrier tasks, each a
    :mod:`hora.sync` worker, and returns rank 0's result (every rank's, in rank order, with
    ``all_results=True``).

    Args:
        spark: the ``SparkSession`` (default: the active one, or a new one).
        num_proc: the number of workers (default: the context's default parallelism). The
            cluster must be able to run that many tasks at once (barrier mode's rule).
        host: the address the workers' ring ports are advertised at (default: the executor's
            host as Spark reports it; ``127.0.0.1`` on a ``local`` master).
        timeout_secs: how long a silent worker is given before the others fail and name it.
    """
    from pyspark.sql import SparkSession

    session = spark or SparkSession.builder.getOrCreate()
    sc = session.sparkContext
    num_proc = int(num_proc or sc.defaultParallelism)
    if num_proc < 1:
        raise ValueError("num_proc must be at least 1")
    if host is None and sc.master.startswith("local"):
        host = "127.0.0.1"
    secret = secrets.token_hex(16)
    kwargs = dict(kwargs or {})

    def worker(_: Any) -> Any:
        from pyspark import BarrierTaskContext

        from . import sync

        ctx = BarrierTaskContext.get()
        rank = ctx.partitionId()
        advertise = host or ctx.getTaskInfos()[rank].address.rsplit(":", 1)[0]
        pending = _hora.PendingRing(listen=f"{advertise}:0" if host else "0.0.0.0:0", advertise=advertise)
        peers = ctx.allGather(pending.address)
        try:
            ring = pending.connect(
                list(peers), rank, secret, timeout_secs=timeout_secs, half_precision=half_precision
            )
            sync._set_ring(ring)
            result = main(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001 - every failure must name its rank
            sync.shutdown()  # the others learn at once that this worker is gone
            if isinstance(e, _hora.SyncFailed) and e.rank is not None:
                # Lost a peer: give the peer's own error a head start to be the one Spark
                # reports, and name the peer either way.
                time.sleep(2)
                raise RuntimeError(
                    f"hora worker rank {e.rank} failed: (seen by rank {rank}) {e}"
                ) from e
            raise RuntimeError(f"hora worker rank {rank} failed: {type(e).__name__}: {e}") from e
        sync.shutdown()
        yield rank, result

    rdd = sc.parallelize(range(num_proc), num_proc).barrier().mapPartitions(worker)
    try:
        results = sorted(rdd.collect(), key=lambda r: r[0])
    except Exception as e:  # py4j's error carries the failed task's Python traceback
        text = str(e)
        found = _RANK_FAILED.search(text)
        if found:
            raise _hora.HoraError(
                f"the Spark job failed: rank {found.group(1)} failed: {found.group(2).strip()}"
            ) from None
        raise _hora.HoraError(f"the Spark job failed: {text.splitlines()[0] if text else e!r}") from e
    values: List[Any] = [r for _, r in results]
    return values if all_results else values[0]


def run_elastic(
    train_fn: Callable[..., Any],
    make_state: Callable[[], Any],
    args: Sequence[Any] = (),
    kwargs: Optional[Dict[str, Any]] = None,
    *,
    num_proc: int,
    server: str,
    ca: str,
    job: str,
    token: str,
    spark: Any = None,
    host: Optional[str] = None,
    timeout_secs: float = 30.0,
    half_precision: bool = False,
    all_results: bool = False,
) -> Any:
    """Runs ``hora.sync.elastic.run(train_fn, make_state(), *args, **kwargs)`` on ``num_proc``
    Spark tasks, the workers of elastic sync job ``job`` at ``server`` (created with a
    ``world_size`` of ``num_proc`` and a ``min_world_size``: ``hora-server admin sync-create`` or
    :meth:`hora.Admin.create_sync_job`), and returns the result of the last world's rank 0
    (with ``all_results=True``, every worker's that trained in the last world, in its rank
    order).

    The tasks are ordinary ones, not a barrier stage: a task that dies or raises is lost to its
    world only (the others roll back to their last commit and go on, as long as the job's
    minimum remains), and Spark retries it as ``spark.task.maxFailures`` allows; the retry joins
    at the running world's next commit. ``make_state`` builds each worker's
    :class:`hora.sync.elastic.State` (a :class:`~hora.sync.elastic.TorchState` of a fresh model
    and optimizer) on the executor. ``ca`` is a path every executor can read. ``host`` is the
    address the workers' ring ports are advertised at (default: the executor's host name;
    ``127.0.0.1`` on a ``local`` master). A job that ends below its minimum raises
    :class:`hora.HoraError` naming the lost ranks. Spark's speculation (``spark.speculation``)
    must be off: a second copy of a task would join the job as another worker.
    """
    from pyspark.sql import SparkSession

    session = spark or SparkSession.builder.getOrCreate()
    sc = session.sparkContext
    if num_proc < 1:
        raise ValueError("num_proc must be at least 1")
    if host is None and sc.master.startswith("local"):
        host = "127.0.0.1"
    kwargs = dict(kwargs or {})

    def worker(_: Any) -> Any:
        from pyspark import TaskContext

        from . import elastic, sync

        ctx = TaskContext.get()
        advertise = host or socket.getfqdn()
        final = {}

        def train(state: Any, *a: Any, **k: Any) -> Any:
            result = train_fn(state, *a, **k)
            final["rank"] = sync.rank()
            return result

        try:
            result = elastic.run(
                train, make_state(), *args, server=server, ca=ca, job=job, token=token,
                max_world_size=num_proc, listen=f"{advertise}:0" if host else "0.0.0.0:0",
                advertise=advertise, timeout_secs=timeout_secs, half_precision=half_precision,
                **kwargs,
            )
        except Exception as e:  # noqa: BLE001 - Spark retries the task; the message says why
            raise RuntimeError(
                f"hora elastic worker (task {ctx.partitionId()}, attempt {ctx.attemptNumber()}) "
                f"failed: {type(e).__name__}: {e}"
            ) from e
        if "rank" in final:
            yield final["rank"], result

    rdd = sc.parallelize(range(num_proc), num_proc).mapPartitions(worker)
    try:
        results = sorted(rdd.collect(), key=lambda r: r[0])
    except Exception as e:  # py4j's error carries the failed task's Python traceback
        text = str(e)
        found = re.search(r"hora elastic worker \(task \d+, attempt \d+\) failed: (.*)", text)
        why = found.group(1).strip() if found else (text.splitlines()[0] if text else repr(e))
        raise _hora.HoraError(f"the elastic Spark job failed: {why}") from None
    if not results:
        raise _hora.HoraError(f"no worker of elastic job `{job}` trained: it had finished already")
    if results[0][0] != 0 or len({rank for rank, _ in results}) != len(results):
        raise _hora.HoraError(
            f"the elastic Spark job's results are not one world's (ranks {[r for r, _ in results]}): "
            "turn spark.speculation off, which runs a second copy of a task"
        )
    values: List[Any] = [r for _, r in results]
    return values if all_results else values[0]
