"""One worker of the GPU allreduce benchmark (python/bench/gpu.py): times ITERATIONS
back-to-back allreduces (sums) of float32 CUDA tensors of each size after WARMUP, on GPU
`rank % device_count`; rank 0 prints one JSON line per size with nccl-tests' algbw and busbw.

usage: gpu_worker.py MODE RANK N BYTES[,BYTES...] ITERATIONS WARMUP PEERS PORT
  MODE: hora-nccl (hora.sync through NCCL), torch-nccl (torch.distributed, NCCL),
        hora-ring (hora.sync's ring through pinned host memory), gloo (torch.distributed, Gloo)
"""

import json
import os
import sys
import time

import torch
import torch.distributed as dist

import hora.sync as hs


def main() -> None:
    mode, rank, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    sizes = [int(s) for s in sys.argv[4].split(",")]
    iterations, warmup = int(sys.argv[5]), int(sys.argv[6])
    peers, port = sys.argv[7].split(","), sys.argv[8]
    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    torch.set_num_threads(1)
    if mode.startswith("hora"):
        hs.init(peers=peers, rank=rank, nccl="on" if mode == "hora-nccl" else "off")

        def allreduce(t: torch.Tensor) -> None:
            hs.allreduce_(t, average=False)

        barrier = hs.barrier
    else:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        backend = "nccl" if mode == "torch-nccl" else "gloo"
        dist.init_process_group(backend, rank=rank, world_size=n)

        def allreduce(t: torch.Tensor) -> None:
            dist.all_reduce(t)

        barrier = dist.barrier
    for size in sizes:
        t = torch.arange(size // 4, dtype=torch.float32, device=device) * 0.25 - rank
        for _ in range(warmup):
            allreduce(t)
        torch.cuda.synchronize()
        barrier()
        start = time.perf_counter()
        for _ in range(iterations):
            allreduce(t)
        torch.cuda.synchronize()
        seconds = (time.perf_counter() - start) / iterations
        barrier()
        if rank == 0:
            algbw = size / seconds
            print(json.dumps({"mode": mode, "ranks": n, "bytes": size, "seconds": seconds,
                              "algbw": algbw, "busbw": algbw * 2 * (n - 1) / n}), flush=True)
    if not mode.startswith("hora"):
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
