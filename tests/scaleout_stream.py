"""The scale-out streams: late events with deletes and replays over a seeded table, tagged by
executors that each keep their replicas in their own local directory, checked against the
oracle after every batch. Streams: "plain" and "cdf" (partitioned scope, without and with
the change data feed), "global" (scope "global": moves, key-only deletes, re-sends), "crash"
(plain, with an executor JVM killed by SIGKILL inside a file-writing task, after it wrote its
files, in CRASH_BATCHES: Spark runs the lost tasks again elsewhere), "history" and
"global-history" (plain and global into an SCD type 2 table, the seed its first batch),
"history-crash" (history, killed as crash is), "vectors-crash" (crash, on a table Spark SQL
created with deletion vectors, the change data feed, column mapping, a CHECK constraint and a
generated column: its updates merge-on-read, the writing tasks write the vectors and the change
files too, under the columns' physical names, read back by Spark after every batch),
"mirror-crash" (crash, into an unpartitioned table with deletion vectors, the shape of a
database's mirror: every writing task has every write and writes its share of them), "spark-merge-crash" (plain under
engine = "delta-spark", its updates MERGEd by Spark from the writes the executors tagged,
an executor JVM killed inside a tagging task in SPARK_MERGE_CRASH_BATCHES, the stream
SPARK_MERGE_BATCHES long: Spark's MERGE costs 10-30 s a batch on two executors).

Where the scheduler sends a shard's task is up to Spark, and a stream can keep every shard on
one executor. So in OCCUPIED_BATCHES (but in the crash stream) one executor is kept busy by a
task of another job, each time the other one than before: the batch runs on the free executor,
and every shard moves at least once.

One Spark application per process (a second SparkContext cannot start beside the tests'
session), so it runs as a child process and writes its result as JSON:

    python -m tests.scaleout_stream --master 'local-cluster[2,1,1024]' --work w --out result.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import functools
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from urllib.parse import unquote

import pyarrow as pa
import pyarrow.parquet as pq
from deltalake import DeltaTable, QueryBuilder, write_deltalake

from sink.delta_log.deletion_vectors import Descriptor
from sink.tagging.task_context import spark_local_dirs
from tests.engines import ENGINE_OPTIONS, SMALL_TABLES_CONF
from tests.lakehouse.spark_sql_tables import COLUMNS, FEATURE_RICH_CONSTRAINT, create, spark_rows
from tests.oracle import (
    SCHEMA,
    Event,
    expected_global_rows,
    expected_history,
    expected_rows,
    random_events,
    random_global_batches,
)

NOW = dt.datetime(2025, 3, 1, 12, tzinfo=dt.UTC)
DAYS = 30
STREAMS = ("plain", "cdf", "global", "crash", "history", "global-history", "history-crash", "vectors-crash",
           "mirror-crash", "spark-merge-crash")
CRASH_BATCHES = (2, 5)
SPARK_MERGE_BATCHES, SPARK_MERGE_CRASH_BATCHES = 4, (2,)  # a batch after the crash, on its new executor
ARMED = "armed"  # in the crash stream's folder: the next writing task to claim it kills its executor
OCCUPIED_BATCHES = (1, 3, 5)


def run_then_kill(task, folder: str, ctx, batches):
    """A task (sink.tagging.writing.write_batches, sink.tagging.executor.tag_batches) that, when the stream
    armed it, does its work (writes its files, tags its records) and then SIGKILLs its
    executor's JVM before returning its output (one task per arming)."""
    out = list(task(ctx, batches))
    try:
        os.rename(f"{folder}/{ARMED}", f"{folder}/fired-{os.getpid()}")  # atomic: one task claims it
    except FileNotFoundError:
        yield from out
        return
    daemon = os.getppid()  # the PySpark daemon this worker forked from; its parent is the executor JVM
    with open(f"/proc/{daemon}/stat") as stat:
        jvm = int(stat.read().rsplit(")", 1)[1].split()[1])
    os.kill(jvm, signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


def occupy(folder: str, avoid: str | None, _rows):
    """A task that keeps its executor busy until the driver releases it, unless it runs on the
    executor to avoid or another task has claimed the occupation first (at most one blocks).
    Yields the executor it ran on: its Spark local dirs, one set per executor."""
    here = os.pathsep.join(spark_local_dirs())
    if here != avoid:
        try:
            os.mkdir(f"{folder}/occupying")  # atomic: one task claims it
        except FileExistsError:
            pass
        else:
            Path(f"{folder}/occupying/executor").write_text(here)
            deadline = time.monotonic() + 600
            while not os.path.exists(f"{folder}/release") and time.monotonic() < deadline:
                time.sleep(0.05)
    yield here


class Occupation:
    """One executor kept busy by a two-task job running beside the batch: the first task that
    lands elsewhere than `avoid` blocks until `release()`."""

    def __init__(self, spark, folder: Path, avoid: str | None):
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        for name in ("release", "occupying/executor", "occupying"):
            path = folder / name
            path.rmdir() if path.is_dir() else path.unlink(missing_ok=True)
        self.thread = threading.Thread(target=self._run, args=(spark, avoid), daemon=True)
        self.thread.start()

    def _run(self, spark, avoid: str | None) -> None:
        for _ in range(20):  # both tasks can land on `avoid`, one after the other: try again
            spark.sparkContext.parallelize(range(2), 2).mapPartitions(
                functools.partial(occupy, str(self.folder), avoid)).collect()
            if (self.folder / "occupying").exists():
                return

    def occupied(self) -> str:
        """The executor kept busy, once its task holds it."""
        marker = self.folder / "occupying" / "executor"
        deadline = time.monotonic() + 300
        while not (marker.exists() and marker.read_text()):
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("no task of the occupying job held an executor")
            time.sleep(0.05)
        return marker.read_text()

    def release(self) -> None:
        (self.folder / "release").touch()
        self.thread.join()


def day(d: int) -> str:
    return (NOW.date() - dt.timedelta(days=d)).isoformat()


def seed_events(keys: int) -> list[Event]:
    return [Event(f"k{k}", day(k % DAYS), 0, "u", "seed") for k in range(keys)]


def late_batches(seed: int, keys: int, batches: int, per_batch: int, delete_share: float) -> list[list[Event]]:
    """Events arrive up to 3 batches late: updates older than a delete, stale records and
    in-batch duplicates all occur."""
    return random_events(seed, batches, per_batch, keys, lambda k: day(k % DAYS),
                         lambda rng, b: max((b + 1) * 1000 + rng.randrange(-3000, 1000), 1), delete_share)


def table_rows(uri: str) -> list[dict]:
    """Through delta-rs' own reader, which applies deletion vectors (its pyarrow dataset refuses them)."""
    read = QueryBuilder().register("t", DeltaTable(uri)).execute("SELECT id, dt, ts, op, v FROM t").read_all()
    return sorted(pa.table(read).to_pylist(), key=lambda r: (r["dt"], r["id"]))


def history_rows(uri: str) -> list[tuple]:
    """An SCD type 2 table's versions as `expected_history` gives them."""
    rows = DeltaTable(uri).to_pyarrow_table(columns=["dt", "id", "ts", "op", "v", "__START_AT", "__END_AT"])
    return sorted(tuple(r.values()) for r in rows.to_pylist())


ARROW_SCHEMA = pa.schema([("id", pa.string()), ("dt", pa.string()), ("ts", pa.int64()), ("op", pa.string()),
                         ("v", pa.string())])


def never_committed(uri: str) -> dict[str, int]:
    """Files under the table that no version of its log ever referenced (written by task
    attempts that did not count): data files (`add`), change files (`cdc`, under
    `_change_data`) and deletion vector files (an `add`'s descriptor)."""
    referenced = set()
    for entry in Path(uri, "_delta_log").glob("*.json"):
        for line in entry.read_text().splitlines():
            action = json.loads(line)
            for kind in ("add", "cdc"):
                if kind in action:
                    referenced.add(os.path.normpath(unquote(action[kind]["path"])))
            if (vector := action.get("add", {}).get("deletionVector")) and vector["storageType"] != "i":
                location = Descriptor.from_json(vector).file_location(uri)
                referenced.add(os.path.normpath(os.path.relpath(location, uri)))
    left = {"data": 0, "changes": 0, "vectors": 0}
    for p in Path(uri).rglob("*"):
        if "_delta_log" in p.parts or not p.is_file() or p.suffix not in (".parquet", ".bin"):
            continue
        if os.path.normpath(str(p.relative_to(uri))) not in referenced:
            left["vectors" if p.suffix == ".bin" else "changes" if "_change_data" in p.parts else "data"] += 1
    return left


FEATURES_COLUMNS = COLUMNS + ", amount BIGINT, g STRING GENERATED ALWAYS AS (upper(v))"
FEATURES_PROPERTIES = ("TBLPROPERTIES ('delta.enableDeletionVectors' = 'true', 'delta.enableChangeDataFeed' = 'true', "
                       "'delta.columnMapping.mode' = 'name')")


def with_features(df):
    """The columns the feature-rich table adds: an amount its CHECK constraint accepts, and
    the generated column's value (Delta checks a written one, as the sink does)."""
    from pyspark.sql import functions as F

    return df.withColumn("amount", F.col("ts") % 97).withColumn("g", F.upper("v"))


def seed_features_table(spark, uri: str, events: list[Event]) -> None:
    """The feature-rich table without identity, created and seeded by Spark SQL."""
    create(spark, uri, columns=FEATURES_COLUMNS, properties=FEATURES_PROPERTIES, constraint=FEATURE_RICH_CONSTRAINT)
    with_features(spark.createDataFrame(events, SCHEMA)).write.format("delta").mode("append").save(uri)


def features_rows(spark, uri: str) -> list[dict]:
    """The table's rows as Spark reads them; a generated value other than Delta's is an error."""
    table = spark.read.format("delta").load(uri)
    wrong = table.where("NOT (g <=> upper(v)) OR amount <> ts % 97").count()
    assert wrong == 0, f"{wrong} rows whose g or amount is not what the stream wrote"
    return spark_rows(spark, uri)


def seed_table(uri: str, events: list[Event], cdf: bool, partition_by: tuple[str, ...] = ("dt",)) -> None:
    configuration = {"delta.enableChangeDataFeed": "true"} if cdf else None
    write_deltalake(uri, pa.Table.from_pylist([e._asdict() for e in events], schema=ARROW_SCHEMA),
                    partition_by=list(partition_by) or None, configuration=configuration)


def run_stream(spark, work: Path, name: str, keys: int, batches: int, per_batch: int, num_shards: int,
               replay_batch: int | None = 4) -> dict:
    """One of STREAMS. The global one moves the seeded keys into other partitions, deletes
    some by key alone and re-sends earlier records."""
    from sink import SinkConfig, UpsertSink
    from sink.tagging.executor import tag_batches
    from sink.tagging.writing import write_batches

    scope = "global" if name.startswith("global") else "partitioned"
    history = "history" in name
    crash = name.endswith("crash")
    spark_merge = ENGINE_OPTIONS["delta-spark"] if name.startswith("spark-merge") else {}
    if spark_merge:
        batches, crash_batches = min(batches, SPARK_MERGE_BATCHES), SPARK_MERGE_CRASH_BATCHES
    else:
        crash_batches = CRASH_BATCHES
    mirror = name.startswith("mirror")
    mirror_options = {"commit_mode": "merge-on-read", "allow_protocol_upgrade": True} if mirror else {}
    cfg = SinkConfig(table_uri=str(work / "table"), key=["id"], partition_by=[] if mirror else ["dt"], ordering="ts",
                     delete_when="op = 'd'", writer_id=f"scaleout-{name}", scope=scope,
                     num_shards=num_shards, metrics_port=0, bootstrap_days=7, scd_type=2 if history else 1,
                     **spark_merge, **mirror_options)
    seed = seed_events(keys)
    if scope == "global":
        stream = random_global_batches(11, batches - history, per_batch, 2 * keys)  # half the keys new
        expected, rows_of = expected_global_rows, table_rows
    else:
        stream = late_batches(11, keys, batches - history, per_batch, delete_share=0.02)
        expected, rows_of = expected_rows, table_rows
    features = name.startswith("vectors")
    if history:
        stream, seed = [seed, *stream], []
        expected, rows_of = functools.partial(expected_history, scope=scope), history_rows
    elif features:
        seed_features_table(spark, cfg.table_uri, seed)
        rows_of = functools.partial(features_rows, spark)
    else:
        seed_table(cfg.table_uri, seed, cdf=name == "cdf", partition_by=tuple(cfg.partition_by))
    sink = UpsertSink(cfg, clock=lambda: NOW.timestamp())
    if crash:  # the tasks that run last: tagging ones when the writes stay for Spark's MERGE
        from sink.batch import executor_tagger

        if spark_merge:
            executor_tagger.tag_batches = functools.partial(run_then_kill, tag_batches, str(work))
        else:
            executor_tagger.write_batches = functools.partial(run_then_kill, write_batches, str(work))
    out = {"stream": name, "batches": [], "exact": True}
    last_occupied = None
    for b, events in enumerate(stream):
        if scope == "partitioned" and not history:  # a history table quarantines them
            # Every other delete carries the key alone, as CDC feeds send them: a key lives in one
            # partition, so the index must find it there (the oracle reads the events as they were).
            events = [e._replace(dt=None) if e.op == "d" and i % 2 else e for i, e in enumerate(events)]
        # Executors read the batch from a file, as from a stream's source.
        landing = work / "landing" / f"batch-{b}.parquet"
        landing.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.Table.from_pylist([e._asdict() for e in events], schema=ARROW_SCHEMA), landing)
        df = spark.read.schema(SCHEMA).parquet(str(landing))
        if features:
            df = with_features(df)
        armed = crash and b in crash_batches
        if armed:
            (work / ARMED).touch()
        occupation = None
        if not crash and b in OCCUPIED_BATCHES:
            occupation = Occupation(spark, work / "occupation", avoid=last_occupied)
            last_occupied = occupation.occupied()
        started = time.perf_counter()
        sink(df, b)
        seconds = time.perf_counter() - started
        killed = armed and not (work / ARMED).exists()
        if b == replay_batch:
            sink(df, b)  # handed again after a crash before the checkpoint: skipped
            assert sink.reports[-1].mode == "skipped", sink.reports[-1].mode
        if occupation:
            occupation.release()
        r = sink.reports[-2 if b == replay_batch else -1]
        exact = rows_of(cfg.table_uri) == expected([seed, *stream[: b + 1]])
        out["exact"] &= exact
        out["batches"].append({
            "batch": b, "exact": exact, "seconds": round(seconds, 3), "mode": r.mode,
            "loads": r.partition_loads, "shard_moves": r.shard_moves,
            "changelog_applied": r.changelog_applied, "replicas_rebuilt": r.replicas_rebuilt,
            "invalidated": r.invalidated, "ops": r.ops, "misses": r.misses, "filter_misses": r.filter_misses,
            "without_partition": r.without_partition, "write_seconds": r.write_seconds, "killed": killed,
            "write_tasks": r.write_tasks,
            "jobs_rerun": r.jobs_rerun, "occupied": occupation is not None,
            "never_committed": never_committed(cfg.table_uri), "version_changes": r.version_changes,
        })
        print(f"{name} batch {b}: exact={exact} {r.summary()} moves={r.shard_moves} "
              f"changelog={r.changelog_applied} rebuilt={r.replicas_rebuilt} loads={r.partition_loads}",
              file=sys.stderr, flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--master", default="local-cluster[2,1,1024]")
    parser.add_argument("--work", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--streams", default=",".join(STREAMS), help=f"streams to run, in order, of {STREAMS}")
    parser.add_argument("--keys", type=int, default=20_000)
    parser.add_argument("--batches", type=int, default=6)
    parser.add_argument("--per-batch", type=int, default=15_000)
    parser.add_argument("--shards", type=int, default=4)
    args = parser.parse_args()

    import pyspark

    from jobs.spark_session import spark_session

    # local-cluster starts executor JVMs from SPARK_HOME: the pip package directory.
    os.environ.setdefault("SPARK_HOME", os.path.dirname(pyspark.__file__))
    streams = args.streams.split(",")
    delta = any(name.startswith(("spark-merge", "vectors")) for name in streams)
    spark = spark_session("sink-scaleout", args.master, delta=delta, conf={
        "spark.sql.shuffle.partitions": str(args.shards), "spark.default.parallelism": str(args.shards),
        "spark.ui.enabled": "false", "spark.executor.memory": "1g",
        # A shard's task goes to whichever executor is free, as on a busy cluster: with reduce
        # locality (and its wait) it tends to stay where its input was written, and a stream
        # could keep every shard on one executor, testing no move at all.
        "spark.shuffle.reduceLocality.enabled": "false", "spark.locality.wait": "0", **SMALL_TABLES_CONF,
    })
    spark.sparkContext.setLogLevel(os.environ.get("SPARK_LOG_LEVEL", "ERROR"))
    work = Path(args.work)
    results = []
    try:
        for name in streams:
            if name not in STREAMS:
                raise SystemExit(f"--streams: {name!r} is not one of {STREAMS}")
            results.append(run_stream(spark, work / name, name, args.keys, args.batches, args.per_batch, args.shards))
    finally:
        spark.stop()
    Path(args.out).write_text(json.dumps({"master": args.master, "streams": results}, indent=1))


if __name__ == "__main__":
    main()
