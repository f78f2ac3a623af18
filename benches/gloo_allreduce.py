"""torch.distributed allreduce with the Gloo backend: the baseline of benches/allreduce.rs.

Spawns N processes on loopback, times ITERATIONS back-to-back allreduces of each size (after
WARMUP), and prints one JSON line per size from rank 0 with the same fields as
examples/collective.rs --bench (nccl-tests' algbw and busbw).

usage: gloo_allreduce.py N BYTES[,BYTES...] ITERATIONS WARMUP PORT
"""
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def time_allreduce(rank, n, sizes, iterations, warmup, allreduce, barrier):
    """Times `allreduce(tensor)` on float32 tensors of each size (bytes) and prints rank 0's JSON
    line per size. Shared with python/bench/sync_allreduce.py (hora.sync's twin of this)."""
    for size in sizes:
        t = torch.arange(size // 4, dtype=torch.float32) * 0.25 - rank
        for _ in range(warmup):
            allreduce(t)
        barrier()
        start = time.perf_counter()
        for _ in range(iterations):
            allreduce(t)
        barrier()
        seconds = (time.perf_counter() - start) / iterations
        if rank == 0:
            algbw = size / seconds
            print(json.dumps({"ranks": n, "bytes": size, "seconds": seconds, "algbw": algbw,
                              "busbw": algbw * 2 * (n - 1) / n}), flush=True)


def worker(rank, n, sizes, iterations, warmup, port):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=n)
    time_allreduce(rank, n, sizes, iterations, warmup, dist.all_reduce, dist.barrier)
    dist.destroy_process_group()


if __name__ == "__main__":
    n = int(sys.argv[1])
    sizes = [int(s) for s in sys.argv[2].split(",")]
    iterations, warmup, port = int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
    mp.spawn(worker, args=(n, sizes, iterations, warmup, port), nprocs=n, join=True)
