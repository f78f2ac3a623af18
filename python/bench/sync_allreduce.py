"""One hora.sync worker of the Python allreduce benchmark (the Python twin of
examples/collective.rs --bench): times ITERATIONS back-to-back allreduces of each size through
hora.sync.allreduce_ on a float32 torch tensor, after WARMUP; rank 0 prints one JSON line per
size with nccl-tests' algbw and busbw.

usage: sync_allreduce.py RANK PEERS BYTES[,BYTES...] ITERATIONS WARMUP   (HORA_SYNC_SECRET set)
"""

import json
import sys
import time

import torch

import hora.sync as hs


def main() -> None:
    rank, peers = int(sys.argv[1]), sys.argv[2].split(",")
    sizes = [int(s) for s in sys.argv[3].split(",")]
    iterations, warmup = int(sys.argv[4]), int(sys.argv[5])
    torch.set_num_threads(1)
    hs.init(peers=peers, rank=rank)
    n = hs.size()
    for size in sizes:
        t = torch.arange(size // 4, dtype=torch.float32) * 0.25 - rank
        for _ in range(warmup):
            hs.allreduce_(t)
        hs.barrier()
        start = time.perf_counter()
        for _ in range(iterations):
            hs.allreduce_(t)
        hs.barrier()
        seconds = (time.perf_counter() - start) / iterations
        if rank == 0:
            algbw = size / seconds
            print(json.dumps({"ranks": n, "bytes": size, "seconds": seconds, "algbw": algbw,
                              "busbw": algbw * 2 * (n - 1) / n}), flush=True)


if __name__ == "__main__":
    main()
