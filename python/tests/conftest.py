"""Fixtures: the real `hora-server` binary on loopback TLS (development certificates made on the
fly), Rust clients and Python client processes. Binaries come from HORA_BIN_DIR (default: the
workspace's target/debug, which the README's test command builds first)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import pytest

import hora

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
BIN = Path(os.environ.get("HORA_BIN_DIR", REPO / "target" / "debug"))
ADMIN_TOKEN = "python-tests-admin-token"

# The federation tests' model and data: the Rust client's built-in MLP on Synthetic-IID.
MLP = {"inputs": 60, "hidden": [32], "classes": 10}
DATA = "synthetic-iid:clients=4,seed=11,min_samples=1000,max_samples=1000"


def binary(name: str) -> str:
    path = BIN / name
    if not path.exists():
        pytest.fail(f"{path} is missing: build it first (cargo build --workspace --bins)")
    return str(path)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`hora-server serve` on a loopback port, its data in `dir`."""

    def __init__(self, dir: Path, port: Optional[int] = None, extra: Sequence[str] = (),
                 ca: Optional[Path] = None, cert: Optional[Path] = None,
                 key: Optional[Path] = None) -> None:
        """`extra` flags for `serve`; `ca` when they name certificates, and the admin's client
        certificate (`cert`, `key`) when they require one."""
        self.dir = dir
        self.port = port or free_port()
        self.extra = list(extra)
        self.proc: Optional[subprocess.Popen] = None
        self.start()
        self.ca = ca or dir / "server" / "certs" / "ca.pem"
        self.admin = hora.Admin(self.url, self.ca, ADMIN_TOKEN, cert=cert, key=key)

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [
                binary("hora-server"),
                "serve",
                "--listen",
                f"127.0.0.1:{self.port}",
                "--admin-token",
                ADMIN_TOKEN,
                "--data-dir",
                str(self.dir / "server"),
                *self.extra,
            ],
            stdout=subprocess.PIPE,
            stderr=open(self.dir / "server.log", "ab"),
            env={**os.environ, "HORA_LOG": "warn"},
            text=True,
        )
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("hora-server listening on "):
                self.url = line.split("listening on ", 1)[1].strip()
                break
        else:
            raise RuntimeError(f"hora-server exited before listening: see {self.dir / 'server.log'}")

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def enrol(self) -> str:
        return self.admin.enrol()

    def create_mlp_task(self, task: str, initial: Dict, **settings) -> Dict:
        defaults = dict(
            rounds=5,
            target_clients=4,
            round_deadline_secs=120,
            model={"kind": "builtin", "name": "mlp", "params": MLP},
            training={"epochs": 2, "batch_size": 16, "learning_rate": 0.1,
                      "optimizer": {"name": "sgd", "momentum": 0.5}},
        )
        defaults.update(settings)
        return self.admin.create_task(task, initial, **defaults)

    def wait_finished(self, task: str, timeout: float = 300) -> Dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            info = self.admin.task(task)
            if info["state"] in ("finished", "stopped"):
                return info
            time.sleep(0.2)
        raise TimeoutError(f"task {task} did not finish in {timeout} s: {self.admin.task(task)}")


@pytest.fixture
def server(tmp_path: Path):
    s = Server(tmp_path)
    yield s
    s.kill()


class Processes:
    """Child processes started by a test, ended by their ids when it ends."""

    def __init__(self, dir: Path) -> None:
        self.dir = dir
        self.procs: List[subprocess.Popen] = []

    def start(self, name: str, argv: List[str], env: Optional[Dict[str, str]] = None) -> subprocess.Popen:
        log = open(self.dir / f"{name}.log", "wb")
        proc = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
        )
        proc.log_path = self.dir / f"{name}.log"  # type: ignore[attr-defined]
        self.procs.append(proc)
        return proc

    def python_client(self, name: str, server: Server, task: str, index: int, *extra: str,
                      env: Optional[Dict[str, str]] = None) -> subprocess.Popen:
        return self.start(name, [
            sys.executable, str(HERE / "client_main.py"),
            "--server", server.url, "--ca", str(server.ca),
            "--state-dir", str(self.dir / name), "--token", server.enrol(),
            "--task", task, "--data", DATA, "--index", str(index), "--label", name, *extra,
        ], env=env)

    def rust_client(self, name: str, server: Server, task: str, index: int) -> subprocess.Popen:
        return self.start(name, [
            binary("hora-client"), "train", "--server", server.url, "--ca", str(server.ca),
            "--state-dir", str(self.dir / name), "--token", server.enrol(),
            "--task", task, "--data", DATA, "--client-index", str(index),
            "--threads", "1", "--device", "cpu", "--no-progress", "--label", name,
        ], env={"HORA_LOG": "warn"})

    def wait_all(self, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        for p in self.procs:
            try:
                p.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pytest.fail(f"{p.args[:3]} did not exit: {log(p)}")

    def end(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def log(proc: subprocess.Popen) -> str:
    return Path(proc.log_path).read_text(errors="replace")[-4000:]  # type: ignore[attr-defined]


@pytest.fixture
def procs(tmp_path: Path):
    p = Processes(tmp_path)
    yield p
    p.end()
