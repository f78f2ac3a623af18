"""One hora.sync worker of the Python allreduce benchmark (the Python twin of
examples/collective.rs --bench): times ITERATIONS back-to-back allreduces of each size through
hora.sync.allreduce_ on a float32 torch tensor, after WARMUP; rank 0 prints one JSON line per
size with nccl-tests' algbw and busbw.

usage: sync_allreduce.py RANK PEERS BYTES[,BYTES...] ITERATIONS WARMUP   (HORA_SYNC_SECRET set)
"""

import sys
from pathlib import Path

import torch

import hora.sync as hs

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benches"))
from gloo_allreduce import time_allreduce  # noqa: E402 - the same timing loop as the baseline's


def main() -> None:
    rank, peers = int(sys.argv[1]), sys.argv[2].split(",")
    sizes = [int(s) for s in sys.argv[3].split(",")]
    iterations, warmup = int(sys.argv[4]), int(sys.argv[5])
    torch.set_num_threads(1)
    hs.init(peers=peers, rank=rank)
    time_allreduce(rank, hs.size(), sizes, iterations, warmup, hs.allreduce_, hs.barrier)


if __name__ == "__main__":
    main()
