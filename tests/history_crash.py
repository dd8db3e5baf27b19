"""A history table's stream whose driver process is SIGKILLed inside a batch's commit: after
its files are written ("written") or once its commit landed ("committed"); under engine =
"delta-spark", whose MERGE writes and commits at once, before it runs ("tagged") or once
it landed. The killed run is a child process with its own Spark (the tests' session must
survive), which runs the stream's batches up to CRASH_BATCH and dies there:

    python -m tests.history_crash --work w --scope global --point written
"""

from __future__ import annotations

import argparse
import os
import signal
from pathlib import Path

from tests.engines import SMALL_TABLES_CONF
from tests.oracle import Event, random_events, random_global_batches

CRASH_BATCH = 2
POINTS = ("tagged", "written", "committed")
ENGINES = ("deltalake", "delta-spark")


def stream(scope: str) -> list[list[Event]]:
    """Late events, deletes (in global scope moving keys, key-only deletes, re-sends)."""
    if scope == "global":
        return random_global_batches(5, batches=5, per_batch=80, keys=30, days=3)
    return random_events(5, 5, 80, 30, lambda k: f"2025-01-0{1 + k % 3}",
                         lambda rng, b: rng.randrange(0, 40) + 10 * b, delete_share=0.15)


def config(work: Path, scope: str, engine: str = "deltalake"):
    """Under delta-spark, the history commits through Spark's MERGE."""
    from sink import SinkConfig
    from tests.engines import ENGINE_OPTIONS

    return SinkConfig(table_uri=str(work / "table"), key=["id"], partition_by=["dt"], ordering="ts",
                      delete_when="op = 'd'", scope=scope, scd_type=2, writer_id="crash", num_shards=2,
                      metrics_port=0, index_dir=str(work / "index"), **ENGINE_OPTIONS[engine])


def kill_at(point: str, engine: str) -> None:
    """Make the next history commit SIGKILL this process at `point`."""
    if engine == "delta-spark":
        from sink.lakehouse.engines.delta_spark import DeltaSparkTarget as owner
        name = "_merge"
    else:
        from sink.lakehouse.commit import rewrite as owner
        name = "commit_rewrite"
    commit = getattr(owner, name)

    def dying(*args, **kwargs):
        if point == "committed":
            commit(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGKILL)

    setattr(owner, name, dying)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", required=True)
    parser.add_argument("--scope", choices=("partitioned", "global"), required=True)
    parser.add_argument("--point", choices=POINTS, required=True)
    parser.add_argument("--engine", choices=ENGINES, default="deltalake")
    args = parser.parse_args()

    from jobs.spark_session import spark_session
    from sink import UpsertSink
    from tests.oracle import SCHEMA

    spark = spark_session("sink-history-crash", "local[1]", {
        "spark.sql.shuffle.partitions": "2", "spark.ui.enabled": "false", **SMALL_TABLES_CONF},
        delta=args.engine == "delta-spark")
    spark.sparkContext.setLogLevel("ERROR")
    sink = UpsertSink(config(Path(args.work), args.scope, args.engine))
    for b, events in enumerate(stream(args.scope)[: CRASH_BATCH + 1]):
        if b == CRASH_BATCH:
            kill_at(args.point, args.engine)
        sink(spark.createDataFrame(events, SCHEMA), b)
    raise SystemExit("the crash batch committed without dying")


if __name__ == "__main__":
    main()
