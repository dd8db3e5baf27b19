"""A stream whose replicas are lost between runs starts from the snapshots it published
(replica_snapshot_every_versions) instead of reading the table, and stays exact: its own
batches since the snapshot come from the index changelog, another writer's commits reload
what they touched."""

import pytest
from deltalake import DeltaTable

from sink import SinkConfig, UpsertSink
from tests import damage
from tests.oracle import SCHEMA, Event, expected_rows, random_batches, verify_replicas

pytestmark = pytest.mark.spark

SHARDS = 2


def config(tmp_path, tag_on, every):
    return SinkConfig(
        table_uri=str(tmp_path / "table"), key=["id"], partition_by=[], ordering="ts", delete_when="op = 'd'",
        checkpoint_dir=str(tmp_path / "cp"), index_dir=str(tmp_path / "index"), metrics_port=0,
        num_shards=SHARDS, tag_on=tag_on, replica_snapshot_every_versions=every,
    )


def table_rows(uri):
    return sorted(DeltaTable(uri).to_pyarrow_table().to_pylist(), key=lambda r: (r["dt"], r["id"]))


def restarted(sink, cfg, tmp_path):
    """A new process on new disks: the stream stops, its replicas are lost, a new sink starts."""
    sink.close()
    damage.lose(tmp_path / "index")
    return UpsertSink(cfg)


@pytest.mark.parametrize("tag_on", ["driver", "executors"])
def test_a_restart_without_replicas_starts_from_the_snapshots_and_matches_the_oracle(spark, tmp_path, tag_on):
    cfg = config(tmp_path, tag_on, every=2)
    oracle = []  # the batches, and the other writer's delete where it came
    sink = UpsertSink(cfg)
    for b, events in enumerate(random_batches(11, batches=8, per_batch=200, days=1, bad_share=0)):
        if b in (3, 6):
            sink = restarted(sink, cfg, tmp_path)
        if b == 6:  # another writer between the snapshot and the restart
            gone = table_rows(cfg.table_uri)[0]
            DeltaTable(cfg.table_uri).delete(f"id = '{gone['id']}'")
            oracle.append([Event(gone["id"], gone["dt"], gone["ts"], "d", "")])
        sink(spark.createDataFrame(events, SCHEMA), b)
        oracle.append(events)
        report = sink.reports[-1]
        assert table_rows(cfg.table_uri) == expected_rows(oracle), f"after batch {b}"
        loads = report.partition_loads
        if b == 0:  # none yet: published at once
            assert (report.snapshots_published, report.snapshots_restored) == (SHARDS, 0)
        elif b == 3:  # behind the table by this writer's batches since: replayed from the changelog
            assert (report.snapshots_restored, sum(loads.values())) == (SHARDS, 0)
            assert report.changelog_applied > 0
        elif b == 6:  # the other writer's delete touched the one partition: reloaded, never rebuilt
            assert (report.snapshots_restored, loads["bootstrap"], loads["invalidated"]) == (SHARDS, 0, SHARDS)
        else:
            assert report.snapshots_restored == 0 and sum(loads.values()) == 0
        if b == 4:  # the restored replicas carry their snapshot's version: due again two versions on
            assert report.snapshots_published == SHARDS
    sink.close()
    assert sum(r["entries_checked"] for r in verify_replicas(cfg)) > 0  # every key, not only the batches'


def test_snapshots_are_off_by_default_and_a_lost_replica_reads_the_table(spark, tmp_path):
    cfg = SinkConfig(table_uri=str(tmp_path / "table"), key=["id"], partition_by=[], ordering="ts",
                     delete_when="op = 'd'", checkpoint_dir=str(tmp_path / "cp"), index_dir=str(tmp_path / "index"),
                     metrics_port=0, num_shards=SHARDS, tag_on="driver")
    batches = random_batches(12, batches=2, per_batch=100, days=1, bad_share=0)
    sink = UpsertSink(cfg)
    sink(spark.createDataFrame(batches[0], SCHEMA), 0)
    sink = restarted(sink, cfg, tmp_path)
    sink(spark.createDataFrame(batches[1], SCHEMA), 1)
    report = sink.reports[-1]
    assert (report.snapshots_published, report.snapshots_restored, report.replicas_rebuilt) == (0, 0, SHARDS)
    assert sum(report.partition_loads.values()) == SHARDS  # the table's one partition, read by each shard
    assert not (tmp_path / "table_index_snapshots").exists() and not (tmp_path / "table_index_changelog").exists()
    assert table_rows(cfg.table_uri) == expected_rows(batches)
