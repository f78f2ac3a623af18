"""The GPU benchmark of the sync mode, in one run (`make bench-gpu`, which first runs the
averaging kernel's fold against a device-to-device copy: common/tch/benches/cuda_fold.rs):

1. NCCL: hora.sync's allreduce of CUDA tensors through NCCL against torch.distributed's NCCL
   backend on the same tensors, one process per GPU. Both are NCCL, so the figure is Hora's
   overhead per call (the agreement over the ring, the wait): target busbw ratio ≥ 0.95. With
   one GPU the world is of one, and the ratio is of algbw (busbw is 0 by definition).
2. The ring from CUDA tensors through pinned host memory (HORA_NCCL=off) against
   torch.distributed's Gloo backend with CUDA tensors, two processes (sharing a GPU when there
   is only one).

Best of REPEATS interleaved runs. Without a CUDA device it says so and measures nothing.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import subprocess
import sys
from pathlib import Path

import torch

REPEATS = 3
WORKER = Path(__file__).parent / "gpu_worker.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(mode: str, n: int, sizes: list, iterations: int, warmup: int) -> dict:
    peers = ",".join(f"127.0.0.1:{free_port()}" for _ in range(n))
    port = str(free_port())
    env = {**os.environ, "HORA_SYNC_SECRET": secrets.token_hex(16), "HORA_LOG": "warn"}
    procs = [subprocess.Popen([sys.executable, str(WORKER), mode, str(r), str(n),
                               ",".join(map(str, sizes)), str(iterations), str(warmup), peers, port],
                              stdout=subprocess.PIPE, text=True, env=env) for r in range(n)]
    out = [p.communicate(timeout=600)[0] for p in procs]
    for p in procs:
        if p.returncode:
            raise RuntimeError(f"{mode} with {n} ranks failed (exit {p.returncode})")
    return {row["bytes"]: row for row in map(json.loads, (l for l in out[0].splitlines() if l.startswith("{")))}


def compare(title: str, ours: str, theirs: str, n: int, sizes: list, iterations: int, warmup: int) -> None:
    best: dict = {}
    for _ in range(REPEATS):
        for mode in (ours, theirs):
            for size, row in run(mode, n, sizes, iterations, warmup).items():
                key = (mode, size)
                if key not in best or row["algbw"] > best[key]["algbw"]:
                    best[key] = row
    figure = "busbw" if n > 1 else "algbw"
    print(f"\n{title}, {n} rank(s), {figure} in GB/s, best of {REPEATS}:")
    print(f"  {'MiB':>6} {ours:>10} {theirs:>10} {'ratio':>7}")
    for size in sizes:
        a, b = best[(ours, size)][figure], best[(theirs, size)][figure]
        print(f"  {size >> 20:>6} {a / 1e9:10.2f} {b / 1e9:10.2f} {a / b:7.2f}")
        print(f"RESULT gpu {ours}/{theirs} n={n} {size >> 20}MiB {figure} = {a / b:.2f}")


def main() -> None:
    if not torch.cuda.is_available():
        print("gpu benchmark: skipped: no CUDA device is visible to PyTorch; run it on a machine with one")
        return
    gpus = torch.cuda.device_count()
    print(f"{gpus} × {torch.cuda.get_device_name(0)}, NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}")
    n = min(gpus, 8)
    compare("allreduce through NCCL: hora.sync vs torch.distributed", "hora-nccl", "torch-nccl",
            n, [64 << 20, 256 << 20, 1 << 30], 20, 5)
    compare("allreduce of CUDA tensors on the host: hora.sync's ring (pinned memory) vs Gloo",
            "hora-ring", "gloo", max(n, 2), [4 << 20, 64 << 20], 10, 2)


if __name__ == "__main__":
    main()
