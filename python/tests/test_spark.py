"""hora.spark.run on a local Spark (local[4], barrier mode) trains the MLP to the accuracy of
`hora-client sync` with 4 workers, and a failing task fails the job with its rank named."""

from __future__ import annotations

import json
import os
import re
import sys

import pytest

import hora
import hora.spark
from conftest import HERE, binary, log

pyspark = pytest.importorskip("pyspark", reason="pyspark is installed by scripts/setup-python.sh")

EPOCHS, BATCH = 5, 32


@pytest.fixture(scope="module")
def spark():
    from pyspark.sql import SparkSession

    # The Python workers Spark starts must import the test's training function.
    os.environ["PYTHONPATH"] = os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])
    os.environ["PYSPARK_PYTHON"] = sys.executable
    session = (
        SparkSession.builder.master("local[4]")
        .appName("hora-tests")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .config("spark.ui.enabled", "false")
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()


def rust_accuracy(server, procs) -> float:
    """`hora-client sync` with 4 workers meeting at the server; rank 0's held-out accuracy."""
    token = server.admin.create_sync_job("rust", 4)["token"]
    workers = [
        procs.start(f"rust-{r}", [
            binary("hora-client"), "sync", "--server", server.url, "--ca", str(server.ca),
            "--job", "rust", "--token", token, "--world-size", "4", "--rank", str(r),
            "--model", "mlp", "--params", '{"inputs":60,"hidden":[32],"classes":10}',
            "--data", "synthetic-iid:clients=1,seed=3,min_samples=4000,max_samples=4000",
            "--epochs", str(EPOCHS), "--batch-size", str(BATCH), "--learning-rate", "0.05",
            "--lr-scaling", "none", "--optimizer", "sgd", "--momentum", "0.9", "--seed", "1",
            "--threads", "1", "--no-progress",
        ])
        for r in range(4)
    ]
    for w in workers:
        assert w.wait(timeout=300) == 0, log(w)
    found = re.findall(r"accuracy ([0-9.]+)", log(workers[0]))
    assert found, log(workers[0])
    return float(found[-1])


def test_spark_barrier_training_matches_hora_client_sync(spark, server, procs):
    from spark_main import train

    python = hora.spark.run(train, args=(EPOCHS, BATCH), num_proc=4, spark=spark)
    each = hora.spark.run(train, args=(EPOCHS, BATCH), num_proc=4, spark=spark, all_results=True)
    rust = rust_accuracy(server, procs)
    print(f"held-out accuracy after {EPOCHS} epochs: spark {python:.4f}, hora-client sync {rust:.4f}")
    assert len(each) == 4 and len(set(each)) == 1, "every rank holds the same model"
    assert each[0] == python, "the same seeds give the same model"
    assert rust > 0.6 and python > 0.6, (rust, python)
    # Different initial draws and shuffles (torch against tch): the same model, not the same bits.
    assert abs(python - rust) <= 0.05, (python, rust)


def test_a_failing_task_fails_the_job_naming_its_rank(spark):
    from spark_main import fail_on_rank_two

    with pytest.raises(hora.HoraError, match=r"rank 2 failed: ValueError: this worker's data is unreadable"):
        hora.spark.run(fail_on_rank_two, num_proc=4, spark=spark, timeout_secs=10)


def test_an_elastic_spark_job_survives_a_dead_task_that_spark_retries_into_the_running_world(server, procs):
    """hora.spark.run_elastic on a Spark that retries a failed task once: task 1 exits abruptly
    at step 12; the two others go on from their last commit, Spark retries task 1, the retry
    joins the running world at a commit, and all three end with one model."""
    token = server.admin.create_sync_job("spark-elastic", 3, min_world_size=2, settle_ms=2000)["token"]
    env = {"PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
           "PYSPARK_PYTHON": sys.executable, "HORA_LOG": "warn"}
    driver = procs.start("spark-elastic", [sys.executable, str(HERE / "spark_elastic_main.py"), server.url,
                                           str(server.ca), "spark-elastic", token], env=env)
    assert driver.wait(timeout=300) == 0, log(driver)
    lines = [l for l in log(driver).splitlines() if l.startswith("RESULT ")]
    results = json.loads(lines[-1][7:])
    assert len(results) == 3, results
    assert len({r["digest"] for r in results}) == 1 and len({r["step"] for r in results}) == 1, results
    assert all(r["size"] == 3 and r["generation"] >= 3 for r in results), results
    retried = [r for r in results if r["task"] == 1]
    assert retried and retried[0]["attempt"] == 1, "task 1's retry trained in the last world"
    assert server.admin.sync_jobs()[0]["finished"], "and the job was marked finished"
