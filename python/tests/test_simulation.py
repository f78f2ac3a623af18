"""hora.simulation: a federation of virtual clients on the real round engine, trained by Python
(TorchTrainer or a plain train_fn) on worker processes, its data split by Partition."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import hora
from hora.simulation import Partition, Shard, run
from sim_model import Softmax, blobs, initial, torch_trainer

TASK = {
    "rounds": 4,
    "target_clients": 5,
    "training": {"epochs": 1, "batch_size": 16, "learning_rate": 0.1},
}


def test_a_torch_trainer_federation_learns_the_same_model_on_one_worker_or_two():
    data = Partition(blobs(), "dirichlet:alpha=0.5")
    results = [
        run(TASK, 30, model=initial(), data=data, trainer=torch_trainer, workers=workers,
            seed=3, evaluate_clients=10, progress=False)
        for workers in (1, 2)
    ]
    one, two = results
    assert list(one.model) == ["linear.bias", "linear.weight"]
    for name in one.model:
        assert np.array_equal(one.model[name], two.model[name]), name
    history = one.history
    assert list(history["round"]) == [1, 2, 3, 4]
    assert (history["outcome"] == "published").all()
    assert (history["participants"] == 5).all()
    assert history["sim_time_s"].is_monotonic_increasing
    pd.testing.assert_frame_equal(
        one.history.drop(columns=["wall_time_s"]), two.history.drop(columns=["wall_time_s"])
    )
    # The blobs are well apart: four rounds of five clients learn them.
    accuracy = history["eval_accuracy"].to_numpy()
    assert accuracy[-1] > 0.8, accuracy
    assert one.time_to_accuracy(0.8) == pytest.approx(
        history.loc[history["eval_accuracy"] >= 0.8, "sim_time_s"].iloc[0]
    )
    # The final model is the state_dict of the task's module, and as good as the history says.
    module = Softmax()
    module.load_state_dict(one.state_dict())
    x, y = blobs(seed=0)
    assert float((module(torch.from_numpy(x)).argmax(1).numpy() == y).mean()) > 0.8
    figure = one.plot()
    by_round, by_time = figure.axes
    assert list(by_round.lines[0].get_xdata()) == [1, 2, 3, 4]
    assert list(by_round.lines[0].get_ydata()) == list(accuracy)
    assert list(by_time.lines[0].get_xdata()) == list(history["sim_time_s"])


def mean_step(weights, config):
    """Moves the model to the mean of the client's training features: FedAvg of these is the
    mean over every participant's rows, which the test works out on its own."""
    shard: Shard = config["data"]
    features = shard.train[[c for c in shard.train.columns if c.startswith("f")]].to_numpy()
    return {"w": features.mean(axis=0).astype(np.float32)}, len(features), {"loss": 0.0}


def hospitals(n: int = 700, seed: int = 1) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    names = np.array(["ash", "birch", "cedar", "elm", "fir", "oak", "yew"])
    sizes = rng.dirichlet(np.ones(len(names)))
    frame = pd.DataFrame(rng.normal(size=(n, 3)).astype(np.float32), columns=["f0", "f1", "f2"])
    frame["label"] = rng.integers(0, 3, size=n)
    frame["hospital"] = rng.choice(names, size=n, p=sizes)
    return frame


def test_secure_aggregation_with_dropouts_publishes_what_the_clear_federation_publishes():
    # Each client drops out with chance 0.3 after sharing its keys; the same federation in the
    # clear (no adaptive bounds, which masked updates cannot have) takes the same survivors.
    task = {**TASK, "rounds": 3, "target_clients": 8, "min_clients": 3}
    clear = {**task, "update_bounds": {"adaptive_norm_factor": None, "adaptive_weight_factor": None}}
    secure = {**task, "secure_aggregation": {"clip": 5.0, "max_weight": 100000}}
    data = Partition(blobs(), "dirichlet:alpha=0.5")
    masked, plain = [
        run(t, 30, model=initial(), data=data, trainer=torch_trainer, workers=2, seed=6,
            profile="heterogeneous:dropout=0.3", evaluate_clients=10, progress=False)
        for t in (secure, clear)
    ]
    assert (masked.history["outcome"] == "published").all(), masked.history
    for column in ("participants", "dropouts", "examples", "sim_time_s"):
        assert list(masked.history[column]) == list(plain.history[column]), column
    assert masked.history["dropouts"].sum() > 0
    for name in plain.model:
        np.testing.assert_allclose(masked.model[name], plain.model[name], atol=1e-3, err_msg=name)
    # The server never saw a client's loss: only the sum of the masked updates.
    assert masked.history["loss"].isna().all() and plain.history["loss"].notna().all()


def test_a_natural_partition_is_one_client_per_hospital_and_the_engine_publishes_their_fedavg(tmp_path):
    frame = hospitals()
    names = sorted(frame["hospital"].unique())
    partition = Partition(frame, "natural", by="hospital", test_fraction=0.25)
    pq.write_table(pa.Table.from_pandas(frame, preserve_index=False), tmp_path / "h.parquet")
    from_parquet = Partition(tmp_path / "h.parquet", "natural", by="hospital", test_fraction=0.25)
    partition.plan(len(names), seed=5)
    from_parquet.plan(len(names), seed=5)
    trained = []
    for k, name in enumerate(names):
        shard = partition.shard(k, seed=5)
        both = pd.concat([shard.train, shard.test])
        # Every row of this hospital, and nothing else, split 3:1.
        expected = frame[frame["hospital"] == name].sort_values("f0").reset_index(drop=True)
        pd.testing.assert_frame_equal(both.sort_values("f0").reset_index(drop=True), expected)
        assert len(shard.test) == round(len(expected) * 0.25)
        other = from_parquet.shard(k, seed=5).train.to_pandas()
        for column in ("f0", "f1", "f2", "label", "hospital"):
            assert other[column].tolist() == shard.train[column].tolist(), column
        trained.append(shard.train)
    # One round of every hospital: the model is the participants' example-weighted mean.
    task = {"rounds": 1, "target_clients": len(names), "training": {"epochs": 1}}
    result = run(task, model={"w": np.zeros(3, np.float32)}, data=partition, train_fn=mean_step,
                 seed=5, workers=2, progress=False)
    assert result.history["participants"].tolist() == [len(names)]
    rows = pd.concat(trained)
    expected = rows[["f0", "f1", "f2"]].to_numpy(np.float64).mean(axis=0)
    np.testing.assert_allclose(result.model["w"], expected, rtol=1e-5, atol=1e-6)


def test_label_skew_splits_each_class_among_the_clients_without_losing_a_sample():
    x, y = blobs(n=1000, seed=2)
    partition = Partition((x, y), "dirichlet:alpha=0.1", test_fraction=0.0)
    partition.plan(10, seed=11)
    seen = np.concatenate([np.flatnonzero((x[:, None] == s.train[0][None]).all(-1).any(1))
                           for s in (partition.shard(k, 11) for k in range(10))])
    # Every sample once.
    assert sorted(seen.tolist()) == list(range(1000))
    # Small α: most clients hold most of their samples in one class (an IID split would not).
    top = [np.bincount(partition.shard(k, 11).train[1], minlength=4).max() / max(1, partition.shard(k, 11).examples)
           for k in range(10)]
    assert np.median(top) > 0.6, top
    iid = Partition((x, y), "iid", test_fraction=0.0)
    iid.plan(10, seed=11)
    assert max(np.bincount(iid.shard(k, 11).train[1], minlength=4).max() / 100 for k in range(10)) < 0.45


def failing(weights, config):
    raise ValueError(f"no data for client {config['client']}")


def test_a_train_fn_that_fails_for_every_client_stops_the_run_with_its_error():
    with pytest.raises(hora.HoraError, match="ValueError.*no data for client"):
        run(TASK, 10, model={"w": np.zeros(2, np.float32)}, data=Partition(blobs(n=200), "iid"),
            train_fn=failing, workers=1, progress=False)


def test_what_cannot_be_simulated_is_refused_saying_why():
    data = Partition(blobs(n=50), "iid")
    with pytest.raises(ValueError, match="50 samples cannot be split among 100 clients"):
        run(TASK, 100, model={"w": np.zeros(2, np.float32)}, data=data, train_fn=failing, progress=False)
    with pytest.raises(ValueError, match="give one of train_fn= and trainer="):
        run(TASK, 10, model={"w": np.zeros(2, np.float32)}, data=data, progress=False)
    with pytest.raises(ValueError, match="partitioner `zipf`"):
        run(TASK, 10, model={"w": np.zeros(2, np.float32)}, data=Partition(blobs(n=50), "zipf"),
            train_fn=failing, progress=False)


RESUMED = {**TASK, "rounds": 6, "compression": {"values": "int8", "top_k": 0.25}}


def resumable(checkpoint: Path, on_round=None):
    return run(RESUMED, 30, model=initial(), data=Partition(blobs(), "dirichlet:alpha=0.5"),
               trainer=torch_trainer, workers=2, seed=4, evaluate_clients=5, progress=False,
               checkpoint=checkpoint, on_round=on_round)


def saved_rounds(checkpoint: Path) -> int:
    """The rounds in the checkpoint's driver state (0 while there is none); it is replaced by
    rename, so a read may fall between two checkpoints."""
    try:
        return len(json.loads((checkpoint / "checkpoint" / "driver.json").read_text())["rows"])
    except (FileNotFoundError, json.JSONDecodeError):
        return 0


def test_a_simulation_killed_mid_run_resumes_from_its_checkpoint_to_the_same_model(tmp_path):
    whole = resumable(tmp_path / "whole")
    # The same run in a process of its own, SIGKILLed once two rounds are in its checkpoint.
    script = (
        "import sys; sys.path[:0] = sys.argv[2:]\n"
        "from test_simulation import resumable\n"
        "from pathlib import Path\n"
        "resumable(Path(sys.argv[1]))\n"
    )
    killed = tmp_path / "killed"
    here = str(Path(__file__).parent)
    proc = subprocess.Popen([sys.executable, "-c", script, str(killed), here, *sys.path],
                            start_new_session=True, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    try:
        while time.time() < deadline:
            if saved_rounds(killed) >= 2:
                break
            assert proc.poll() is None, "the run ended before it was killed"
            time.sleep(0.05)
        else:
            pytest.fail("no checkpoint of two rounds within two minutes")
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    kept = saved_rounds(killed)
    assert kept >= 2
    seen = []
    resumed = resumable(killed, on_round=seen.append)
    # It went on from the checkpoint: the rows it kept were not run again.
    assert seen and len(seen) == len(resumed.history) - kept, (kept, seen)
    assert (seen[0]["round"], seen[0]["attempt"]) == tuple(resumed.history.iloc[kept][["round", "attempt"]])
    for name in whole.model:
        assert np.array_equal(whole.model[name], resumed.model[name]), name
    columns = [c for c in whole.history.columns if c != "wall_time_s"]
    pd.testing.assert_frame_equal(whole.history[columns], resumed.history[columns])
    assert len(whole.history) >= 6


def test_a_folder_of_other_files_is_not_taken_for_checkpoints_and_an_evaluation_may_lack_a_metric(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    data = Partition(blobs(n=200), "iid")
    with pytest.raises(hora.HoraError, match="not a simulation's checkpoint"):
        run(TASK, 10, model=initial(), data=data, trainer=torch_trainer, progress=False,
            checkpoint=tmp_path)
    assert (tmp_path / "notes.txt").read_text() == "mine"

    def loss_only(weights, config):
        return len(config["data"].test[1]), {"loss": 1.5}

    result = run({**TASK, "rounds": 1}, 10, model=initial(), data=data, trainer=torch_trainer,
                 evaluate_fn=loss_only, evaluate_clients=4, progress=False)
    assert result.history["eval_loss"].tolist() == [1.5]
    assert result.history["eval_accuracy"].isna().all()
