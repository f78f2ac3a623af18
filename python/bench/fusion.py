"""hora.sync's fusion, in Rust (`Ring.allreduce_fused`, what `DistributedOptimizer` and
`broadcast_parameters` use) against the fusion Python did before (torch.cat into a flat buffer,
one allreduce per bucket, copied back), measured in the same run on 2 local workers over the
real ring (shared memory between them), 102 MB of gradients as 160 and as 16 tensors.

    python python/bench/fusion.py        (with the `hora` package and torch installed)

prints, per layout, the median of 6 timed calls of each (interleaved) and their ratio."""

import socket
import statistics
import subprocess
import sys
import time

import torch

import hora.sync as hs

def old_fused(tensors, fusion_bytes, **kwargs):
    ring = hs._the_ring()
    bucket, nbytes = [], 0
    def flush(index):
        if not bucket: return
        flat = torch.cat([t.detach().reshape(-1).to(device="cpu", dtype=torch.float32) for t in bucket])
        ring.allreduce(flat.numpy(), name=f"old:{index}", copy=False, **kwargs)
        at = 0
        with torch.no_grad():
            for t in bucket:
                n = t.numel(); t.copy_(flat[at:at+n].view_as(t)); at += n
    index = 0
    for t in tensors:
        size = t.numel() * 4
        if bucket and nbytes + size > fusion_bytes:
            flush(index); index += 1; bucket, nbytes = [], 0
        bucket.append(t); nbytes += size
    flush(index)

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if len(sys.argv) == 1:
    port = free_port()
    other = subprocess.Popen([sys.executable, __file__, "1", str(port)], stderr=subprocess.DEVNULL)
    code = subprocess.call([sys.executable, __file__, "0", str(port)], stderr=subprocess.DEVNULL)
    sys.exit(code or other.wait())

rank = int(sys.argv[1]); port = int(sys.argv[2])
hs.init(peers=[f"127.0.0.1:{port}", f"127.0.0.1:{port+1}"], rank=rank, secret="a-bench-secret-of-16+")
torch.set_num_threads(1)
for count, elems in [(160, 160_000), (16, 1_600_000)]:
    ts = [torch.randn(elems) for _ in range(count)]
    mb = count * elems * 4 / 1e6
    res = {"old": [], "new": []}
    for rep in range(7):
        for kind in ("old", "new"):
            hs.barrier()
            t0 = time.perf_counter()
            if kind == "old": old_fused(ts, 64 << 20, average=True)
            else: hs._fused(ts, "allreduce", 64 << 20, average=True)
            res[kind].append(time.perf_counter() - t0)
    if rank == 0:
        o, n = statistics.median(res["old"][1:]), statistics.median(res["new"][1:])
        print(f"{count} tensors x {elems} floats ({mb:.0f} MB): python torch.cat fusion {o*1e3:.1f} ms, rust fusion {n*1e3:.1f} ms, ratio old/new {o/n:.2f}", flush=True)
