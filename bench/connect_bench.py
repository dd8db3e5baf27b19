"""The events workload through Spark Connect (`remote("local[2]")`): the sink with driver
tagging, which then runs in the Connect server's foreachBatch worker, and with executor
tagging, against the hand-written MERGE run the same way. One session kind per process:
`bench.run` starts this one as a child and reads its JSON.

    python -m bench.connect_bench --sizes 1000000 --batches 3 --batch-rows 100000 --out r.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

REMOTE = "local[2]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", required=True)
    parser.add_argument("--batches", type=int, required=True)
    parser.add_argument("--batch-rows", type=int, required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    from bench import e2e
    from jobs.spark_session import spark_session

    spark = spark_session("bench-connect", remote=REMOTE, conf={"spark.sql.shuffle.partitions": "2",
                                                                 "spark.ui.enabled": "false"})
    cases = e2e.run_child(spark, args.sizes, args.batches, args.batch_rows, 2, ("sink", "sink-executors", "baseline"),
                          remote=True)
    Path(args.out).write_text(json.dumps({"remote": REMOTE, "cases": cases}, indent=1))


if __name__ == "__main__":
    main()
