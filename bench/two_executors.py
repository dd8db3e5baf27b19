"""The events workload on two executors (Spark's local-cluster: two executor JVMs, each
keeping its replicas in its own local dir, as on two machines), executor tagging against
the hand-written MERGE (delta-rs) and delta-spark's MERGE with the partitions in ON. One
Spark application per process: `bench.run` starts this one as a child and reads its JSON.

    python -m bench.two_executors --sizes 1000000 --batches 4 --batch-rows 100000 --out r.json
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

MASTER = "local-cluster[2,1,1024]"
CONTENDERS = ("sink-executors", "baseline", "spark-merge-careful")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", required=True)
    parser.add_argument("--batches", type=int, required=True)
    parser.add_argument("--batch-rows", type=int, required=True)
    parser.add_argument("--shards", type=int, default=2)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    import pyspark

    from bench import e2e
    from bench.baseline import SparkMerge
    from jobs.spark_session import spark_session

    # local-cluster starts executor JVMs from SPARK_HOME: the pip package directory.
    os.environ.setdefault("SPARK_HOME", os.path.dirname(pyspark.__file__))
    spark = spark_session("bench-two-executors", MASTER, {
        "spark.sql.shuffle.partitions": str(args.shards), "spark.default.parallelism": str(args.shards),
        "spark.ui.enabled": "false", "spark.executor.memory": "1g", **SparkMerge.SESSION_CONF}, delta=True)
    spark.sparkContext.setLogLevel("ERROR")
    cases = e2e.run_child(spark, args.sizes, args.batches, args.batch_rows, args.shards, CONTENDERS,
                          executor_index_dirs=True)
    Path(args.out).write_text(json.dumps({"master": MASTER, "cases": cases}, indent=1))


if __name__ == "__main__":
    main()
