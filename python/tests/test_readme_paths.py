"""The README's four five-minute paths, run command for command as a newcomer would.

Each path is the README's code blocks marked `<!-- readme-path: NAME run -->` (shell, run in
order by one bash, as one terminal session) and `<!-- readme-path: NAME file=F -->` (written to
F first), in a fresh directory, with the freshly built `hora-server` and `hora-client` and this
environment's Python (with `hora`, torch and pyspark) first on PATH. Whatever a path leaves
running is killed with its process group."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import List, Tuple

import pytest

from conftest import BIN, REPO, binary

MARK = re.compile(r"<!-- readme-path: (\S+) (run|file=\S+) -->\n```[a-z]*\n(.*?)\n```", re.S)


def path_blocks(name: str) -> List[Tuple[str, str]]:
    """The (kind, text) blocks of path `name`, in README order."""
    readme = (REPO / "README.md").read_text()
    blocks = [(kind, text) for n, kind, text in MARK.findall(readme) if n == name]
    assert blocks, f"README.md has no blocks marked for the path {name!r}"
    return blocks


def run_path(name: str, dir: Path, timeout: float, env: dict = None) -> str:
    """Runs path `name` in `dir`; its output. Fails the test with it on a non-zero exit."""
    script = []
    for kind, text in path_blocks(name):
        if kind == "run":
            script.append(text)
        else:
            (dir / kind[len("file="):]).write_text(text + "\n")
    binary("hora-server"), binary("hora-client")  # present, or the test says how to build them
    with socket.socket() as s:
        # As the server binds: connections of an earlier path in TIME_WAIT do not count.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", 8443))
        except OSError as e:
            pytest.fail(f"the README's paths serve on 127.0.0.1:8443, which is taken: {e}")
    full_env = {
        "PATH": os.pathsep.join([str(BIN), str(Path(sys.executable).parent), "/usr/bin", "/bin"]),
        "HOME": str(dir),
        "HORA_LOG": "warn",
        # Where the operator path finds deploy/task.json: the checkout, as the README allows.
        "HORA_HOME": str(REPO),
    }
    full_env.update(env or {})
    out = dir / "path.log"
    with open(out, "w") as log:
        proc = subprocess.Popen(["bash", "-euo", "pipefail", "-c", "\n".join(script)], cwd=dir,
                                env=full_env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            kill_group(proc)
    text = out.read_text(errors="replace")
    server_log = dir / "server.log"
    if rc != 0:
        extra = server_log.read_text(errors="replace")[-3000:] if server_log.exists() else ""
        pytest.fail(f"the {name} path {'timed out' if rc is None else f'exited {rc}'}:\n"
                    f"{text[-6000:]}\n--- server.log ---\n{extra}")
    return text


def kill_group(proc: subprocess.Popen) -> None:
    """Kills the path's process group and waits until it is gone (the next path reuses the
    port)."""
    pgid = proc.pid
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        return
    proc.wait()  # reaped, or the group stays alive as a zombie
    deadline = time.time() + 30
    while time.time() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)


def test_the_simulation_path_compares_rounds_with_fedbuff_in_simulated_time(tmp_path):
    out = run_path("simulate", tmp_path, timeout=300)
    reached = [float(t) for t in re.findall(r"^accuracy 0.7 first reached at ([0-9.]+) s simulated$", out, re.M)]
    assert len(reached) == 2, out
    rounds, fedbuff = reached
    assert fedbuff < rounds, out
    for name in ("rounds.csv", "fedbuff.csv"):
        rows = (tmp_path / name).read_text().splitlines()
        assert rows[0].startswith("round,attempt,outcome,sim_time_s"), rows[0]
        assert len(rows) == 21, rows
    assert (tmp_path / "fedbuff.safetensors").stat().st_size > 2400


def test_the_python_simulation_path_learns_and_keeps_its_model(tmp_path):
    out = run_path("simulate-python", tmp_path, timeout=300)
    rows = re.findall(r"^\s+(\d+)\s+(published|abandoned)\s+([0-9.]+)\s+(\d+)\s+([0-9.]+)$", out, re.M)
    assert [int(r[0]) for r in rows if r[1] == "published"] == list(range(1, 11)), out
    accuracy = [float(r[4]) for r in rows]
    assert accuracy[-1] > accuracy[0] + 0.2, out
    assert (tmp_path / "accuracy.png").stat().st_size > 10_000
    import torch

    state = torch.load(tmp_path / "model.pt")
    assert sorted(state) == ["0.bias", "0.weight", "2.bias", "2.weight"]
    assert tuple(state["2.weight"].shape) == (10, 32)


def test_the_researcher_path_federates_a_pytorch_model(tmp_path):
    out = run_path("researcher", tmp_path, timeout=200)
    for k in (0, 1):
        assert f"client {k}: ['uploaded', 'uploaded', 'uploaded']" in out, out
    published = re.findall(r"round (\d) published 2 clients, loss ([0-9.]+)", out)
    assert [r for r, _ in published] == ["1", "2", "3"], out
    losses = [float(l) for _, l in published]
    assert losses[-1] < losses[0], f"the training loss did not fall: {out}"


def test_the_operator_path_serves_a_pilot_and_fifty_tokens(tmp_path):
    out = run_path("operator", tmp_path, timeout=200)
    assert len(list((tmp_path / "tokens").glob("hospital-*.json"))) == 50
    for token in (tmp_path / "tokens").glob("hospital-*.json"):
        assert '"token"' in token.read_text()
    assert out.count('"status": "published"') == 2, out
    assert re.search(r'"id": "hospitals"', out), out


def test_the_data_engineer_path_trains_on_spark(tmp_path):
    # Spark's driver on loopback; its Python workers run this environment's Python (pyspark is
    # installed by scripts/setup-python.sh).
    env = {"SPARK_LOCAL_IP": "127.0.0.1", "PYSPARK_PYTHON": sys.executable}
    if "JAVA_HOME" in os.environ:
        env["JAVA_HOME"] = os.environ["JAVA_HOME"]
    out = run_path("spark", tmp_path, timeout=200, env=env)
    found = re.findall(r"^accuracy ([0-9.]+)$", out, re.M)
    assert found, out
    assert float(found[-1]) > 0.8, out
