"""A second writer on the table: every commit is valid for the version it lands on, or the
batch fails before writing, naming the other writer."""

import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from deltalake import CommitProperties, DeltaTable, Transaction, write_deltalake

from sink import CommitConflictError, SinkConfig, UpsertSink
from tests.oracle import SCHEMA, Event, expected_rows, random_events

pytestmark = pytest.mark.spark

ARROW = pa.schema([("id", pa.string()), ("dt", pa.string()), ("ts", pa.int64()), ("op", pa.string()),
                   ("v", pa.string())])


def config(tmp_path, name, **extra):
    return SinkConfig(table_uri=str(tmp_path / "table"), key=["id"], partition_by=["dt"], ordering="ts",
                      delete_when="op = 'd'", writer_id=name, index_dir=str(tmp_path / f"index-{name}"),
                      num_shards=2, metrics_port=0, **extra)


def rows(uri):
    return sorted(DeltaTable(uri).to_pyarrow_table().to_pylist(), key=lambda r: (r["dt"], r["id"]))


def other_writer_appends(uri, events, writer="other", batch=0):
    """What another sink's append looks like in the log: rows plus its app transaction."""
    write_deltalake(uri, pa.Table.from_pylist([e._asdict() for e in events], schema=ARROW), mode="append",
                    partition_by=["dt"], commit_properties=CommitProperties(
                        app_transactions=[Transaction(writer, batch)], custom_metadata={"upsert_sink.shards": "0"}))


def racing(sink, race):
    """Let `race()` commit to the table once, between the sink's tagging and its commit (of
    rows here, of the files Spark tasks wrote, or of the writes they kept for a MERGE)."""
    calls = []

    def first_loses(commit):
        def run(*args, **kwargs):
            if not calls:
                race()
            calls.append(1)
            return commit(*args, **kwargs)
        return run

    for name in ("commit", "commit_written", "commit_source"):
        setattr(sink._target, name, first_loses(getattr(sink._target, name)))
    return calls


# Where the batch's updates commit: the rewrite, delta-rs' MERGE (on the driver, or from a
# Spark task with executor tagging), Spark's MERGE (from the driver's rows or the executors').
PATHS = [("driver", {}, "rewrite"), ("executors", {}, "rewrite"),
         ("driver", {"commit_mode": "merge"}, "merge"), ("executors", {"commit_mode": "merge"}, "merge"),
         ("driver", {"commit_mode": "merge", "engine": "delta-spark"}, "merge"),
         ("executors", {"commit_mode": "merge", "engine": "delta-spark"}, "merge")]
PATH_IDS = ["driver-rewrite", "executors-rewrite", "driver-delta-rs-merge", "executors-delta-rs-merge",
            "driver-spark-merge", "executors-spark-merge"]


@pytest.mark.parametrize("tag_on, options, update_commit", PATHS, ids=PATH_IDS)
def test_an_insert_raced_by_another_writers_insert_of_the_same_key_is_tagged_again(spark, tmp_path, tag_on, options,
                                                                                   update_commit):
    cfg = config(tmp_path, "a", max_commit_retries=1, tag_on=tag_on, **options)
    sink = UpsertSink(cfg)
    sink(spark.createDataFrame([Event("seed", "2025-01-01", 1, "u", "s")], SCHEMA), 0)
    # Both writers insert key k: a blind append would leave two rows.
    calls = racing(sink, lambda: other_writer_appends(cfg.table_uri, [Event("k", "2025-01-02", 3, "u", "other")]))
    sink(spark.createDataFrame([Event("k", "2025-01-02", 5, "u", "ours")], SCHEMA), 1)
    assert rows(cfg.table_uri) == expected_rows([[Event("seed", "2025-01-01", 1, "u", "s")],
                                                 [Event("k", "2025-01-02", 3, "u", "other")],
                                                 [Event("k", "2025-01-02", 5, "u", "ours")]])
    report = sink.reports[-1]
    assert (len(calls), report.retries, report.ops["update"], report.mode) == (2, 1, 1, update_commit)


@pytest.mark.parametrize("tag_on, options, update_commit", PATHS, ids=PATH_IDS)
def test_a_race_on_other_partitions_commits_without_tagging_again(spark, tmp_path, tag_on, options, update_commit):
    cfg = config(tmp_path, "a", max_commit_retries=1, tag_on=tag_on, **options)
    sink = UpsertSink(cfg)
    sink(spark.createDataFrame([Event("seed", "2025-01-01", 1, "u", "s")], SCHEMA), 0)
    calls = racing(sink, lambda: other_writer_appends(cfg.table_uri, [Event("x", "2025-01-09", 3, "u", "other")]))
    sink(spark.createDataFrame([Event("k", "2025-01-02", 5, "u", "ours")], SCHEMA), 1)
    report = sink.reports[-1]
    assert (len(calls), report.retries, report.ops["insert"], report.mode) == (2, 1, 1, "append")
    assert [r["id"] for r in rows(cfg.table_uri)] == ["seed", "k", "x"]


def test_out_of_retries_the_batch_fails_naming_the_other_writer_and_writes_nothing(spark, tmp_path):
    cfg = config(tmp_path, "a", max_commit_retries=0)
    sink = UpsertSink(cfg)
    sink(spark.createDataFrame([Event("seed", "2025-01-01", 1, "u", "s")], SCHEMA), 0)
    racing(sink, lambda: other_writer_appends(cfg.table_uri, [Event("k", "2025-01-02", 3, "u", "other")],
                                              writer="nightly-loader"))
    with pytest.raises(CommitConflictError, match="writer 'nightly-loader'.*nothing of this batch was written"):
        sink(spark.createDataFrame([Event("k", "2025-01-02", 5, "u", "ours")], SCHEMA), 1)
    assert [(r["id"], r["v"]) for r in rows(cfg.table_uri)] == [("seed", "s"), ("k", "other")]
    assert DeltaTable(cfg.table_uri).transaction_version("a") == 0


def landing_batches(seed, parity, batches, per_batch, keys=120, days=3):
    """One writer's input: orderings of one parity, so no two writers ever tie on a key."""
    return random_events(seed, batches, per_batch, keys, lambda k: f"2025-01-0{1 + k % days}",
                         lambda rng, b: 2 * rng.randrange(0, 40) + parity, delete_share=0.15, tag=f"{parity}-")


def test_two_streaming_queries_upserting_into_one_table_end_exact(spark, tmp_path):
    writers = {}
    for name, parity in (("a", 0), ("b", 1)):
        batches = landing_batches(10 + parity, parity, batches=5, per_batch=150)
        landing = tmp_path / f"landing-{name}"
        landing.mkdir()
        for b, events in enumerate(batches):
            path = landing / f"{b:03d}.parquet"
            pq.write_table(pa.Table.from_pylist([e._asdict() for e in events], schema=ARROW), path)
            # A file stream admits files by modification time: make it the order the oracle assumes
            # (files written within one millisecond could otherwise come in either order).
            os.utime(path, (1_700_000_000 + b, 1_700_000_000 + b))
        # The default retries: with their jittered waits two writers of the same partitions take turns.
        writers[name] = (batches, landing, UpsertSink(config(tmp_path, name)))
    queries = [
        spark.readStream.schema(SCHEMA).option("maxFilesPerTrigger", 1).parquet(str(landing))
        .writeStream.foreachBatch(sink).option("checkpointLocation", str(tmp_path / f"cp-{name}"))
        .trigger(availableNow=True).start()
        for name, (_, landing, sink) in writers.items()
    ]
    for query in queries:
        query.awaitTermination()
        assert query.exception() is None
    everything = [events for batches, _, _ in writers.values() for events in batches]
    assert rows(str(tmp_path / "table")) == expected_rows(everything)
    assert sum(r.retries for _, _, sink in writers.values() for r in sink.reports) > 0
