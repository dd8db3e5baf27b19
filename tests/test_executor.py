import logging
from pathlib import Path

import pytest
from deltalake import DeltaTable

import sink.executor as executor
import sink.foreach_batch as foreach_batch
from sink import SinkConfig, UpsertSink
from sink.index.replica import ShardReplica
from tests.oracle import SCHEMA, expected_rows, random_batches, verify_replicas

pytestmark = pytest.mark.spark

SHARDS = 2


def config(tmp_path, writer_id):
    return SinkConfig(
        table_uri=str(tmp_path / "table"), key=["id"], partition_by=["dt"], ordering="ts", delete_when="op = 'd'",
        checkpoint_dir=str(tmp_path / "cp"), index_dir=str(tmp_path / "index"), metrics_port=0, num_shards=SHARDS,
        tag_on="driver", writer_id=writer_id,
    )


def table_rows(uri):
    return sorted(DeltaTable(uri).to_pyarrow_table().to_pylist(), key=lambda r: (r["dt"], r["id"]))


def test_driver_tagging_finds_its_replicas_caught_up_while_the_records_were_collected(spark, tmp_path,
                                                                                     monkeypatch):
    batches = random_batches(11, batches=3, per_batch=200)
    events: list[tuple] = []  # what ran, in order: catch-ups (shard, entries promoted) and taggings
    catch_up = executor.catch_up

    def spied_catch_up(replica, target, read_commit, writer_id, shard, *args):
        report = catch_up(replica, target, read_commit, writer_id, shard, *args)
        events.append(("catch_up", shard, report.promoted))
        return report

    tag_locally = foreach_batch.tag_locally

    def spied_tag_locally(*args):
        events.append(("tag",))
        return tag_locally(*args)

    monkeypatch.setattr(executor, "catch_up", spied_catch_up)
    monkeypatch.setattr(foreach_batch, "tag_locally", spied_tag_locally)
    sink = UpsertSink(config(tmp_path, "ahead"))
    for b, batch in enumerate(batches):
        events.clear()
        sink(spark.createDataFrame(batch, SCHEMA), b)
        assert table_rows(sink.config.table_uri) == expected_rows(batches[: b + 1]), f"after batch {b}"
        if b == 0:
            continue  # nothing kept open yet: each shard's tagging opens and bootstraps its replica
        tagging = events.index(("tag",))
        ahead, during = events[:tagging], events[tagging + 1:]
        # Every replica promoted the previous batch's entries before the tagging began ...
        assert sorted(shard for _, shard, _ in ahead) == list(range(SHARDS))
        assert all(promoted > 0 for *_, promoted in ahead)
        # ... so the tagging found nothing left to apply.
        assert during and all(promoted == 0 for *_, promoted in during)
        # Each replica read the one new log entry once: the report counts the catch-up ahead.
        assert sink.reports[-1].commits_read == SHARDS
    sink.close()
    verify_replicas(sink.config)


def test_a_replica_that_fails_to_catch_up_ahead_is_caught_up_by_its_tagging(spark, tmp_path, monkeypatch, caplog):
    batches = random_batches(12, batches=2, per_batch=200)
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

    catch_up_kept_open, prepare_replica = executor.catch_up_kept_open, executor.prepare_replica
    monkeypatch.setattr(foreach_batch, "catch_up_kept_open", failing)
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
    sink.close()
    assert reader_versions(cfg) == [tagged_at] * SHARDS
