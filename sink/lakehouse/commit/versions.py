"""SCD type 2 commit: the history of the batch's keys, rebuilt and written copy-on-write.

A key the table holds (the index found it) gets its history rebuilt from the events its stored
versions keep (`sink.history`), the deletes of it the tombstone table keeps, and the batch's
events. Only the files of the partitions the index places the key in are probed, on their
key columns (its partition; in global scope every partition its events named), and those
holding a batch key are read and rewritten with the keys' new versions, each version in the
partition its values name. A key new to the table gets its history from the batch's events
alone, written to a new file. The driver commits the files in one commit with the app
transaction, as the type 1 rewrite's."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
from deltalake import DeltaTable

from sink import keys
from sink.delta_log.predicates import partitions_predicate
from sink.delta_log.reading import filesystem
from sink.history import END_AT, START_AT, History, HistoryColumns, build, events_of, events_schema
from sink.index.loader import committed_tombstones, expired_rows
from sink.lakehouse.commit.actions import Rewrite, StoredFile
from sink.lakehouse.commit.data_files import write_partition_files
from sink.lakehouse.commit.key_hits import file_key_columns, matching_files
from sink.lakehouse.commit.partition_writes import with_inserts
from sink.lakehouse.commit.stored_rows import row_keys
from sink.lakehouse.commit.writes import conform, partition_string

VERSION_CHANGES = ("opened", "closed", "split")
# The partition column of `HistoryWrites.reads`.
PID_COLUMN = "__sink_pid"


@dataclass(frozen=True)
class HistoryWrites:
    """`events`: the batch's events (the columns of `cols`'s events table, with `cols.delete`);
    `reads`: where the table may hold the keys the index knows (PID_COLUMN, a partition id,
    and `key_cols`); `free`: the deletes the tombstone table keeps of them (events);
    `schema`: the table's. `cols.key` is the key, with the partition columns in
    partitioned scope (in global scope they are values)."""

    events: pa.Table
    reads: pa.Table
    free: pa.Table
    schema: pa.Schema
    cols: HistoryColumns
    key_cols: list[str]
    partition_by: list[str]


@dataclass(frozen=True)
class HistoryRewrite:
    rewrite: Rewrite
    versions_written: int  # rows of the batch's keys' rebuilt histories
    versions_replaced: int  # stored rows they replace
    # Versions opened (none started there before), closed (open before, ended now) and split
    # (ended earlier than before: a late event landed inside).
    changes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(VERSION_CHANGES, 0))


@dataclass(frozen=True)
class HistoryMerge:
    """The MERGE that commits rebuilt histories on a table the rewrite cannot honour: `source`
    holds the table's columns and ACTION_COLUMN: "keep" rows are versions to update (matched
    on key, partition and START_AT) or insert, "drop" rows stored versions to delete.
    `partitions`: the partition values the MERGE touches."""

    source: pa.Table
    partitions: list[dict[str, str | None]]
    versions_written: int
    versions_replaced: int
    changes: dict[str, int]


ACTION_COLUMN = "__sink_action"


@dataclass(frozen=True)
class _Rebuilt:
    """Per partition: what its files hold of the batch's keys and their versions now."""

    stored: dict[str, _Stored]
    after: dict[str, pa.Table]
    changes: dict[str, int]
    schema: pa.Schema

    def changed(self, cols: HistoryColumns) -> Iterator[tuple[str, _Stored, pa.Table]]:
        """(pid, stored, versions now) of the partitions whose versions change."""
        for pid in dict.fromkeys([*self.stored, *self.after]):
            old = self.stored.get(pid) or _Stored([], [], self.schema.empty_table())
            new = self.after.get(pid, self.schema.empty_table())
            if not _same(old.before, new, cols):  # else: events the history already holds
                yield pid, old, new


def _rebuild(fs: pafs.FileSystem, root: str, snapshot: dict[str, list[StoredFile]], writes: HistoryWrites,
             pool: ThreadPoolExecutor) -> _Rebuilt:
    """Read the files holding known keys (a task per partition), rebuild every key's history
    at once."""
    cols, schema = writes.cols, writes.schema
    reads = _by_pid(writes.reads)
    stored = dict(zip(reads, pool.map(lambda pid: _stored(fs, root, snapshot.get(pid, []), reads[pid], writes),
                                      reads)))
    before = pa.concat_tables([schema.empty_table(), *(s.before for s in stored.values())])
    events = writes.events
    free = _of_keys(writes.free, events, cols.key) if writes.free.num_rows else writes.free
    shape = events_schema(schema, cols)
    history = build(pa.concat_tables([events_of(History(before, free), cols).cast(shape),
                                      events.select(shape.names).cast(shape)]), cols)
    return _Rebuilt(stored, _by_partition(conform(history.versions, schema), writes.partition_by),
                    version_changes(before, history.versions, cols), schema)


def rewrite_files(uri: str, snapshot: dict[str, list[StoredFile]], writes: HistoryWrites) -> HistoryRewrite:
    """Rebuild the batch's keys' histories and write each changed partition's files (in
    threads)."""
    schema = writes.schema
    fs, root = filesystem(uri)
    data_schema = pa.schema([f for f in schema if f.name not in writes.partition_by])

    def write(changed: tuple[str, _Stored, pa.Table]) -> HistoryRewrite:
        _, old, new = changed
        values = _partition_values(old, new, writes.partition_by)
        # Versions of keys found here go back to the first file read, others' as inserts do.
        found = pc.is_in(row_keys(new, writes.key_cols), value_set=row_keys(old.before, writes.key_cols))
        rebuilt, fresh = new.filter(found), new.filter(pc.invert(found))
        files = [pa.concat_tables([old.kept[0], rebuilt]), *old.kept[1:]] if old.kept else [rebuilt]
        outputs = [t for t in with_inserts(files, fresh) if t.num_rows]
        return HistoryRewrite(Rewrite(write_partition_files(fs, root, outputs, values, data_schema),
                                      old.removed), new.num_rows, old.before.num_rows)

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        rebuilt = _rebuild(fs, root, snapshot, writes, pool)
        done = list(pool.map(write, list(rebuilt.changed(writes.cols))))
    rewrite = Rewrite([a for d in done for a in d.rewrite.adds], [f for d in done for f in d.rewrite.removes])
    return HistoryRewrite(rewrite, sum(d.versions_written for d in done), sum(d.versions_replaced for d in done),
                          rebuilt.changes)


def merge_rows(uri: str, snapshot: dict[str, list[StoredFile]], writes: HistoryWrites) -> HistoryMerge:
    """Rebuild the batch's keys' histories as `rewrite_files` does, as a MERGE's source: in
    each changed partition every version now ("keep") and the stored ones no longer there
    ("drop")."""
    cols = writes.cols
    fs, root = filesystem(uri)
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        rebuilt = _rebuild(fs, root, snapshot, writes, pool)
    parts, partitions, written, replaced = [_acting(writes.schema.empty_table(), "keep")], [], 0, 0
    for _, old, new in rebuilt.changed(cols):
        stored = _bounds(old.before, cols).append_column("__row", pa.array(np.arange(old.before.num_rows)))
        gone = stored.join(_bounds(new, cols), keys=_version_id(stored, cols), join_type="left anti").column("__row")
        parts += [_acting(new, "keep"), _acting(old.before.take(gone), "drop")]
        partitions.append(_partition_values(old, new, writes.partition_by))
        written, replaced = written + new.num_rows, replaced + old.before.num_rows
    return HistoryMerge(pa.concat_tables(parts), partitions, written, replaced, rebuilt.changes)


def _acting(rows: pa.Table, action: str) -> pa.Table:
    return rows.append_column(ACTION_COLUMN, pa.array([action] * rows.num_rows, pa.string()))


def _partition_values(old: _Stored, new: pa.Table, partition_by: Sequence[str]) -> dict[str, str | None]:
    """The Delta partition values of a partition, from its versions now or its files read."""
    if new.num_rows:
        return {c: partition_string(new.column(c)[0].as_py()) for c in partition_by}
    return old.removed[0].partition_values


def version_changes(before: pa.Table, after: pa.Table, cols: HistoryColumns) -> dict[str, int]:
    """How the versions of some keys changed from `before` to `after` (a version is its key
    and START_AT): opened, closed, split (see HistoryRewrite)."""
    old, new = _bounds(before, cols), _bounds(after, cols)
    on = _version_id(old, cols)
    opened = new.join(old, keys=on, join_type="left anti").num_rows
    both = old.join(new, keys=on, join_type="inner", right_suffix="__after")
    ends = [c for c in old.column_names if c.startswith("__end_")]
    was_open, is_open = pc.invert(both.column("__ended")), pc.invert(both.column("__ended__after"))
    moved = pa.array(np.zeros(both.num_rows, bool))
    for c in ends:
        moved = pc.or_(moved, pc.fill_null(pc.not_equal(both.column(c), both.column(c + "__after")), False))
    closed = pc.and_(was_open, pc.invert(is_open))
    split = pc.and_(pc.and_(pc.invert(was_open), pc.invert(is_open)), moved)
    return {"opened": opened, "closed": count_true(closed), "split": count_true(split)}


def _bounds(versions: pa.Table, cols: HistoryColumns) -> pa.Table:
    """Key, START_AT and END_AT of `versions` as plain columns, and whether END_AT is set."""
    out = versions.select(list(cols.key))
    for name, column in (("__start", START_AT), ("__end", END_AT)):
        sequence = versions.column(column).combine_chunks()
        fields = ([pc.struct_field(sequence, i) for i in range(sequence.type.num_fields)]
                  if pa.types.is_struct(sequence.type) else [sequence])
        for i, f in enumerate(fields):
            out = out.append_column(f"{name}_{i}", f)
    return out.append_column("__ended", pc.is_valid(versions.column(END_AT)))


def _version_id(bounds: pa.Table, cols: HistoryColumns) -> list[str]:
    """The columns of `_bounds` naming a version: its key and START_AT."""
    return [*cols.key, *(c for c in bounds.column_names if c.startswith("__start_"))]


def count_true(mask: pa.Array) -> int:
    """How many of a boolean array's values are true."""
    return pc.sum(pc.cast(mask, pa.int64())).as_py() or 0


@dataclass(frozen=True)
class _Stored:
    """What one partition's files hold of the batch's keys."""

    kept: list[pa.Table]  # rows of other keys, per file read
    removed: list[StoredFile]  # the files read
    before: pa.Table  # the versions of the batch's keys


def _stored(fs: pafs.FileSystem, root: str, files: Sequence[StoredFile], probe: pa.Table,
            writes: HistoryWrites) -> _Stored:
    """The rows of one partition's `files` holding a key of `probe` (`writes.key_cols`)."""
    schema = writes.schema
    kept, removed, before = [], [], [schema.empty_table()]
    if files:
        key_cols = file_key_columns(writes.key_cols, writes.partition_by)
        key_schema = pa.schema([schema.field(c) for c in key_cols])
        incoming = pc.unique(row_keys(conform(probe, key_schema), key_cols))
        with ExitStack() as stack:
            for f, stored, hits, _ in matching_files(fs, root, files, incoming, key_cols, files[0].partition_values,
                                                     schema, stack=stack):
                rows = stored.read()
                touched = pa.array(hits.mask(stored.num_rows))
                kept.append(rows.filter(pc.invert(touched)))
                before.append(rows.filter(touched))
                removed.append(f)
    return _Stored([t for t in kept if t.num_rows], removed, pa.concat_tables(before))


def _by_pid(reads: pa.Table) -> dict[str, pa.Table]:
    """`reads` by their PID_COLUMN."""
    return _grouped(reads, reads.column(PID_COLUMN))


def _by_partition(rows: pa.Table, partition_by: Sequence[str]) -> dict[str, pa.Table]:
    """`rows` by partition id."""
    return _grouped(rows, keys.partition_ids(rows, partition_by))


def _grouped(rows: pa.Table, pids: pa.Array | pa.ChunkedArray) -> dict[str, pa.Table]:
    """`rows` by their `pids` (one sort, then slices)."""
    if not rows.num_rows:
        return {}
    order = pc.sort_indices(pids)
    rows, pids = rows.take(order), pids.take(order)
    starts = np.flatnonzero(np.concatenate([[True], ~pc.equal(pids[1:], pids[:-1]).to_numpy(zero_copy_only=False)]))
    ends = np.append(starts[1:], len(pids))
    return {pids[s].as_py(): rows.slice(s, e - s) for s, e in zip(starts, ends)}


def _of_keys(free: pa.Table, events: pa.Table, key: Sequence[str]) -> pa.Table:
    """The rows of `free` whose key (`key` columns) is a key of `events`."""
    return free.join(events.select(list(key)).group_by(list(key)).aggregate([]), keys=list(key),
                     join_type="left semi")


def _same(before: pa.Table, after: pa.Table, cols: HistoryColumns) -> bool:
    """Whether two sets of versions are the same rows (a key's versions show distinct events,
    so key and ordering order them)."""
    if before.num_rows != after.num_rows:
        return False
    order = [(c, "ascending") for c in (*cols.key, *cols.ordering)]
    return before.sort_by(order).equals(after.sort_by(order))


def free_deletes(table: Callable[[], DeltaTable], tombstone_uri: str, pids: Sequence[str], cols: HistoryColumns,
                 schema: pa.Schema, ttl_seconds: int | None, now: float) -> pa.Table:
    """The deletes the tombstone table keeps in partitions `pids` (of batches `table()` holds,
    not expired under the TTL as of `now`), as events. `table` is opened only when there
    are any to read."""
    shape = events_schema(schema, cols)
    if not pids or not DeltaTable.is_deltatable(tombstone_uri):
        return shape.empty_table()
    tombstones = DeltaTable(tombstone_uri)
    where = partitions_predicate(pids, {f.name: f.type for f in pa.schema(tombstones.schema().to_arrow())})
    rows = committed_tombstones(table(), tombstones, where, [*cols.key, *cols.ordering])
    rows = rows.filter(pc.invert(expired_rows(rows, ttl_seconds, now)))
    columns = [rows.column(f.name).cast(f.type) if f.name in rows.column_names
               else pa.array(np.ones(rows.num_rows, bool)) if f.name == cols.delete
               else pa.nulls(rows.num_rows, f.type) for f in shape]
    return pa.table(columns, schema=shape)
