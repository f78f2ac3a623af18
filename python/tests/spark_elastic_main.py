"""Drives hora.spark.run_elastic on a local Spark that retries a failed task once
(`local[3,2]`): the elastic job's workers are ordinary tasks of spark_main.elastic_train, one of
which dies; prints every worker's result of the last world.

usage: spark_elastic_main.py SERVER CA JOB TOKEN
"""

import json
import sys

from pyspark.sql import SparkSession

import hora.spark
from spark_main import elastic_state, elastic_train


def main() -> None:
    server, ca, job, token = sys.argv[1:5]
    spark = (
        SparkSession.builder.master("local[3,2]")
        .appName("hora-elastic-tests")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .config("spark.ui.enabled", "false")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    try:
        results = hora.spark.run_elastic(
            elastic_train, elastic_state, args=(40,), num_proc=3, server=server, ca=ca, job=job,
            token=token, spark=spark, timeout_secs=15, all_results=True,
        )
    finally:
        spark.stop()
    print("RESULT " + json.dumps(results), flush=True)


if __name__ == "__main__":
    main()
