"""A hora.sync worker process for the tests. Modes:

allreduce: rank r holds r+1 everywhere (and a ramp); prints the averages.
train:     the MLP on its slice of each global batch; prints a digest of the final weights.
die:       rank 1 exits abruptly before the first allreduce; the others print the error.
objects:   (2 ranks) objects as JSON, states by torch.load(weights_only=True), and what is
           refused: unsendable objects (on the sender, the others told), pickles a member sends,
           a checkpoint that would run code, a length past the limit; prints the outcomes.
resize:    (2 ranks) while rank 0's allreduce_ waits for rank 1 with the GIL released, another
           thread of rank 0 resizes its array and its tensor; prints the outcomes.
cuda:      (HORA_NCCL=on, one GPU per rank) CUDA tensors through NCCL: in place, bfloat16,
           strided, broadcast, and three steps of the MLP on the GPU; prints the outcomes.
elastic:   hora.sync.elastic.run: the MLP, committing every 5 steps; with DIE_AT=n the process
           SIGKILLs itself at step n of its first world; the survivors train on until a world of
           generation 3 (a newcomer joined) has trained, then to --steps; prints each world's
           size, starting step and state digest, and the final digest.
"""

import argparse
import hashlib
import json
import os
import signal
import struct
import sys
import threading
import time

import numpy as np
import torch

import hora
import hora.sync as hs
from client_main import MLP

DATA = "synthetic-iid:clients=1,seed=3,min_samples=400,max_samples=400"


def fit(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, batch: int, epochs: int) -> None:
    """Trains `model` in lock-step: rank 0's parameters first, then every rank its slice of
    each global batch of `size() × batch` (one seeded permutation per epoch, on every rank), SGD
    with momentum through the DistributedOptimizer."""
    hs.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    opt = hs.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    world, r = hs.size(), hs.rank()
    g = batch * world
    for epoch in range(epochs):
        order = torch.randperm(len(y), generator=torch.Generator().manual_seed(epoch))
        for start in range(0, len(y) - g + 1, g):
            mine = order[start + r * batch: start + (r + 1) * batch]
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x[mine]), y[mine]).backward()
            opt.step()


def train(batch: int, epochs: int) -> dict:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    (x, y), _, _ = hora.load_dataset(DATA, 0)
    x, y = torch.from_numpy(x), torch.from_numpy(y)
    model = MLP() if hs.rank() == 0 else MLP(hidden=32)
    if hs.rank() != 0:  # other ranks start elsewhere: broadcast must make them equal
        torch.nn.init.constant_(model.fc1.weight, 0.3)
    fit(model, x, y, batch, epochs)
    return {k: v.flatten().tolist() for k, v in model.state_dict().items()}


def digest(model: torch.nn.Module, opt: torch.optim.Optimizer) -> str:
    """SHA-256 of the parameters and the optimizer's state (its momentum buffers)."""
    h = hashlib.sha256()
    for k, v in sorted(model.state_dict().items()):
        h.update(k.encode())
        h.update(v.detach().contiguous().numpy().tobytes())
    for i, s in sorted(opt.state_dict()["state"].items()):
        for k, v in sorted(s.items()):
            h.update(f"{i}.{k}".encode())
            h.update(v.detach().contiguous().numpy().tobytes() if torch.is_tensor(v) else repr(v).encode())
    return h.hexdigest()[:16]


def elastic(steps: int) -> dict:
    """See the module's doc: one global batch of 8 a rank a step, from a permutation seeded by
    the step, so any world size takes the same path through the data from a commit."""
    torch.manual_seed(0)
    torch.set_num_threads(1)
    (x, y), _, _ = hora.load_dataset(DATA, 0)
    x, y = torch.from_numpy(x), torch.from_numpy(y)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    state = hs.elastic.TorchState(model, opt, step=0)
    worlds = []
    commits = {}

    def reset() -> None:
        worlds.append({"generation": hs._the_ring().generation, "size": hs.size(),
                       "step": state.step, "digest": digest(model, opt)})
        print(f"WORLD {worlds[-1]['generation']} {hs.size()}", flush=True)

    state.on_reset(reset)
    die_at = int(os.environ.get("DIE_AT", "0"))

    def train(state) -> str:
        dist = hs.DistributedOptimizer(opt, named_parameters=model.named_parameters())
        batch, generation, start = 8, hs._the_ring().generation, state.step
        # Until --steps, and (past them if need be: the same on every rank) until the world a
        # newcomer joined, generation 3, has trained 20 steps.
        while state.step < steps or (generation < 3 and state.step < 100 * steps) or (
                generation >= 3 and state.step < start + 20):
            order = torch.randperm(len(y), generator=torch.Generator().manual_seed(state.step))
            mine = order[hs.rank() * batch: (hs.rank() + 1) * batch]
            dist.zero_grad()
            torch.nn.functional.cross_entropy(model(x[mine]), y[mine]).backward()
            dist.step()
            state.step += 1
            if state.step == die_at and len(worlds) == 1:
                os.kill(os.getpid(), signal.SIGKILL)
            if state.step % 5 == 0:
                if len(worlds) == 1:
                    commits[state.step] = digest(model, opt)
                state.commit()
            time.sleep(0.005)
        return digest(model, opt)

    final = hs.elastic.run(train, state, timeout_secs=15.0)
    return {"digest": final, "step": state.step, "worlds": worlds, "commits": commits}


def outcome(f) -> str:
    """What calling ``f`` did: ``ok <json>`` or ``<ExceptionType>: <message>``."""
    try:
        return "ok " + json.dumps(f())
    except Exception as e:  # noqa: BLE001 - the test reads the type and message
        return f"{type(e).__name__}: {e}"


class Evil:
    """Runs ``touch MARKER`` when unpickled."""

    def __reduce__(self):
        return (os.system, (f"touch {os.environ['MARKER']}",))


def objects() -> dict:
    r = hs.rank()
    out = {}
    out["gather"] = outcome(lambda: hs.allgather_object({"rank": r, "pair": (r, "x"), "f": 0.5}))
    out["bcast"] = outcome(lambda: hs.broadcast_object([None, True, {"k": [1, 2.5]}] if r == 1 else 0, 1))
    # What JSON cannot carry fails on the sender, before anything is sent; the others are told.
    out["set"] = outcome(lambda: hs.broadcast_object({1, 2} if r == 1 else None, 1))
    out["int_key"] = outcome(lambda: hs.allgather_object({1: "a"} if r == 0 else "fine"))
    out["tensor"] = outcome(lambda: hs.broadcast_object(torch.ones(2), 0))
    out["too_big"] = outcome(lambda: hs.allgather_object("x" * 70_000 if r == 1 else "small"))
    # A state with tensors, and the ring is still in step after every refusal.
    out["state"] = outcome(
        lambda: {k: v.tolist() for k, v in hs.broadcast_state({"w": torch.arange(3.0) + r}, 0).items()}
    )
    # A member that sends a pickle instead (straight onto the ring, as a modified worker
    # could): refused as JSON, and refused by torch.load(weights_only=True) as a state.
    import io
    import pickle

    evil = pickle.dumps(Evil())
    buffer = io.BytesIO()
    torch.save({"x": Evil()}, buffer)
    def send_raw(tag: bytes, data: bytes, what: str) -> None:
        hs._broadcast_bytes(lambda: (tag, data), 0, what, hs.MAX_STATE_BYTES)

    out["pickle_as_object"] = outcome(
        lambda: send_raw(b"J", evil, "object") if r == 0 else hs.broadcast_object(None, 0)
    )
    out["pickle_as_state"] = outcome(
        lambda: send_raw(b"T", buffer.getvalue(), "state") if r == 0 else hs.broadcast_state(None, 0)
    )
    # A length past the limit is refused before anything is allocated for it.
    if r == 0:
        hs._the_ring().allgather(struct.pack("<cQ", b"J", 1 << 60))
        out["huge"] = "sent"
    else:
        out["huge"] = outcome(lambda: hs.broadcast_object(None, 0))
    # Checkpoints: one holding an object refuses to be saved; one written by plain torch.save
    # with an object that runs code when unpickled is refused on load, on every rank.
    ckpt = os.environ["CKPT"]
    out["save_object"] = outcome(lambda: hs.save_checkpoint(ckpt, {"step": 1, "cut": slice(1, 2)}))
    out["saved"] = os.path.exists(ckpt)
    if r == 0:
        torch.save({"evil": Evil()}, ckpt)
    hs.barrier()
    out["load_evil"] = outcome(lambda: hs.load_checkpoint(ckpt))
    out["ran_code"] = os.path.exists(os.environ["MARKER"])
    out["barrier"] = outcome(hs.barrier)
    return out


def resize() -> dict:
    r = hs.rank()
    n = 8 << 20  # 32 MiB: memory that is returned to the system when freed
    out = {}
    a = np.full(n, float(r + 1), np.float32)
    t = torch.full((n,), float(r + 1))
    if r == 0:
        def meddle() -> None:
            time.sleep(0.3)  # rank 0 is then inside allreduce_, waiting for rank 1
            a.resize(10, refcheck=False)
            time.sleep(1.0)
            t.set_()  # frees the tensor's storage
            garbage = [np.full(n, 7.0, np.float32) for _ in range(4)]  # reuse what was freed
            del garbage

        meddler = threading.Thread(target=meddle)
        meddler.start()
    else:
        time.sleep(0.8)
    out["array"] = outcome(lambda: float(hs.allreduce_(a).max()))
    if r == 1:
        time.sleep(1.0)
    out["tensor"] = outcome(lambda: float(hs.allreduce_(t).max()))
    if r == 0:
        meddler.join()
    out["after"] = outcome(lambda: float(hs.allreduce(torch.ones(4)).max()))
    return out


def cuda() -> dict:
    def never(view):
        raise AssertionError("a CUDA tensor went through host memory, not NCCL")

    hs._to_host = never
    r, dev = hs.rank(), torch.device("cuda", torch.cuda.current_device())
    t = torch.full((1_000_003,), float(r + 1), device=dev)
    at = t.data_ptr()
    hs.allreduce_(t)
    bf16 = torch.full((7,), float(r + 1), device=dev, dtype=torch.bfloat16)
    hs.allreduce_(bf16)
    strided = torch.full((3, 4), float(r + 1), device=dev).t()
    hs.allreduce_(strided)
    b = torch.full((4,), float(r), device=dev)
    hs.broadcast_(b, root_rank=hs.size() - 1)
    torch.manual_seed(r)
    model = MLP().to(dev)
    hs.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hs.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                  named_parameters=model.named_parameters())
    (x, y), _, _ = hora.load_dataset(DATA, 0)
    x, y = torch.from_numpy(x).to(dev), torch.from_numpy(y).to(dev)
    for step in range(3):
        mine = slice((step * hs.size() + r) * 16, (step * hs.size() + r + 1) * 16)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x[mine]), y[mine]).backward()
        opt.step()
    h = hashlib.sha256()
    for k, v in sorted(model.state_dict().items()):
        h.update(v.detach().cpu().contiguous().numpy().tobytes())
    return {"nccl": hs.nccl_version(), "in_place": t.data_ptr() == at, "min": float(t.min()),
            "max": float(t.max()), "bf16": bf16.float().tolist(), "strided": strided.tolist(),
            "broadcast": b.tolist(), "digest": h.hexdigest()[:16]}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("mode")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--steps", type=int, default=60)
    args = p.parse_args()
    if args.mode == "elastic":
        print("RESULT " + json.dumps(elastic(args.steps)), flush=True)
        return
    hs.init(timeout_secs=float(os.environ.get("TIMEOUT", "10")))
    if args.mode == "allreduce":
        r = hs.rank()
        a = np.full(1_000_003, r + 1, np.float32)
        hs.allreduce_(a)
        t = torch.arange(10, dtype=torch.float32) * (r + 1)
        mean = hs.allreduce(t)
        total = hs.allreduce(t, average=False)
        objs = hs.allgather_object({"rank": r})
        # Rank 0's checkpoint (written by it alone), read back by every rank through rank 0; an
        # optimizer's state (momentum buffers) from rank 0 to all.
        wrote = hs.save_checkpoint(os.environ["CKPT"], {"step": 7, "w": torch.full((3,), 1.5 + r)})
        hs.barrier()
        state = hs.load_checkpoint(os.environ["CKPT"])
        w = torch.nn.Parameter(torch.ones(3))
        opt = torch.optim.SGD([w], lr=0.1, momentum=0.9)
        w.grad = torch.full((3,), float(r + 1))
        opt.step()
        hs.broadcast_optimizer_state(opt, root_rank=0)
        # Fused in Rust, in buckets of 64 bytes: a float32 tensor (a view of its storage), a
        # float64 one, a strided one, and two views of one storage (the second through a copy).
        base = torch.arange(6, dtype=torch.float32) * (r + 1)
        fused = [torch.full((2, 3), float(r + 1)), torch.full((5,), float(r + 1), dtype=torch.float64),
                 torch.full((3, 4), float(r + 1)).t(), base[:3], base[3:]]
        hs._fused(fused, "allreduce", 64, average=True)
        params = {"a": torch.full((4,), float(r)), "b": torch.full((2, 2), float(r), dtype=torch.float64),
                  "steps": torch.tensor([r])}
        hs.broadcast_parameters(params, root_rank=hs.size() - 1, fusion_mib=0)
        print("RESULT " + json.dumps({
            "fused": [t.tolist() for t in fused], "fused_dtypes": [str(t.dtype) for t in fused],
            "base": base.tolist(), "params": {k: t.tolist() for k, t in params.items()},
            "min": float(a.min()), "max": float(a.max()),
            "mean": mean.tolist(), "sum": total.tolist(), "ranks": [o["rank"] for o in objs],
            "wrote": wrote, "step": state["step"], "w": state["w"].tolist(),
            "momentum": opt.state[w]["momentum_buffer"].tolist(),
        }), flush=True)
    elif args.mode == "cuda":
        print("RESULT " + json.dumps(cuda()), flush=True)
    elif args.mode == "train":
        result = train(args.batch, args.epochs)
        print("RESULT " + json.dumps(result), flush=True)
    elif args.mode == "objects":
        print("RESULT " + json.dumps(objects()), flush=True)
    elif args.mode == "resize":
        print("RESULT " + json.dumps(resize()), flush=True)
    elif args.mode == "die":
        if hs.rank() == 1:
            os._exit(3)
        try:
            hs.allreduce(torch.ones(1000))
        except hora.SyncFailed as e:
            print("RESULT " + json.dumps({"rank": e.rank, "message": str(e)}), flush=True)
            return
        print("RESULT " + json.dumps({"rank": None, "message": "no error"}), flush=True)


if __name__ == "__main__":
    sys.exit(main())
