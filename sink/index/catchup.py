"""Bringing a replica from the Delta version it reflects to the one a batch tags against."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import pyarrow as pa

from sink.delta_log.reading import NUM_SHARDS_PROPERTY, READ_VERSION_PROPERTY, CommitSummary
from sink.index.replica import ShardReplica

ReadCommit = Callable[[int], CommitSummary | None]
# This shard's index entries (CHANGES_SCHEMA) of one of this writer's batches, from the
# changelog: (version the batch was tagged against, batch id) -> entries, or None when the
# changelog does not have them.
ReadChangelog = Callable[[int, int], pa.Table | None]


@dataclass
class CatchUpReport:
    commits_read: int = 0
    promoted: int = 0
    invalidated: set[str] = field(default_factory=set)
    changelog_applied: int = 0  # entries taken from the index changelog
    # This writer's batches for this shard that were tagged on another executor.
    moved_batches: int = 0
    rebuilt: str | None = None  # why the replica was emptied, if it was


def catch_up(
    replica: ShardReplica,
    target: int,
    read_commit: ReadCommit,
    writer_id: str,
    shard: int,
    read_changelog: ReadChangelog | None = None,
    num_shards: int | None = None,
) -> CatchUpReport:
    """Apply commits (replica version, target] to the replica.

    This writer's commits (same writer id and shard count): the one carrying the batch
    staged here, tagged against the same table version, promotes it; one whose batch had
    no records in this shard changes nothing; one whose batch was tagged elsewhere
    applies this shard's entries from the changelog. Every other commit (another writer's,
    a RESTORE), or one of ours the changelog lacks, drops the partitions it touched: they
    reload on demand from the table and the tombstone table, which holds what other writers
    deleted (sink.batch.other_writers), so a reload and a replica that never left give the
    same answers. A missing log entry, or a replica ahead of the target, empties the replica.
    Whatever is still staged at the end belongs to a batch that did not land and is discarded.
    """
    report = CatchUpReport()
    current = replica.version
    if current is None or current > target:
        report.rebuilt = "new replica" if current is None else f"replica at {current} > table {target}"
        replica.drop_all()
        replica.set_version(target)
        return report
    for version in range(current + 1, target + 1):
        commit = read_commit(version)
        report.commits_read += 1
        if commit is None:
            report.rebuilt = f"log entry {version} is gone"
            replica.drop_all()
            break
        ours = commit.app_versions.get(writer_id)
        recorded_shards = commit.sink_int(NUM_SHARDS_PROPERTY)
        if ours is not None and (recorded_shards is None or num_shards is None or recorded_shards == num_shards):
            if _apply_own(replica, commit, ours, shard, read_changelog, report):
                continue
        if commit.partitions is None:
            report.rebuilt = f"commit {version} changed the table's metadata or lacks partition values"
            replica.drop_all()
            continue
        for pid in replica.keyspaces.held_of(commit.partitions):
            replica.drop_partition(pid, invalidated=True)
            report.invalidated.add(pid)
    replica.discard_staged()
    replica.set_version(target)
    return report


def _apply_own(replica: ShardReplica, commit: CommitSummary, batch: int, shard: int,
               read_changelog: ReadChangelog | None, report: CatchUpReport) -> bool:
    """Apply one of this writer's commits from staging or the changelog; False when neither has it."""
    read_version = commit.sink_int(READ_VERSION_PROPERTY)
    if replica.staged_batch == batch and (read_version is None or read_version == replica.meta.staged_read_version):
        report.promoted += replica.promote_staged()
        return True
    shards = commit.sink_shards()
    if shards is not None and shard not in shards:
        return True  # the batch had no records in this shard
    report.moved_batches += 1
    entries = read_changelog(read_version, batch) if read_changelog and read_version is not None else None
    if entries is None:
        return False
    report.changelog_applied += replica.staging.apply_changes(entries)
    return True
