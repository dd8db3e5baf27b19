"""A tagging task's side of the replica snapshots: when it publishes, and what a failed
publish leaves (sink.tagging.replica_snapshots)."""

import logging
from types import SimpleNamespace

from sink.index.entry import Entry
from sink.index.replica import ShardReplica
from sink.index.spec import replica_spec
from sink.tagging import replica_snapshots
from sink.tagging.task_stats import TaskStats

SPEC = replica_spec(["id"], [], "ts")


def _ctx(tmp_path, every, uri="snapshots"):
    return SimpleNamespace(snapshot_uri=None if uri is None else str(tmp_path / uri), table_id="tid", num_shards=1,
                           table_version=5, index=SimpleNamespace(replica_snapshot_every_versions=every))


def _replica(path, partitions=True):
    replica = ShardReplica.open(path, SPEC)
    if partitions:
        replica.load_partition("", [b"k1", b"k2"], [Entry(1), Entry(2)], reason="bootstrap")
    replica.set_version(5)
    return replica


def _left_beside(tmp_path):
    return sorted(p.name for p in (tmp_path / "index").iterdir())


def test_a_due_snapshot_is_published_once_and_its_version_kept(tmp_path):
    ctx, stats = _ctx(tmp_path, every=10), TaskStats()
    with _replica(tmp_path / "index" / "shard-0-of-1") as replica:
        replica_snapshots.publish_if_due(ctx, replica, 0, stats)
        replica_snapshots.publish_if_due(ctx, replica, 0, stats)  # not due again until version 15
        assert (stats.snapshots_published, replica.meta.snapshot_version, replica.clean) == (1, 5, False)
    assert _left_beside(tmp_path) == ["shard-0-of-1"]  # the local copy went after its upload
    with ShardReplica.open(tmp_path / "again", SPEC, seed=replica_snapshots.seed(ctx, 0)) as restored:
        assert (restored.restored, restored.meta.snapshot_version) == (5, 5)  # not due at once after a restart
        assert restored.lookup("", [b"k1", b"k2"]) == [Entry(1), Entry(2)]


def test_nothing_is_published_when_off_or_when_the_replica_holds_nothing(tmp_path):
    stats = TaskStats()
    with _replica(tmp_path / "index" / "a") as replica:
        replica_snapshots.publish_if_due(_ctx(tmp_path, every=0), replica, 0, stats)
        replica_snapshots.publish_if_due(_ctx(tmp_path, every=10, uri=None), replica, 0, stats)
    with _replica(tmp_path / "index" / "b", partitions=False) as empty:
        replica_snapshots.publish_if_due(_ctx(tmp_path, every=10), empty, 0, stats)
    assert stats.snapshots_published == 0 and not (tmp_path / "snapshots").exists()
    assert replica_snapshots.seed(_ctx(tmp_path, every=0, uri=None), 0) is None


def test_a_publish_failing_after_the_replica_was_marked_clean_leaves_it_in_use_and_the_batch_going(
        tmp_path, caplog):
    ctx, stats = _ctx(tmp_path, every=10), TaskStats()
    with _replica(tmp_path / "index" / "shard-0-of-1") as replica:
        mark_clean = replica.meta.mark_clean

        def full_disk(token):
            mark_clean(token)  # written, then its flush fails
            raise OSError("No space left on device")

        replica.meta.mark_clean = full_disk
        with caplog.at_level(logging.WARNING, logger="sink.tagging.replica_snapshots"):
            replica_snapshots.publish_if_due(ctx, replica, 0, stats)
        assert not replica.clean  # else its close would skip the checkpoint its later writes need
        assert stats.snapshots_published == 0
        assert "replica snapshot at version 5 not published" in caplog.text and "No space left" in caplog.text
        replica.meta.mark_clean = mark_clean
    assert _left_beside(tmp_path) == ["shard-0-of-1"]
