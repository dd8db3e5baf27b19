import dataclasses
import logging
import shutil
from pathlib import Path

import pyarrow as pa
import pytest
from deltalake import DeltaTable

import sink.batch.driver_tagger as driver_tagger
import sink.tagging.executor as executor
from sink import SinkConfig, UpsertSink
from sink.index.replica import ShardReplica
from tests.oracle import SCHEMA, expected_rows, random_batches, random_events, verify_replicas

pytestmark = pytest.mark.spark

SHARDS = 2


def config(tmp_path, writer_id):
    return SinkConfig(
        table_uri=str(tmp_path / "table"), key=["id"], partition_by=["dt"], ordering="ts", delete_when="op = 'd'",
        checkpoint_dir=str(tmp_path / "cp"), index_dir=str(tmp_path / "index"), metrics_port=0, num_shards=SHARDS,
        tag_on="driver", writer_id=writer_id,
        peek_max_keys=0,  # these tests drive loads and catch-ups; reads of a few keys: tests/test_lifecycle.py
    )


def table_rows(uri):
    return sorted(DeltaTable(uri).to_pyarrow_table().to_pylist(), key=lambda r: (r["dt"], r["id"]))


def test_driver_tagging_finds_its_replicas_caught_up_with_the_last_commit(spark, tmp_path, monkeypatch):
    """The replicas promote a batch's entries after its commit, in a thread that runs while
    Spark records the batch and plans the next; the next tagging finds nothing to apply."""
    batches = random_batches(11, batches=3, per_batch=200)
    events: list[tuple] = []  # what ran, in order: catch-ups (shard, entries promoted), taggings
    catch_up = executor.catch_up

    def spied_catch_up(replica, target, read_commit, writer_id, shard, *args):
        report = catch_up(replica, target, read_commit, writer_id, shard, *args)
        events.append(("catch_up", shard, report.promoted))
        return report

    tag_locally = driver_tagger.tag_locally

    def spied_tag_locally(*args):
        events.append(("tag",))
        try:
            return tag_locally(*args)
        finally:
            events.append(("tagged",))

    monkeypatch.setattr(executor, "catch_up", spied_catch_up)
    monkeypatch.setattr(driver_tagger, "tag_locally", spied_tag_locally)
    sink = UpsertSink(config(tmp_path, "ahead"))
    for b, batch in enumerate(batches):
        sink(spark.createDataFrame(batch, SCHEMA), b)
        assert table_rows(sink.config.table_uri) == expected_rows(batches[: b + 1]), f"after batch {b}"
        if b == 0:
            continue  # nothing kept open yet: each shard's tagging opens and bootstraps its replica
        tagged = [i for i, e in enumerate(events) if e == ("tagged",)]
        tagging = max(i for i, e in enumerate(events) if e == ("tag",))
        between, during = events[tagged[-2] + 1:tagging], events[tagging + 1:tagged[-1]]
        # Every replica promoted the previous batch's entries before this tagging began ...
        promoted = sorted(shard for _, shard, n in between if n > 0)
        assert promoted == list(range(SHARDS))
        # ... so the tagging found nothing left to apply.
        assert during and all(n == 0 for *_, n in during)
        # Each replica read the last batch's log entry once, counted in this batch.
        assert sink.reports[-1].commits_read == SHARDS
    sink.close()
    verify_replicas(sink.config)


def test_the_tables_kept_for_reads_are_brought_to_each_commit_between_batches(spark, tmp_path, monkeypatch):
    brought: list[tuple] = []
    monkeypatch.setattr(driver_tagger.open_tables, "bring_forward", lambda *args: brought.append(args))
    sink = UpsertSink(config(tmp_path, "forward"))
    for b, batch in enumerate(random_batches(13, batches=2, per_batch=100)):
        sink(spark.createDataFrame(batch, SCHEMA), b)
    sink.close()
    cfg, owner = sink.config, sink._instance
    assert brought == [call for r in sink.reports for call in (
        (cfg.table_uri, owner, r.table_version), (cfg.resolved_tombstone_uri, owner))]


def test_a_replica_that_fails_to_catch_up_ahead_is_caught_up_by_its_tagging(spark, tmp_path, monkeypatch, caplog):
    batches = random_batches(12, batches=2, per_batch=200)
    monkeypatch.setattr(driver_tagger, "catch_up_after_commit", lambda ctx: None)  # left to the next batch
    sink = UpsertSink(config(tmp_path, "ahead-fails"))
    sink(spark.createDataFrame(batches[0], SCHEMA), 0)

    def failing(ctx):
        monkeypatch.setattr(executor, "prepare_replica", broken)  # only for the catch-up ahead
        try:
            return catch_up_kept_open(ctx)
        finally:
            monkeypatch.setattr(executor, "prepare_replica", prepare_replica)

    def broken(*args):
        raise OSError("disk full")

    catch_up_kept_open, prepare_replica = driver_tagger.catch_up_kept_open, executor.prepare_replica
    monkeypatch.setattr(driver_tagger, "catch_up_kept_open", failing)
    with caplog.at_level(logging.INFO, logger="sink"):
        sink(spark.createDataFrame(batches[1], SCHEMA), 1)
    assert caplog.text.count("not caught up ahead of tagging (disk full)") == SHARDS
    assert table_rows(sink.config.table_uri) == expected_rows(batches)
    assert sink.reports[-1].commits_read == SHARDS  # read by the tagging instead
    sink.close()
    verify_replicas(sink.config)


def reader_versions(cfg):
    """The table version each replica shows a reader beside this process (verify's view)."""
    versions = []
    for path in sorted(Path(cfg.index_dir).glob("*/shard-*")):
        with ShardReplica.open_read_only(path) as replica:
            versions.append(replica.version)
    return versions


@pytest.mark.parametrize("flush_every_s", [0.0, executor.FLUSH_EVERY_S])
def test_replicas_kept_open_are_flushed_when_due_and_when_closed(spark, tmp_path, monkeypatch, flush_every_s):
    monkeypatch.setattr(executor, "FLUSH_EVERY_S", flush_every_s)
    cfg = config(tmp_path, f"flushed-{flush_every_s}")
    sink = UpsertSink(cfg)
    for b, events in enumerate(random_batches(5, batches=3, per_batch=200)):
        sink(spark.createDataFrame(events, SCHEMA), b)
    tagged_at = DeltaTable(cfg.table_uri).version() - 1  # the version the last batch was tagged against
    # Due at every batch: a reader sees the last tagging; not due within a test: an older state.
    assert (reader_versions(cfg) == [tagged_at] * SHARDS) == (flush_every_s == 0.0)
    sink.close()  # after the catch-up to the last commit, which runs once a batch has committed
    assert reader_versions(cfg) == [tagged_at + 1] * SHARDS


def alternating_batches(seed: int, batches: int) -> list:
    """Even batches write two partitions, odd ones two others: with a 1-hour partition TTL and
    2 hours between batches, each batch evicts the pair the last one wrote and loads its own
    again from the table."""
    return [random_events(seed + b, 1, 120, 40, lambda k, b=b: f"2025-01-0{1 + b % 2 * 2 + k % 2}",
                          lambda rng, _: rng.randrange(0, 60), delete_share=0.15)[0] for b in range(batches)]


def test_a_sink_on_a_table_recreated_under_an_unclosed_one_reads_the_new_table(spark, tmp_path):
    clock = [1_738_368_000.0]  # 2025-02-01: every partition is older than the bootstrap window
    first = UpsertSink(dataclasses.replace(config(tmp_path, "first"), partition_ttl_hours=1),
                       clock=lambda: clock[0])
    for b, batch in enumerate(alternating_batches(30, 3)):
        first(spark.createDataFrame(batch, SCHEMA), b)
        clock[0] += 2 * 3600
    # Not closed: this process still keeps its tables open. The table and its tombstones are
    # dropped and made again at the same place by a new stream, which gets past their versions.
    dropped_at = DeltaTable(first.config.table_uri).version()
    shutil.rmtree(first.config.table_uri)
    shutil.rmtree(first.config.resolved_tombstone_uri)
    cfg = dataclasses.replace(config(tmp_path, "second"), partition_ttl_hours=1, checkpoint_dir=str(tmp_path / "cp2"),
                              index_dir=str(tmp_path / "index2"))
    second = UpsertSink(cfg, clock=lambda: clock[0])
    batches = alternating_batches(40, 7)
    for b, batch in enumerate(batches):
        second(spark.createDataFrame(batch, SCHEMA), b)
        clock[0] += 2 * 3600
        assert table_rows(cfg.table_uri) == expected_rows(batches[: b + 1]), f"after batch {b}"
        if b >= 2:  # the pair written two batches ago, evicted since, loaded from the new table
            assert second.reports[-1].partition_loads["on_demand"] == 2 * SHARDS
    assert DeltaTable(cfg.table_uri).version() > dropped_at + 2
    second.close()
    first.close()
    verify_replicas(cfg)


def test_keys_per_partition_gives_each_asked_partitions_distinct_keys():
    pids = pa.array(["p1", "p2", "p1", None, "p3", "p1", "p2"])
    keys = pa.array(["a", "b", "a", "c", "d", "e", "f"])
    named = executor.keys_per_partition(pids, keys, ["p1", "p2", "p9"])
    assert {pid: sorted(ks.to_pylist()) for pid, ks in named.items()} == {"p1": [b"a", b"e"], "p2": [b"b", b"f"]}
    assert executor.keys_per_partition(pids, keys, []) == {}
