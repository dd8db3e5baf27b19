"""Bringing a replica from the Delta version it reflects to the one a batch tags against."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from sink.index.entry import Entry
from sink.index.replica import ShardReplica
from sink.lakehouse.log import CommitSummary

ReadCommit = Callable[[int], CommitSummary | None]
# Row-level changes of one commit for this shard (partition id -> key -> entry), or None
# when the table has no change data feed for it.
ReadChanges = Callable[[int], dict[str, dict[bytes, Entry]] | None]


@dataclass
class CatchUpReport:
    commits_read: int = 0
    promoted: int = 0
    invalidated: set[str] = field(default_factory=set)
    applied: int = 0  # entries taken from the change data feed
    rebuilt: str | None = None  # why the replica was emptied, if it was


def catch_up(
    replica: ShardReplica,
    target: int,
    read_commit: ReadCommit,
    writer_id: str,
    shard: int,
    read_changes: ReadChanges | None = None,
) -> CatchUpReport:
    """Apply commits (replica version, target] to the replica.

    The commit carrying this replica's staged batch promotes it; a sink commit whose
    batch had no records in this shard changes nothing here; any other commit drops
    the partitions it touched (they reload on demand) or, when `read_changes` gives the
    commit's row-level changes (change data feed), applies them instead. A missing log entry, or a
    replica ahead of the target, empties the replica. Whatever is still staged at
    the end belongs to a batch that did not land and is discarded.
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
        staged = replica.staged_batch
        ours = commit.app_versions.get(writer_id)
        if ours is not None and staged is not None and ours == staged:
            report.promoted += replica.promote_staged()
            continue
        shards = commit.sink_shards()
        if ours is not None and shards is not None and shard not in shards:
            continue
        if commit.partitions is None:
            report.rebuilt = f"commit {version} changed the table's metadata or lacks partition values"
            replica.drop_all()
            continue
        held = [pid for pid in commit.partitions if replica.has_partition(pid)]
        changes = read_changes(version) if held and read_changes else None
        for pid in held:
            if changes is None:
                replica.drop_partition(pid)
                report.invalidated.add(pid)
            elif changes.get(pid):
                replica.put_entries(pid, changes[pid])
                report.applied += len(changes[pid])
    replica.discard_staged()
    replica.set_version(target)
    return report
