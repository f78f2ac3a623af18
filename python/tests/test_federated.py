"""Python clients against the real server: the same accuracy as Rust clients on the same data,
a mixed federation, the admin API's state_dict round trip, and resumption after a kill."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import hora
from client_main import MLP
from conftest import DATA, Server, log

ROUNDS = 5


def initial_model() -> MLP:
    torch.manual_seed(42)
    return MLP()


def accuracy(server: Server, task: str, round: int) -> float:
    """The accuracy of `task`'s model of `round` on every shard's test split."""
    model = MLP()
    server.admin.load_round_model(model, task, round)
    xs, ys = [], []
    for k in range(4):
        _, (x, y), _ = hora.load_dataset(DATA, k)
        xs.append(torch.from_numpy(x))
        ys.append(torch.from_numpy(y))
    with torch.no_grad():
        predicted = model(torch.cat(xs)).argmax(1)
    return float((predicted == torch.cat(ys)).float().mean())


def summary(proc) -> dict:
    for line in log(proc).splitlines():
        if line.startswith("SUMMARY "):
            return json.loads(line[len("SUMMARY "):])
    pytest.fail(f"no summary from the client: {log(proc)}")


def test_python_clients_reach_the_accuracy_of_rust_clients(server, procs):
    initial = initial_model().state_dict()
    digest = server.admin.upload_model(initial)
    # Every published model is evaluated by the four clients on their held-out splits.
    evaluation = {"clients": 4}
    server.create_mlp_task("rust", digest, rounds=ROUNDS, evaluation=evaluation)
    server.create_mlp_task("python", digest, rounds=ROUNDS, evaluation=evaluation)
    for k in range(4):
        procs.rust_client(f"rust-{k}", server, "rust", k)
        procs.python_client(f"python-{k}", server, "python", k, "--seed", str(k))
    server.wait_finished("rust")
    server.wait_finished("python")
    procs.wait_all()
    for p in procs.procs:
        assert p.returncode == 0, log(p)
    start = accuracy(server, "python", 0)
    rust, python = accuracy(server, "rust", ROUNDS), accuracy(server, "python", ROUNDS)
    print(f"accuracy after {ROUNDS} rounds: rust {rust:.4f}, python {python:.4f} (initial {start:.4f})")
    assert rust > start + 0.25 and python > start + 0.25, (start, rust, python)
    assert abs(rust - python) <= 0.05, (rust, python)
    # Every Python client took part in every round and reported its training metrics.
    for k in range(4):
        rounds = summary(procs.procs[2 * k + 1])["rounds"]
        assert [r["outcome"] for r in rounds] == ["uploaded"] * ROUNDS
        assert all(r["num_examples"] > 0 and r["metrics"]["loss"] > 0 for r in rounds)
    history = server.admin.rounds("python")
    assert [len(r["participants"]) for r in history] == [4] * ROUNDS
    # Federated evaluation: the example-weighted accuracy of the four clients' reports is the
    # accuracy of the same model on the union of their held-out splits, computed here.
    for task in ("rust", "python"):
        evaluations = [r["evaluation"] for r in server.admin.rounds(task)]
        assert [e["clients"] for e in evaluations] == [4] * ROUNDS, evaluations
        for r, e in enumerate(evaluations, start=1):
            centralised = accuracy(server, task, r)
            print(f"{task} round {r}: federated evaluation accuracy {e['accuracy']:.4f}, "
                  f"loss {e['loss']:.4f}; centralised accuracy {centralised:.4f}")
            assert abs(e["accuracy"] - centralised) < 0.005, (task, r, e, centralised)


def test_a_mixed_federation_of_python_and_rust_clients(server, procs):
    digest = server.admin.upload_model(initial_model().state_dict())
    server.create_mlp_task("mixed", digest, rounds=3)
    for k in range(4):
        if k % 2:
            procs.rust_client(f"rust-{k}", server, "mixed", k)
        else:
            procs.python_client(f"python-{k}", server, "mixed", k)
    server.wait_finished("mixed")
    procs.wait_all()
    for p in procs.procs:
        assert p.returncode == 0, log(p)
    history = server.admin.rounds("mixed")
    labels = {c["client_id"]: c["label"] for c in server.admin.clients()}
    assert sorted(labels.values()) == ["python-0", "python-2", "rust-1", "rust-3"]
    # Every round averaged the updates of both kinds of client.
    for r in history:
        assert sorted(labels[c] for c in r["participants"]) == sorted(labels.values()), r
    assert accuracy(server, "mixed", 3) > accuracy(server, "mixed", 0) + 0.25


def test_admin_round_trip_of_a_state_dict(server):
    model = initial_model()
    with torch.no_grad():
        model.fc1.weight[0, 0] = 1.5e-7  # exact float32 values survive
    digest = server.admin.upload_model(model.state_dict())
    info = server.create_mlp_task("trip", digest, rounds=1)
    assert info["global_model"] == digest and info["state"] == "running"
    back = server.admin.round_model("trip", 0)
    assert sorted(back) == sorted(model.state_dict())
    for name, tensor in model.state_dict().items():
        assert back[name].dtype == np.float32
        np.testing.assert_array_equal(back[name], tensor.numpy())
    fresh = MLP()
    server.admin.load_round_model(fresh, "trip", 0)
    for (name, a), b in zip(fresh.state_dict().items(), model.state_dict().values()):
        assert torch.equal(a, b), name
    # The task verbs and their errors.
    assert server.admin.pause("trip")["state"] == "paused"
    assert server.admin.resume("trip")["state"] == "running"
    assert server.admin.stop("trip")["state"] == "stopped"
    with pytest.raises(hora.Refused) as refused:
        server.admin.task("no-such-task")
    assert refused.value.code == "not_found"
    with pytest.raises(hora.Refused):
        hora.Admin(server.url, server.ca, "wrong-token").tasks()
    with pytest.raises(ValueError, match="non-finite value"):
        server.admin.upload_model({"w": torch.tensor([float("nan")])})


def test_a_killed_python_client_resumes_its_upload(server, procs, tmp_path):
    digest = server.admin.upload_model(initial_model().state_dict())
    server.create_mlp_task("resume", digest, rounds=2, target_clients=1)
    hold = str(tmp_path / "hold")
    first = procs.python_client("client", server, "resume", 0, "--hold", hold)
    token_dir = tmp_path / "client"
    wait_for(lambda: os.path.exists(hold + ".trained"), first)
    # The server goes down while the client holds a trained update; the client records it and
    # keeps retrying the upload until it is killed.
    server.kill()
    Path(hold + ".go").touch()
    record = token_dir / "rounds" / "resume.json"
    wait_for(lambda: record.exists() and not json.loads(record.read_text())["uploaded"], first)
    first.kill()
    first.wait()
    # Both come back: the restarted client uploads what it trained, without training again.
    server.start()
    again = procs.start("client-again", [
        *first.args[:2], *[a for a in first.args[2:] if a != "--hold" and a != hold],
        "--must-not-train", "--rounds", "1",
    ])
    assert again.wait(timeout=120) == 0, log(again)
    rounds = summary(again)["rounds"]
    assert [r["outcome"] for r in rounds] == ["resumed"], rounds
    (x, _), _, _ = hora.load_dataset(DATA, 0)
    assert rounds[0]["num_examples"] == len(x)
    history = wait_history(server, "resume", 1)
    assert history[0]["examples"] == len(x)


def wait_for(condition, proc, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if proc.poll() is not None:
            pytest.fail(f"the client exited early: {log(proc)}")
        if time.monotonic() > deadline:
            pytest.fail(f"timed out: {log(proc)}")
        time.sleep(0.05)


def wait_history(server: Server, task: str, n: int, timeout: float = 60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        history = server.admin.rounds(task)
        if len(history) >= n:
            return history
        time.sleep(0.1)
    pytest.fail(f"{task} has not published {n} rounds")


def test_errors_are_python_exceptions_with_the_servers_message(server, tmp_path):
    with pytest.raises(hora.Refused) as refused:
        hora.Client(server.url, server.ca, tmp_path / "c", token="not-a-token")
    assert refused.value.code and "enrol again" in str(refused.value)
    with pytest.raises(hora.HoraError, match="no credentials"):
        hora.Client(server.url, server.ca, tmp_path / "d")
    digest = server.admin.upload_model(initial_model().state_dict())
    server.create_mlp_task("fails", digest, rounds=1, target_clients=1)
    client = hora.Client(server.url, server.ca, tmp_path / "e", token=server.enrol())

    class Boom(Exception):
        pass

    def train(weights, config):
        assert set(weights) == {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"}
        assert weights["fc1.weight"].shape == (32, 60) and config["epochs"] == 2
        raise Boom("the user's own error")

    with pytest.raises(Boom, match="the user's own error"):
        client.run("fails", train)

    def wrong_shape(weights, config):
        return {**weights, "fc1.weight": np.zeros((2, 2), np.float32)}, 1, None

    with pytest.raises(hora.HoraError, match="another layout"):
        client.run("fails", wrong_shape)

    # An exception from on_round stops the run before the next round is trained.
    server.create_mlp_task("callback", digest, rounds=3, target_clients=1)
    trained = []

    def counting(weights, config):
        trained.append(config["round"])
        return weights, 1, None

    def stop(report):
        raise Boom(f"seen round {report['round']}")

    with pytest.raises(Boom, match="seen round 1"):
        client.run("callback", counting, on_round=stop)
    assert trained == [1]


def run_in_threads(server: Server, task: str, clients: int, tmp_path: Path) -> list:
    """`clients` Python clients of `task`, each on a thread of this process (run releases the
    GIL while it waits, seals and uploads), training the MLP on their own shards."""
    import threading
    from torch.utils.data import DataLoader, TensorDataset

    results: list = [None] * clients
    errors: list = []

    def one(k: int) -> None:
        try:
            (x, y), _, _ = hora.load_dataset(DATA, k)
            loader = DataLoader(TensorDataset(torch.from_numpy(x), torch.from_numpy(y)), batch_size=16)
            client = hora.Client(server.url, server.ca, tmp_path / f"{task}-{k}", token=server.enrol())
            results[k] = client.run(task, hora.TorchTrainer(MLP(), loader))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=one, args=(k,)) for k in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    return results


def test_secure_aggregation_asynchronous_and_compressed_tasks_through_the_same_call(server, tmp_path):
    digest = server.admin.upload_model(initial_model().state_dict())
    server.create_mlp_task("secure", digest, rounds=2, target_clients=3,
                           secure_aggregation={"stage_secs": 30})
    results = run_in_threads(server, "secure", 3, tmp_path)
    for r in results:
        assert [x["outcome"] for x in r["rounds"]] == ["uploaded", "uploaded"], r
    history = server.admin.rounds("secure")
    assert [len(r["participants"]) for r in history] == [3, 3]
    assert accuracy(server, "secure", 2) > accuracy(server, "secure", 0) + 0.1

    server.create_mlp_task("async", digest, rounds=4, target_clients=2, min_clients=1,
                           asynchronous={"buffer_size": 2})
    results = run_in_threads(server, "async", 3, tmp_path)
    assert server.admin.task("async")["published_rounds"] == 4
    assert sum(len(r["rounds"]) for r in results) >= 8, "every version takes two updates"
    assert accuracy(server, "async", 4) > accuracy(server, "async", 0) + 0.1

    # Updates in int8, read by the server inside the fold.
    server.create_mlp_task("packed", digest, rounds=2, target_clients=3,
                           compression={"values": "int8", "block_size": 64})
    results = run_in_threads(server, "packed", 3, tmp_path)
    for r in results:
        assert [x["outcome"] for x in r["rounds"]] == ["uploaded", "uploaded"], r
    assert server.admin.task("packed")["config"]["compression"]["values"] == "int8"
    assert accuracy(server, "packed", 2) > accuracy(server, "packed", 0) + 0.1
