"""hora.sync with 2–4 local processes meeting at the real server: allreduce is the mean, two
workers follow one worker on the combined batch, and a dead worker is named."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from conftest import HERE, log

WORKER = str(HERE / "sync_main.py")


def world(server, procs, n: int, *args: str, timeout: str = "10", env=None):
    ckpt = procs.dir / f"ckpt-{len(procs.procs)}.pt"
    job = f"job-{len(procs.procs)}"
    token = server.admin.create_sync_job(job, n)["token"]
    env = {"HORA_SERVER": server.url, "HORA_CA": str(server.ca), "HORA_JOB": job,
           "HORA_SYNC_TOKEN": token, "HORA_WORLD_SIZE": str(n), "TIMEOUT": timeout,
           "HORA_LOG": "warn", "CKPT": str(ckpt), **(env or {})}
    workers = [procs.start(f"{job}-{r}", [sys.executable, WORKER, *args], env={**env, "HORA_RANK": str(r)})
               for r in range(n)]
    results = []
    for w in workers:
        w.wait(timeout=180)
        text = Path(w.log_path).read_text(errors="replace")
        lines = [l for l in text.splitlines() if l.startswith("RESULT ")]
        results.append(json.loads(lines[-1][7:]) if lines else None)
    return workers, results


@pytest.mark.parametrize("n", [2, 3, 4])
def test_allreduce_is_the_mean(server, procs, n):
    workers, results = world(server, procs, n, "allreduce")
    mean = sum(range(1, n + 1)) / n
    for w, r in zip(workers, results):
        assert w.returncode == 0 and r is not None, log(w)
        assert r["min"] == pytest.approx(mean, rel=1e-6) and r["max"] == pytest.approx(mean, rel=1e-6)
        assert r["mean"] == pytest.approx([i * mean for i in range(10)], rel=1e-6)
        assert r["sum"] == pytest.approx([i * mean * n for i in range(10)], rel=1e-6)
        assert r["ranks"] == list(range(n))
        # Rank 0 alone wrote the checkpoint; every rank read rank 0's.
        assert r["wrote"] == (r is results[0]) and r["step"] == 7 and r["w"] == [1.5] * 3
        assert r["momentum"] == [1.0] * 3, "rank 0's optimizer state everywhere"
        a, b, c, d, e = r["fused"]
        assert a == [[mean] * 3] * 2 and b == [mean] * 5 and c == [[mean] * 3] * 4
        assert d == pytest.approx([i * mean for i in range(3)]) and e == pytest.approx([i * mean for i in range(3, 6)])
        assert r["base"] == d + e, "the views were written back into their storage"
        assert r["fused_dtypes"][1] == "torch.float64", "a tensor keeps its dtype"
        last = n - 1
        assert r["params"] == {"a": [last] * 4, "b": [[last] * 2] * 2, "steps": [last]}


def test_two_workers_match_one_worker_on_the_combined_batch(server, procs):
    _, [one] = world(server, procs, 1, "train", "--batch", "32")
    _, two = world(server, procs, 2, "train", "--batch", "16")
    assert one is not None and two[0] is not None and two[1] is not None
    assert two[0] == two[1], "the workers of one job hold the same model"
    for name, values in one.items():
        assert two[0][name] == pytest.approx(values, abs=2e-5), name


def test_a_killed_worker_fails_the_others_naming_its_rank(server, procs):
    workers, results = world(server, procs, 3, "die", timeout="5")
    assert workers[1].returncode == 3
    for r in (0, 2):
        assert workers[r].returncode == 0, log(workers[r])
        assert results[r]["rank"] == 1, results[r]
        assert "rank 1" in results[r]["message"], results[r]


def test_workers_given_their_peers_need_no_server(procs):
    from conftest import free_port

    n = 2
    env = {"HORA_PEERS": ",".join(f"127.0.0.1:{free_port()}" for _ in range(n)),
           "HORA_SYNC_SECRET": "a secret of the tests, long enough", "TIMEOUT": "10",
           "CKPT": str(procs.dir / "peers.pt"), "HORA_LOG": "warn"}
    workers = [procs.start(f"peer-{r}", [sys.executable, WORKER, "allreduce"], env={**env, "HORA_RANK": str(r)})
               for r in range(n)]
    for w in workers:
        assert w.wait(timeout=120) == 0, log(w)
        assert '"ranks": [0, 1]' in Path(w.log_path).read_text()


def test_workers_torchrun_starts_on_one_host_meet_by_themselves(procs):
    from conftest import free_port

    env = {"HORA_SYNC_SECRET": "a secret of the tests, long enough", "TIMEOUT": "10",
           "CKPT": str(procs.dir / "torchrun.pt"), "HORA_LOG": "warn", "OMP_NUM_THREADS": "1"}
    run = procs.start("torchrun", [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
        "--master-addr", "127.0.0.1", "--master-port", str(free_port()), WORKER, "allreduce",
    ], env=env)
    assert run.wait(timeout=180) == 0, log(run)
    # Both workers' lines, in one ring of two (not two worlds of one).
    assert Path(run.log_path).read_text().count('"ranks": [0, 1]') == 2, log(run)


def test_a_launcher_world_with_nowhere_to_meet_is_an_error_not_a_world_of_one(procs):
    lonely = procs.start("lonely", [sys.executable, "-c", "import hora.sync as hs; hs.init()"],
                         env={"TORCHELASTIC_RUN_ID": "none", "RANK": "0", "WORLD_SIZE": "2",
                              "HORA_LOG": "warn"})
    assert lonely.wait(timeout=60) != 0
    assert "one of 2, but not where to meet the others" in Path(lonely.log_path).read_text()


def peers_world(procs, n: int, mode: str, **env: str):
    """`n` workers of `mode` given their peers (no server); their processes and RESULTs."""
    from conftest import free_port

    env = {"HORA_PEERS": ",".join(f"127.0.0.1:{free_port()}" for _ in range(n)),
           "HORA_SYNC_SECRET": "a secret of the tests, long enough", "TIMEOUT": "10",
           "HORA_LOG": "warn", **env}
    workers = [procs.start(f"{mode}-{r}", [sys.executable, WORKER, mode], env={**env, "HORA_RANK": str(r)})
               for r in range(n)]
    results = []
    for w in workers:
        w.wait(timeout=120)
        lines = [l for l in Path(w.log_path).read_text(errors="replace").splitlines() if l.startswith("RESULT ")]
        results.append(json.loads(lines[-1][7:]) if lines else None)
    return workers, results


def test_objects_travel_as_json_and_nothing_is_unpickled(procs):
    marker = procs.dir / "code-ran"
    workers, results = peers_world(procs, 2, "objects", CKPT=str(procs.dir / "objects.pt"), MARKER=str(marker))
    for w, r in zip(workers, results):
        assert w.returncode == 0 and r is not None, log(w)
    zero, one = results
    gathered = [{"rank": 0, "pair": [0, "x"], "f": 0.5}, {"rank": 1, "pair": [1, "x"], "f": 0.5}]
    assert zero["gather"] == one["gather"] == "ok " + json.dumps(gathered)
    assert zero["bcast"] == one["bcast"] == "ok " + json.dumps([None, True, {"k": [1, 2.5]}])
    # Refused on the sender, before sending; the others are told who and why; nobody hangs.
    assert one["set"].startswith("TypeError: the object is a builtins.set"), one["set"]
    assert zero["set"].startswith("HoraError: rank 1 could not send its object: TypeError"), zero["set"]
    assert zero["int_key"].startswith("TypeError: the object has the key 1 of type int"), zero["int_key"]
    assert one["int_key"].startswith("HoraError: rank 0 could not send its object"), one["int_key"]
    assert zero["tensor"].startswith("TypeError: the object is a torch.Tensor"), zero["tensor"]
    assert one["tensor"].startswith("HoraError: rank 0 could not send its object"), one["tensor"]
    assert one["too_big"].startswith("ValueError: allgather_object carries at most"), one["too_big"]
    assert zero["too_big"].startswith("HoraError: rank 1 could not send its object: ValueError")
    assert zero["state"] == one["state"] == "ok " + json.dumps({"w": [0.0, 1.0, 2.0]})
    # A pickle from a member is refused, not run.
    assert one["pickle_as_object"].startswith("HoraError: rank 0 sent, as its object, what is not valid JSON")
    assert one["pickle_as_state"].startswith("HoraError: rank 0 sent a state that torch.load(weights_only=True) refuses")
    assert one["huge"].startswith("HoraError: rank 0 announced 1152921504606846976 bytes of its object"), one["huge"]
    assert zero["save_object"].startswith("TypeError: the checkpoint's state holds builtins.slice"), zero["save_object"]
    assert one["save_object"] == "ok false" and zero["saved"] is False
    assert zero["load_evil"].startswith("TypeError: ") and "weights_only" in zero["load_evil"], zero["load_evil"]
    assert one["load_evil"].startswith("HoraError: rank 0 could not send its checkpoint"), one["load_evil"]
    assert not marker.exists() and not zero["ran_code"] and not one["ran_code"]
    assert zero["barrier"] == one["barrier"] == "ok null"


def test_an_array_resized_by_another_thread_during_a_collective_is_refused_not_freed_under_rust(procs):
    workers, results = peers_world(procs, 2, "resize")
    for w, r in zip(workers, results):
        assert w.returncode == 0 and r is not None, log(w)
    zero, one = results
    # Rank 0's arrays were resized under it: the collective ran on its own copy and says so.
    for what in ("array", "tensor"):
        assert zero[what].startswith("ValueError: the array or tensor was resized"), zero[what]
        # Rank 1 got the mean of the values rank 0 handed in.
        assert one[what] == "ok 1.5", one[what]
    assert zero["after"] == one["after"] == "ok 1.0"


def test_a_timeout_that_is_not_a_number_is_a_value_error(tmp_path):
    """NaN or infinite seconds raise ValueError from the binding, never a Rust panic."""
    import hora
    from hora import _hora

    for bad in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match="finite"):
            _hora.Ring.from_peers(["127.0.0.1:1"], 0, timeout_secs=bad)
        with pytest.raises(ValueError, match="finite"):
            hora.Client("https://127.0.0.1:1", tmp_path / "ca.pem", tmp_path / "state",
                        poll_wait_secs=bad)


class _RunsCode:
    """Creates ``marker`` when unpickled."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.mark.parametrize("torch_lists_globals", [True, False])
def test_states_torch_refuses_to_load_are_refused_with_or_without_torchs_list_of_globals(
        tmp_path, monkeypatch, torch_lists_globals):
    """torch before 2.5 has no get_unsafe_globals_in_checkpoint: a test load with
    weights_only=True says what is refused, and builds nothing it does not allow."""
    torch = pytest.importorskip("torch")
    from hora import sync

    if not torch_lists_globals:
        monkeypatch.delattr(torch.serialization, "get_unsafe_globals_in_checkpoint")
    tag, data = sync._encode_state({"w": torch.arange(3.0), "step": 2, "names": ["a", None]})
    assert sync._decode_state(tag, data, 0)["step"] == 2
    with pytest.raises(TypeError, match="^the state holds .*weights_only=True"):
        sync._encode_state({"cut": slice(1, 2)})
    marker = tmp_path / "code-ran"
    evil = tmp_path / "evil.pt"
    torch.save({"evil": _RunsCode(str(marker))}, evil)
    with pytest.raises(TypeError, match="weights_only=True"):
        sync._check_loadable(str(evil), "the checkpoint")
    assert not marker.exists()


def test_an_elastic_job_survives_a_killed_worker_and_hands_a_newcomer_the_state(server, procs):
    """hora.sync.elastic.run: three workers of a job of two to three; one SIGKILLs itself at step
    22 of the first world. The two survivors roll back to their commit of step 20 (its model and
    optimizer state) and form world 2 of two; a fourth process started then joins at a commit
    (world 3 of three), handed the same state, bit for bit; the three train 20 more steps and end
    with one state."""
    # (A quiet time of 3 s: three cold Python processes join the first world together.)
    token = server.admin.create_sync_job("elastic", 3, min_world_size=2, settle_ms=3000)["token"]
    env = {"HORA_SERVER": server.url, "HORA_CA": str(server.ca), "HORA_JOB": "elastic",
           "HORA_SYNC_TOKEN": token, "HORA_WORLD_SIZE": "3", "HORA_LOG": "warn"}
    argv = [sys.executable, WORKER, "elastic", "--steps", "60"]
    first = [procs.start(f"elastic-{i}", argv, env={**env, **({"DIE_AT": "22"} if i == 1 else {})})
             for i in range(3)]
    assert first[1].wait(timeout=120) == -9, log(first[1])
    survivor = Path(first[0].log_path)
    deadline = time.monotonic() + 60
    while "WORLD 2 2" not in survivor.read_text(errors="replace"):
        assert time.monotonic() < deadline and first[0].poll() is None, log(first[0])
        time.sleep(0.05)
    newcomer = procs.start("elastic-3", argv, env=env)
    results = []
    for w in (first[0], first[2], newcomer):
        assert w.wait(timeout=180) == 0, log(w)
        lines = [l for l in Path(w.log_path).read_text(errors="replace").splitlines()
                 if l.startswith("RESULT ")]
        results.append(json.loads(lines[-1][7:]))
    a, b, c = results
    assert a["digest"] == b["digest"] == c["digest"] and a["step"] == b["step"] == c["step"]
    for r in (a, b):
        assert [(w["generation"], w["size"]) for w in r["worlds"]] == [(1, 3), (2, 2), (3, 3)], r
        assert r["worlds"][1]["step"] == 20, "rolled back to the commit before the loss"
        assert r["worlds"][1]["digest"] == r["commits"]["20"], "to its model and optimizer state"
    assert [(w["generation"], w["size"]) for w in c["worlds"]] == [(3, 3)], c
    assert c["worlds"][0] == a["worlds"][2] == b["worlds"][2], "the newcomer's state is theirs"
    assert a["step"] >= a["worlds"][2]["step"] + 20, "and the three trained on together"
    # The last world's rank 0 told the server the job finished: a worker that comes now (a
    # launcher's retry) has nothing to do, at once.
    late = procs.start("elastic-late", argv, env=env)
    assert late.wait(timeout=60) == 0, log(late)
    lines = [l for l in Path(late.log_path).read_text(errors="replace").splitlines()
             if l.startswith("RESULT ")]
    assert json.loads(lines[-1][7:]) == {"digest": None, "step": 0, "worlds": [], "commits": {}}
    assert "finished training" in log(late)


def test_nccl_is_used_by_every_worker_or_by_none_naming_each_that_cannot():
    """Two rings in one process: one worker's tensors are on the CPU and the other asks for a
    GPU no machine has, so with NCCL required both fail naming both, without it both go on
    without it, and the ring still works."""
    import threading

    import numpy as np

    import hora
    from hora import _hora

    pending = [_hora.PendingRing() for _ in range(2)]
    peers = [p.address for p in pending]
    out = [None, None]

    def worker(r: int) -> None:
        ring = pending[r].connect(peers, r, "a secret of the tests, long enough")
        try:
            ring.use_nccl(-1 if r == 0 else 1 << 20, required=True)
            refused = None
        except hora.SyncFailed as e:
            refused = str(e)
        fallback = ring.use_nccl(-1 if r == 0 else 1 << 20, required=False)
        a = np.full(3, r + 1, np.float32)
        ring.allreduce(a)
        out[r] = (refused, fallback, a.tolist())

    threads = [threading.Thread(target=worker, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for refused, fallback, a in out:
        assert refused and "rank 0: its tensors are on the CPU" in refused, refused
        assert "rank 1: " in refused and "no rank uses it" in refused, refused
        assert fallback is None and a == [1.5] * 3
    version, devices, reason = _hora.nccl_probe()
    assert (devices > 0 and reason is None and version) or (devices == 0 and reason), (version, devices, reason)


def test_cuda_tensors_are_averaged_through_nccl_where_they_are(server, procs):
    torch = pytest.importorskip("torch")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus == 0:
        pytest.skip("no CUDA device here: the NCCL path runs where there is one (make bench-gpu)")
    n = min(gpus, 2)
    workers, results = world(server, procs, n, "cuda", env={"HORA_NCCL": "on"})
    mean = sum(range(1, n + 1)) / n
    for w, r in zip(workers, results):
        assert w.returncode == 0 and r is not None, log(w)
        assert r["nccl"], "NCCL was used"
        assert r["in_place"], "the tensor was reduced where it is, not through a copy"
        assert r["min"] == pytest.approx(mean) and r["max"] == pytest.approx(mean)
        assert r["bf16"] == pytest.approx([mean] * 7, rel=1e-2)
        assert r["strided"] == [[mean] * 3] * 4
        assert r["broadcast"] == [float(n - 1)] * 4
        assert r["digest"] == results[0]["digest"], "every worker holds the same model"
