"""A tagging task's side of the replica snapshots (sink.index.snapshots): an empty replica
starts from the newest one, and a replica whose snapshot is due publishes one."""

from __future__ import annotations

import logging
import shutil

from sink.index import snapshots
from sink.index.replica import Seed, ShardReplica
from sink.index.snapshots import SnapshotPlace
from sink.library_errors import first_line
from sink.tagging.task_context import TaskContext
from sink.tagging.task_stats import TaskStats

log = logging.getLogger(__name__)


def place(ctx: TaskContext, shard: int) -> SnapshotPlace | None:
    """Where the shard's snapshots live; None when snapshots are off."""
    if ctx.snapshot_uri is None:
        return None
    return SnapshotPlace(ctx.snapshot_uri, ctx.table_id, shard, ctx.num_shards)


def seed(ctx: TaskContext, shard: int) -> Seed | None:
    """What fills the shard's replica when it is empty: the newest snapshot at most at the
    batch's table version (a newer one would be ahead of the table the batch reads)."""
    where = place(ctx, shard)
    if where is None:
        return None
    return lambda path: snapshots.restore(where, path, at_most=ctx.table_version)


def publish_if_due(ctx: TaskContext, replica: ShardReplica, shard: int, stats: TaskStats) -> None:
    """Publish the replica, caught up to the batch's table version and with nothing staged,
    when its snapshot is due and it holds a partition (an empty one saves a restart nothing:
    a batch's loads come first). A failure is logged and costs the batch nothing more: the
    next one is tried `replica_snapshot_every_versions` versions on."""
    where = place(ctx, shard)
    version = replica.version
    if (where is None or version is None or replica.staged_batch is not None or not replica.partitions()
            or not snapshots.due(version, replica.meta.snapshot_version, ctx.index.replica_snapshot_every_versions)):
        return
    replica.meta.set_snapshot_version(version)  # before the copy: a replica restored from it has it
    local = snapshots.local_copy_dir(replica.path)
    try:
        snapshots.publish(local, replica.copy_to(local), where)
        stats.snapshots_published += 1
    except Exception as e:
        log.warning("shard %s: replica snapshot at version %s not published to %s (%s); the next one is due "
                    "%s versions on", shard, version, ctx.snapshot_uri, first_line(e),
                    ctx.index.replica_snapshot_every_versions)
    finally:
        shutil.rmtree(local, ignore_errors=True)
