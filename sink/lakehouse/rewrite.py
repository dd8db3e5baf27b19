"""Copy-on-write commit: rewrite the files that hold updated or deleted keys, write new files
for new keys, and commit the removes and adds with the app transaction in one Delta commit.

What delta-rs' MERGE does for the sink, without its join: the batch's rows are grouped by
partition (the index put them there), each touched partition's files are probed on their key
columns alone for the updated and deleted keys (the index found no row of an insert's key),
and only files with a row that changes are read whole and rewritten. Files this process wrote
lately are read from memory instead (`file_cache`). A stored
row changes exactly when the MERGE's clauses would change it (`merge.py`): the incoming row is
newer by ordering (or equal, when incoming wins ties); a delete removes it, an update replaces
it (partial updates keep stored values where theirs are null). Rows of keys no file holds are
inserted, deletes of them dropped.

A commit checks almost nothing (docs: "The copy-on-write commit and delta-rs"), so
`check_actions` does before the sink's log commit; tables with features a hand-written file
would break stay on MERGE (`features.merge_only_reason`), but for the row checks the batch
made itself (`features.row_checks`).
"""

from __future__ import annotations

import json
import os
import re
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import NamedTuple
from urllib.parse import quote, unquote

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq
from deltalake import CommitProperties, DeltaTable
from deltalake.transaction import AddAction
from pyroaring import BitMap64

from sink import keys
from sink.errors import CommitCheckError
from sink.lakehouse import deletion_vectors, file_cache, identity, log_commit
from sink.lakehouse.column_mapping import ColumnMapping
from sink.lakehouse.deletion_vectors import Descriptor
from sink.lakehouse.file_layout import DEFAULT_LAYOUT, FileLayout
from sink.lakehouse.key_locator import KeyLocator, MergedKeys
from sink.lakehouse.live_vectors import LiveDeletionVectors
from sink.lakehouse.log import filesystem
from sink.lakehouse.paths import file_location
from sink.lakehouse.stats import stats_json
from sink.lakehouse.writes import (
    DELETE,
    INSERT,
    PARTIAL_COLUMN,
    UPDATE,
    WRITE_COLUMN,
    Writes,
    changing,
    conform,
    partition_string,
)
from sink.ordering import arrow_greater
from sink.partial import has_unchanged, keep_unchanged

# The change data feed (PROTOCOL.md "Change Data Files"): where its files go, their column
# naming each row's change, and its values.
CHANGE_DATA_FOLDER = "_change_data"
CHANGE_TYPE_COLUMN = "_change_type"
CHANGE_INSERT, CHANGE_DELETE = "insert", "delete"
UPDATE_PREIMAGE, UPDATE_POSTIMAGE = "update_preimage", "update_postimage"
# Partition values written as a Hive-style folder name as they are; others (and nulls) as
# Delta's conventions would escape them, which delta-rs would escape once more in the log:
# such files go to the table's root, their values only in the log (readers take them there).
_PLAIN_VALUE = re.compile(r"[A-Za-z0-9_.\-]+")


@dataclass(frozen=True)
class StoredFile:
    """One file of the snapshot the batch reads (its `add` action)."""

    path: str  # as the log spells it (URL-encoded)
    size: int
    partition_values: dict[str, str | None]
    deletion_vector: Descriptor | None = None  # the rows of the file the table no longer holds
    # Kept on the actions that name it again: a marked file's `add`, its `remove` (as Spark's).
    modification_time: int | None = None
    num_records: int | None = None  # its physical rows, by its statistics
    tags: dict[str, str] | None = None


@dataclass(frozen=True)
class MarkedFile:
    """A stored file kept with a new deletion vector (merge-on-read): its old one (on the
    `remove` the commit pairs with it) and more rows."""

    stored: StoredFile
    deletion_vector: Descriptor
    stats: str  # `numRecords` the physical rows, bounds not tight (rows are hidden)


@dataclass(frozen=True)
class ChangeFile:
    """A change data file the batch wrote (its `cdc` action)."""

    path: str  # relative to the table's root, not encoded
    size: int
    partition_values: dict[str, str | None]


@dataclass(frozen=True)
class WrittenFile:
    action: AddAction
    schema: pa.Schema  # as written (checked against the table's before the commit)


@dataclass(frozen=True)
class Rewrite:
    """The actions of one batch's rewrite, and how many of its updates were no-ops (the stored
    row already held exactly the update's values: a re-delivery)."""

    adds: list[WrittenFile]
    removes: list[StoredFile]
    unchanged: int = 0
    marked: list[MarkedFile] = field(default_factory=list)  # each also in `removes`, with its old vector
    changes: list[ChangeFile] = field(default_factory=list)  # the change data feed's files
    # Per writer of its new rows (the thread pool, each Spark task), per identity column the
    # value furthest along its step it handed out: the commit raises the high-water marks.
    identity_highs: list[dict[str, int]] = field(default_factory=list)
    # The table's rows it inserts, updates (not counting `unchanged`) and deletes; a key moving
    # partition (scope "global") counts as a delete and an insert.
    row_changes: dict[str, int] = field(default_factory=dict)

    @property
    def empty(self) -> bool:
        return not (self.adds or self.removes)

    @property
    def partitions_rewritten(self) -> int:
        """Partitions whose files it replaces."""
        return len({tuple(sorted(f.partition_values.items())) for f in self.removes})


def commit(table: DeltaTable, uri: str, writes: Writes, snapshot: Mapping[str, list[StoredFile]], *,
           vectors: LiveDeletionVectors | None = None) -> Rewrite:
    """Rewrite and commit on the version `table` has loaded, whose files are `snapshot` (or
    fail: no retries); returns what it committed. Commits nothing when no row changes (the
    caller records the batch). `vectors`: see `commit_rewrite`."""
    rewrite = rewrite_files(uri, snapshot, writes)
    commit_rewrite(table, uri, rewrite, snapshot, writes.schema, writes.partition_by, writes.props, vectors=vectors)
    return rewrite


def commit_rewrite(table: DeltaTable, uri: str, rewrite: Rewrite, snapshot: Mapping[str, list[StoredFile]],
                   schema: pa.Schema, partition_by: Sequence[str], props: CommitProperties, *,
                   vectors: LiveDeletionVectors | None = None) -> int:
    """Check the files written (here or by Spark tasks) against `snapshot` (the files of the
    version `table` has loaded) and commit them with `props` in one transaction; returns the
    number of files rewritten. Commits nothing when `rewrite` is empty. The table's live
    deletion vectors (`vectors`) move over a commit written here without reading it back."""
    if rewrite.empty:
        return 0
    mapping = ColumnMapping.of(table)
    check_actions(uri, rewrite, snapshot, schema, partition_by, mapping)
    # The sink's own commit, as Spark's MERGE writes one (deletion vectors, change files,
    # partition values by physical name under column mapping, identity high-water marks in
    # the same commit, a remove's stats and a marked file's modification time kept, metrics
    # as Spark names them): delta-rs' create_write_transaction writes none of these.
    raised = [identity.metadata_action(table, rewrite.identity_highs)] if rewrite.identity_highs else []
    actions = [*raised, *log_actions(rewrite, mapping)]
    version = log_commit.commit(table, uri, actions, props, **operation_of(rewrite),
                                tags={identity.SCHEMA_UPDATE_TAG: "true"} if raised else None)
    if vectors is not None:
        vectors.advance(version, actions)
    return len(rewrite.removes)


def log_actions(rewrite: Rewrite, mapping: ColumnMapping | None = None) -> list[dict]:
    """The rewrite's actions as the log spells them: a `remove` of each replaced or marked file
    (with the deletion vector it had), an `add` of each marked file with its new one, and of
    each new file, a `cdc` of each change file; partition values keyed by physical name
    under a column `mapping`."""
    now = int(time.time() * 1000)

    def keyed(values: Mapping[str, str | None]) -> dict[str, str | None]:
        return mapping.partition_values(values) if mapping is not None else dict(values)

    actions = []
    for f in rewrite.removes:
        remove = {"path": f.path, "deletionTimestamp": now, "dataChange": True, "extendedFileMetadata": True,
                  "partitionValues": keyed(f.partition_values), "size": f.size}
        if f.num_records is not None:
            remove["stats"] = json.dumps({"numRecords": f.num_records}, separators=(",", ":"))
        if f.tags:
            remove["tags"] = f.tags
        if f.deletion_vector is not None:
            remove["deletionVector"] = f.deletion_vector.to_json()
        actions.append({"remove": remove})
    for m in rewrite.marked:
        add = {"path": m.stored.path, "partitionValues": keyed(m.stored.partition_values), "size": m.stored.size,
               "modificationTime": m.stored.modification_time or now, "dataChange": True, "stats": m.stats,
               "deletionVector": m.deletion_vector.to_json()}
        if m.stored.tags:
            add["tags"] = m.stored.tags
        actions.append({"add": add})
    for w in rewrite.adds:
        a = w.action
        actions.append({"add": {"path": quote(a.path, safe="/="), "partitionValues": keyed(a.partition_values),
                                "size": a.size, "modificationTime": a.modification_time, "dataChange": True,
                                "stats": a.stats}})
    for c in rewrite.changes:
        actions.append({"cdc": {"path": quote(c.path, safe="/="), "partitionValues": keyed(c.partition_values),
                                "size": c.size, "dataChange": False}})
    return actions


def operation_of(rewrite: Rewrite) -> dict:
    """The commit's operation, its parameters and its metrics, as Spark names them: new rows
    alone (an identity table's append, a table with random file prefixes) read as the WRITE
    they are, anything else as a MERGE."""
    if not rewrite.removes:
        return {"operation": "WRITE", "parameters": {"mode": "Append"},
                "metrics": {"numFiles": len(rewrite.adds), "numOutputRows": _rows_written(rewrite),
                            "numOutputBytes": sum(w.action.size for w in rewrite.adds)}}
    path = "merge-on-read" if rewrite.marked else "copy-on-write"
    return {"operation": "MERGE", "parameters": {"predicate": "[]", "commitPath": path},
            "metrics": log_metrics(rewrite)}


def log_metrics(rewrite: Rewrite) -> dict[str, int]:
    """The commit's metrics, named as Spark's MERGE names them."""
    updated = sum(m.stored.deletion_vector is not None for m in rewrite.marked)
    rows = {f"numTargetRows{name}": rewrite.row_changes[change]
            for change, name in ((INSERT, "Inserted"), (UPDATE, "Updated"), (DELETE, "Deleted"))
            if change in rewrite.row_changes}
    return {**rows, "numTargetFilesAdded": len(rewrite.adds),
            "numTargetFilesRemoved": len(rewrite.removes) - len(rewrite.marked),
            "numTargetDeletionVectorsAdded": len(rewrite.marked),
            "numTargetDeletionVectorsUpdated": updated,
            "numTargetDeletionVectorsRemoved": sum(f.deletion_vector is not None for f in rewrite.removes),
            "numTargetChangeFilesAdded": len(rewrite.changes),
            "numOutputRows": _rows_written(rewrite)}


def _rows_written(rewrite: Rewrite) -> int:
    return sum(json.loads(w.action.stats)["numRecords"] for w in rewrite.adds)


def stored_files(table: DeltaTable, partition_by: Sequence[str], vectors: Mapping[str, Descriptor] | None = None,
                 tags: Mapping[str, dict[str, str]] | None = None) -> dict[str, list[StoredFile]]:
    """The snapshot's files by partition id; `vectors`, `tags`: the deletion vectors and tags
    its files carry, by decoded path (sink.lakehouse.live_vectors)."""
    actions = pa.table(table.get_add_actions(flatten=False))
    values = actions.column("partition").to_pylist() if partition_by else [{}] * actions.num_rows
    vectors, tags = vectors or {}, tags or {}
    out: dict[str, list[StoredFile]] = {}
    pids: dict[tuple[str | None, ...], str] = {}  # a partition's files are many: its id is named once
    columns = [actions.column(c).to_pylist() for c in ("path", "size_bytes", "modification_time", "num_records")]
    for (path, size, modified, records), typed in zip(zip(*columns), values):
        strings = {c: partition_string(typed[c]) for c in partition_by}
        named = tuple(strings.values())
        pid = pids.get(named) or pids.setdefault(named, keys.partition_id(partition_by, named))
        decoded = unquote(path)
        out.setdefault(pid, []).append(StoredFile(path, size, strings, vectors.get(decoded), modified, records,
                                                  tags.get(decoded)))
    return out


def summed_changes(parts: Iterable[Mapping[str, int]]) -> dict[str, int]:
    """Row counts (`Rewrite.row_changes`) of several partitions or writing tasks, summed."""
    total: dict[str, int] = {}
    for part in parts:
        for change, n in part.items():
            total[change] = total.get(change, 0) + n
    return total


def rewrite_files(uri: str, snapshot: Mapping[str, list[StoredFile]], writes: Writes) -> Rewrite:
    """Write the batch's files in three steps: each partition's files are probed for its
    updated and deleted keys, in threads (pyarrow's reads and kernels release the GIL); what
    the batch changes in all the files found is decided in one pass (`file_changes`), whose
    cost follows the batch's changed rows, not a round of small kernels per partition; then
    each partition's files are written, in threads."""
    encoded = pc.dictionary_encode(writes.partition_ids())
    names = encoded.dictionary.to_pylist()
    group = encoded.indices.to_numpy(zero_copy_only=False)
    order = np.argsort(group, kind="stable")
    bounds = np.concatenate([[0], np.cumsum(np.bincount(group, minlength=len(names)))])
    rows = writes.rows.take(pa.array(order))
    updating = changing(rows).to_numpy(zero_copy_only=False)
    # Files are probed for the updated and deleted keys only: the index found no stored row
    # for an insert (as the append path trusts it), and most of a partition's writes are
    # inserts (today's partition: ~10x its updates), each of which would be hashed again per
    # file probed. Partition i's are changes[starts[i]:starts[i + 1]].
    changes = rows.filter(pa.array(updating))
    starts = np.concatenate([[0], np.cumsum(updating)])[bounds]
    key_cols = file_key_columns(writes.key_cols, writes.partition_by)
    incoming_keys = row_keys(conform(changes, pa.schema([writes.schema.field(c) for c in key_cols])), key_cols)
    groups = [rows.slice(bounds[i], bounds[i + 1] - bounds[i]) for i in range(len(names))]
    values = [{c: partition_string(g.column(c)[0].as_py()) for c in writes.partition_by} for g in groups]
    fs, root = filesystem(uri)

    def probe(i: int) -> tuple[list[FoundFile], ExitStack]:
        if starts[i] == starts[i + 1]:
            return [], ExitStack()
        with ExitStack() as stack:
            found = matching_files(fs, root, snapshot.get(names[i], []),
                                   incoming_keys.slice(starts[i], starts[i + 1] - starts[i]), key_cols, values[i],
                                   writes.schema, writes.column_mapping, writes.ordering, stack=stack)
            return found, stack.pop_all()

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        probes = list(pool.map(probe, range(len(names))))
        try:
            decided = file_changes([(stored, Hits(hits.rows, hits.incoming + starts[i]))
                                    for i, (found, _) in enumerate(probes) for _, stored, hits, _ in found],
                                   changes, writes, pool=pool)
            ends = np.cumsum([len(found) for found, _ in probes])
            per_partition = [decided[end - len(found):end] for end, (found, _) in zip(ends, probes)]

            def write(i: int) -> tuple[Rewrite, list[Mark]]:
                return rewrite_partition(fs, root, groups[i], values[i], probes[i][0], per_partition[i],
                                         np.flatnonzero(updating[bounds[i]:bounds[i + 1]]), writes)

            done = list(pool.map(write, range(len(names))))
        finally:  # what the probes read is held for the next batch (`StoredRows.hold`)
            list(pool.map(lambda p: p[1].close(), probes))
    if not writes.merge_on_read:  # the files replaced: their rows live on in the new files
        for r, _ in done:
            for f in r.removes:
                for cache in (file_cache.WRITTEN, file_cache.PROBED):
                    cache.discard(file_location(root, f.path))
    marks = [m for _, partition_marks in done for m in partition_marks]
    return Rewrite([a for r, _ in done for a in r.adds], [f for r, _ in done for f in r.removes],
                   sum(r.unchanged for r, _ in done),
                   _store_marks(fs, root, marks, writes.column_mapping, writes.layout),
                   [c for r, _ in done for c in r.changes],
                   [writes.identity.high()] if writes.identity and writes.identity.high() else [],
                   summed_changes(r.row_changes for r, _ in done))


def rewrite_partition(fs: pafs.FileSystem, root: str, rows: pa.Table, values: Mapping[str, str | None],
                      found: Sequence[FoundFile], decided: Sequence[FileChange], probed: np.ndarray,
                      writes: Writes) -> tuple[Rewrite, list[Mark]]:
    """The writes `rows` of one partition (its partition `values`), whose files `found` hold
    keys of its updates and deletes (at `probed` among `rows`), what they change in each
    (`decided`): the rewritten files and new keys written, the files they replace,
    (merge-on-read) the files whose rows it marks deleted, and (a change data feed) its change
    file."""
    done = _partition_tables(rows, found, decided, probed, writes)
    data_schema = pa.schema([f for f in writes.schema if f.name not in writes.partition_by])
    mapping = writes.column_mapping
    changes = [] if done.changes is None else [write_change_file(fs, root, done.changes, values, data_schema,
                                                                 mapping)]
    probe = ProbeColumns(file_key_columns(writes.key_cols, writes.partition_by), writes.ordering)
    return Rewrite(write_partition_files(fs, root, done.outputs, values, data_schema, mapping,
                                         probe=probe if writes.merge_on_read else None, layout=writes.layout),
                   done.removed, done.unchanged, changes=changes, row_changes=done.row_changes), done.marks


@dataclass(frozen=True)
class PartitionWrites:
    """What one partition's writes come to, before any file is written."""

    outputs: list[pa.Table]  # the data files to write
    removed: list[StoredFile]  # the files they replace, or whose rows are marked
    unchanged: int
    marks: list[Mark]  # merge-on-read
    changes: pa.Table | None  # the change data feed's rows (CHANGE_TYPE_COLUMN), when the table has one
    row_changes: dict[str, int]  # the table's rows it inserts, updates and deletes


@dataclass(frozen=True)
class Mark:
    """Merge-on-read: a stored file's rows to delete from now on, old deletion vector included."""

    stored: StoredFile
    rows: BitMap64
    physical_rows: int
    metadata: pq.FileMetaData | None = None  # its Parquet footer, when the probe read it


def _store_marks(fs: pafs.FileSystem, root: str, marks: Sequence[Mark], mapping: ColumnMapping | None,
                 layout: FileLayout) -> list[MarkedFile]:
    """Write the marks' deletion vectors (one file for all of them) and pair them with their
    files; a file whose every row is deleted is only removed (its remove is already listed)."""
    kept = []
    for m in marks:
        if len(m.rows) < m.physical_rows:
            kept.append(m)
        else:  # no snapshot after this batch's names it
            file_cache.PROBED.discard(file_location(root, m.stored.path))
    if not kept:
        return []
    descriptors = deletion_vectors.write_file(fs, root, [m.rows for m in kept])
    out = []
    for m, d in zip(kept, descriptors):
        location = file_location(root, m.stored.path)
        held = file_cache.PROBED.get(location)
        if held is not None:
            held.deleted = (d, m.rows)
        out.append(MarkedFile(m.stored, d, _wide_stats(fs, location, m, held, mapping, layout)))
    return out


def _wide_stats(fs: pafs.FileSystem, location: str, mark: Mark, held: file_cache.ProbedColumns | None,
                mapping: ColumnMapping | None, layout: FileLayout) -> str:
    """A marked file's stats: its physical row count, its footer's bounds, not tight (the
    protocol's requirement for a file with a deletion vector, and what Spark writes); under a
    column `mapping`, of the table's columns alone, keyed by physical name. Kept with the
    file's probe entry (`held`): a file merge-on-read leaves in place is marked again by most
    batches, and its footer does not change."""
    columns = (None if mapping is None else tuple(mapping.physical.items()), layout)
    if held is not None and columns in held.marked_stats:
        return held.marked_stats[columns]
    metadata = mark.metadata or pq.read_metadata(location, filesystem=fs)
    schema = metadata.schema.to_arrow_schema()
    skip = mark.stored.partition_values
    if mapping is not None:
        in_file = mapping.file_columns(schema)
        schema = pa.schema([schema.field(in_file[c]).with_name(mapping.physical[c]) for c in in_file])
        skip = mapping.partition_values(skip)
    stats = json.loads(stats_json(metadata, schema, skip=skip, layout=layout))
    text = json.dumps({**stats, "numRecords": mark.physical_rows, "tightBounds": False})
    if held is not None:
        held.marked_stats[columns] = text
    return text


def _partition_tables(rows: pa.Table, found: Sequence[FoundFile], decided: Sequence[FileChange], probed: np.ndarray,
                      writes: Writes) -> PartitionWrites:
    """One partition: the tables to write (rewritten files, then new keys), the files they
    replace, the no-op updates, (merge-on-read) the files whose rows are marked deleted
    instead, their new row versions written with the new keys, and (`writes.change_data`) the
    rows of its change data feed."""
    matched = np.zeros(rows.num_rows, bool)
    outputs: list[pa.Table] = []
    removed: list[StoredFile] = []
    marks: list[Mark] = []
    change_rows: list[tuple[str, pa.Table]] = []
    unchanged = updated = deleted_rows = 0
    for (f, stored, hits, deleted), change in zip(found, decided):
        matched[probed[hits.incoming]] = True
        unchanged += change.unchanged
        if not len(change.gone):
            continue
        updated += change.replaced.num_rows
        deleted_rows += len(change.deleted)
        removed.append(f)
        if writes.change_data:
            change_rows.extend(change.change_rows(stored))
        if writes.merge_on_read:
            marks.append(Mark(f, deleted | BitMap64(change.gone.tolist()), stored.num_rows, stored.metadata))
            outputs.append(change.replaced)
        else:
            kept = np.ones(stored.num_rows, bool)
            kept[change.gone] = False
            outputs.append(pa.concat_tables([stored.read().filter(pa.array(kept)), change.replaced]))
    # New keys, and updates of keys no file holds, are new rows (the MERGE inserts them too).
    new_keys = pc.and_(pa.array(~matched), pc.not_equal(rows.column(WRITE_COLUMN), DELETE))
    inserts = conform(rows.filter(new_keys), writes.schema) if pc.any(new_keys).as_py() else None
    if inserts is not None and writes.identity is not None:
        inserts = writes.identity.fill(inserts)
    if inserts is not None and writes.change_data:
        change_rows.append((CHANGE_INSERT, inserts))
    if writes.merge_on_read:  # the new row versions and the new keys: one new file
        outputs = [t for t in outputs if t.num_rows] + ([inserts] if inserts is not None else [])
        outputs = [pa.concat_tables(outputs)] if outputs else []
    elif inserts is not None:
        outputs = with_inserts(outputs, inserts)
    # Every partition's changes, new keys too: a reader takes a version's changes from its
    # change files alone once it has any (PROTOCOL.md "Change Data Files").
    feed = _change_table(change_rows) if change_rows else None
    counts = {INSERT: inserts.num_rows if inserts is not None else 0, UPDATE: updated, DELETE: deleted_rows}
    return PartitionWrites(outputs, removed, unchanged, marks, feed, counts)


def _change_table(parts: Sequence[tuple[str, pa.Table]]) -> pa.Table:
    """The change data feed's rows: each part's rows with their change type."""
    return pa.concat_tables([t.append_column(CHANGE_TYPE_COLUMN, pa.repeat(pa.scalar(kind, pa.string()), t.num_rows))
                             for kind, t in parts])


def file_key_columns(key_cols: Sequence[str], partition_by: Sequence[str]) -> list[str]:
    """The key columns that tell one partition's rows apart, which its data files hold: a key
    column that is a partition column is the partition's value, kept in the log, not the files."""
    return [c for c in key_cols if c not in partition_by]


@dataclass(frozen=True)
class Hits:
    """A data file's rows holding a key the batch changes: their positions in the file,
    ascending, and each one's position among the batch's keys."""

    rows: np.ndarray
    incoming: np.ndarray

    @classmethod
    def of_each(cls, at: pa.Array | pa.ChunkedArray, sizes: Sequence[int]) -> list[Hits]:
        """Each file's, from `pc.index_in(file keys, value_set=batch keys)` over the keys of files
        of `sizes` rows, one after the other: per row, null or a position among the batch's."""
        valid = pc.is_valid(at)
        rows = np.flatnonzero(valid.to_numpy(zero_copy_only=False))
        incoming = pc.filter(at, valid).to_numpy(zero_copy_only=False).astype(np.int64)
        starts = np.concatenate([[0], np.cumsum(sizes)])
        ends = np.searchsorted(rows, starts)
        return [cls(rows[ends[i]:ends[i + 1]] - starts[i], incoming[ends[i]:ends[i + 1]]) for i in range(len(sizes))]

    def in_file(self, rows: np.ndarray) -> Hits:
        """Hits found at positions of a file's sorted keys, at the file's `rows` they sort from."""
        at = rows[self.rows]
        order = np.argsort(at, kind="stable")
        return Hits(at[order], self.incoming[order])

    def live(self, deleted: BitMap64) -> Hits:
        """Without the rows a deletion vector deletes: they are not the table's."""
        gone = deletion_vectors.positions(deleted)  # ascending, as `rows`
        at = np.minimum(np.searchsorted(gone, self.rows), max(len(gone) - 1, 0))
        kept = gone[at] != self.rows if len(gone) else np.ones(len(self.rows), bool)
        return Hits(self.rows[kept], self.incoming[kept])

    def mask(self, num_rows: int) -> np.ndarray:
        """Per row of the file: hit."""
        out = np.zeros(num_rows, bool)
        out[self.rows] = True
        return out


def _deleted_rows(fs: pafs.FileSystem, root: str, descriptor: Descriptor,
                  held: file_cache.ProbedColumns | None) -> BitMap64:
    """The rows a file's deletion vector deletes: from its probe entry when that holds this
    vector (merge-on-read re-marks most files it probes every batch, and holds the vector it
    wrote), else read (and then held)."""
    if held is not None and held.deleted is not None and held.deleted[0] == descriptor:
        return held.deleted[1]
    rows = deletion_vectors.read(fs, root, descriptor)
    if held is not None:
        held.deleted = (descriptor, rows)
    return rows


class FoundFile(NamedTuple):
    """A stored file holding a key the batch changes (`matching_files`)."""

    file: StoredFile
    stored: StoredRows
    hits: Hits
    deleted: BitMap64  # the rows its deletion vector deletes


def matching_files(fs: pafs.FileSystem, root: str, files: Sequence[StoredFile], incoming_keys: pa.Array,
                   key_cols: Sequence[str], values: Mapping[str, str | None], schema: pa.Schema,
                   mapping: ColumnMapping | None = None, ordering: Sequence[str] = (), *, stack: ExitStack
                   ) -> list[FoundFile]:
    """Of one partition's `files` (its partition `values`), those holding a row of
    `incoming_keys` (`row_keys`): each with its rows (`StoredRows`, every physical row), its
    rows holding one of those keys (`Hits`; not the rows its deletion vector deletes, which
    are not the table's), and the rows its deletion vector deletes. Each file is probed on its
    key columns alone; its other columns are read as the caller needs them. A file read from
    Parquet has its key and `ordering` columns held (`file_cache.PROBED`) once `stack`
    closes, so probing it again reads nothing."""
    found = []
    locations = [file_location(root, f.path) for f in files]
    stored_rows = [_stored_rows(fs, location, schema, values, mapping) for location in locations]
    merged_at = merged_keys_at(root, values, key_cols)
    held = file_cache.PROBED.get(merged_at)
    merged = held if isinstance(held, MergedKeys) else None
    # Callbacks run last first: the files' keys are held before they are merged.
    stack.callback(_hold_merged_keys, merged_at, locations)
    for location, stored in zip(locations, stored_rows):  # once the caller read the orderings it needs
        stack.callback(stored.hold, key_cols, ordering, keys_merged=merged is not None and location in merged.files)
    for f, stored, hits in zip(files, stored_rows, _hits(stored_rows, key_cols, incoming_keys, locations, merged)):
        if not len(hits.rows):
            continue
        deleted = BitMap64()
        if f.deletion_vector is not None:  # read only for a file the probe matched: most match nothing
            deleted = _deleted_rows(fs, root, f.deletion_vector, stored.held)
            hits = hits.live(deleted)
            if not len(hits.rows):
                continue
        found.append(FoundFile(f, stored, hits, deleted))
    return found


# A file of fewer rows has its keys hashed with the partition's other small files' in one
# `pc.index_in` rather than searched (`KeyLocator.find`): a search costs about what hashing
# this many keys does (0.3 ms, measured), and merge-on-read adds a small file to a partition
# each batch. Its keys are held as they are, never sorted.
_SEARCHED_ROWS = 16_384
# A partition with this many searched files outside its merged keys has them merged in: a
# search costs 0.2-0.3 ms whatever the keys' count (measured: 0.20 ms in a file of 33k string
# keys, 0.26 ms in five such files merged), and sorting a partition's keys again costs
# 15-35 ms at 167k string keys, 50-130 searches (a merge of the sorted runs is no faster:
# searching 33k string keys in 133k costs 12 ms).
_MERGED_FILES = 4


def merged_keys_at(root: str, values: Mapping[str, str | None], key_cols: Sequence[str]) -> str:
    """Where `file_cache.PROBED` holds the merged keys (`MergedKeys`) of a table's partition."""
    return f"{root}#{json.dumps(values, sort_keys=True)}#{json.dumps(list(key_cols))}"


def _hold_merged_keys(at: str, locations: Sequence[str]) -> None:
    """Merge the sorted keys of a partition's searched files (at `locations`, its files now;
    `merged_keys_at`) once `_MERGED_FILES` of them are searched apart, and keep the merged
    keys to the files still in the table. A file merged has its own sorted keys dropped: the
    probe cache holds each key once."""
    held = file_cache.PROBED.get(at)
    merged = held if isinstance(held, MergedKeys) else None
    if merged is not None and not set(merged.files).issubset(locations):
        merged = merged.keeping(set(locations))
    apart = []
    for location in locations:
        entry = file_cache.PROBED.get(location)
        if (isinstance(entry, file_cache.ProbedColumns) and entry.locator is not None
                and entry.locator.num_rows >= _SEARCHED_ROWS and (merged is None or location not in merged.files)):
            apart.append((location, entry))
    if len(apart) >= _MERGED_FILES:
        runs = [(location, e.locator.sorted_keys, e.locator.rows) for location, e in apart]
        merged = merged.adding(runs) if merged is not None else MergedKeys.of(runs)
        for location, e in apart:
            file_cache.PROBED.put(location, e.replaced(e.columns, None))
    if merged is None:
        file_cache.PROBED.discard(at)
    elif merged is not held:
        file_cache.PROBED.put(at, merged)


def _hits(stored: Sequence[StoredRows], key_cols: Sequence[str], incoming_keys: pa.Array, locations: Sequence[str],
          merged: MergedKeys | None) -> list[Hits]:
    """Each file's (at `locations`) rows whose key (`row_keys` of `key_cols`) is one of
    `incoming_keys`: by one search of the partition's `merged` keys for the files they hold, a
    large file's own sorted keys where held, the others' by one `pc.index_in` over all their
    keys."""
    out: list[Hits | None] = [None] * len(stored)
    if merged is not None:
        member = {f: i for i, f in enumerate(merged.files)}
        members = [(i, member[f]) for i, f in enumerate(locations) if f in member]
        if members:
            found = merged.find(incoming_keys)
            for i, m in members:
                out[i] = Hits(*found[m])
    hashed = []
    for i, s in enumerate(stored):
        if out[i] is not None:
            continue
        if s.locator is not None and s.locator.num_rows >= _SEARCHED_ROWS:
            out[i] = Hits(*s.locator.find(incoming_keys))
        else:
            hashed.append(i)
    if hashed:
        file_keys = [stored[i].keys(key_cols) if stored[i].locator is None else stored[i].locator.sorted_keys
                     for i in hashed]
        at = pc.index_in(pa.chunked_array(file_keys, type=incoming_keys.type), value_set=incoming_keys)
        for i, hits in zip(hashed, Hits.of_each(at, [len(k) for k in file_keys])):
            out[i] = hits if stored[i].locator is None else hits.in_file(stored[i].locator.rows)
    return out


class StoredRows:
    """One data file's rows in the table's `schema`, read column by column as they are needed
    (a merge-on-read batch needs a file's keys and orderings, not the rest of its bytes), each
    column once; partition columns take the log's `values` (delta-rs' files do not hold them,
    Delta's Spark engine writes them too). `source` is the file's Parquet, or its rows as this
    process wrote them (`file_cache`); under a column `mapping` its columns are read by their
    names in the file (physical names, or field ids: a rename since changes neither)."""

    def __init__(self, source: pq.ParquetFile | pa.Table | HeldParquet, schema: pa.Schema,
                 values: Mapping[str, str | None], mapping: ColumnMapping | None):
        in_file = source.schema if isinstance(source, pa.Table) else source.schema_arrow
        self._source = source
        self._names = {c: c for c in in_file.names} if mapping is None else mapping.file_columns(in_file)
        self._schema = schema
        self._values = values
        self._columns: dict[str, pa.ChunkedArray] = {}
        self.num_rows = source.num_rows if isinstance(source, pa.Table) else source.metadata.num_rows
        # A marked file's stats are its footer's (`_wide_stats`): read once.
        self.metadata = None if isinstance(source, pa.Table) else source.metadata

    def read(self, columns: Sequence[str] | None = None, rows: np.ndarray | None = None) -> pa.Table:
        """The table's `columns` (None: all of them), every physical row or those at `rows`."""
        columns = self._schema.names if columns is None else list(columns)
        self.fetch(columns)
        return pa.table([self._column(self._schema.field(c), rows) for c in columns],
                        schema=pa.schema([self._schema.field(c) for c in columns]))

    def fetch(self, columns: Sequence[str]) -> None:
        """Have the table's `columns` in memory, read once."""
        missing = self._missing(columns)
        if missing:
            self._columns.update(zip(missing, self._fetch([self._names[c] for c in missing])))

    def reads_parquet(self, columns: Sequence[str]) -> bool:
        """Whether reading the table's `columns` takes a read of its Parquet."""
        held = self.held
        return isinstance(self._source, HeldParquet) and not (
            held is not None and all(self._names[c] in held.columns for c in self._missing(columns)))

    def _missing(self, columns: Sequence[str]) -> list[str]:
        """Of `columns`, those the file holds that are not read yet."""
        return [c for c in columns if c not in self._values and c in self._names and c not in self._columns]

    @property
    def held(self) -> file_cache.ProbedColumns | None:
        """Its probe entry, when held (`hold`)."""
        return self._source.held if isinstance(self._source, HeldParquet) else None

    @property
    def locator(self) -> KeyLocator | None:
        """Its keys sorted, when held."""
        return self.held.locator if self.held is not None else None

    def values(self, name: str) -> np.ndarray | None:
        """Column `name` as read (`fetch`), as a numpy view on its buffer, when it is one chunk
        of the table's fixed-width type without nulls."""
        column = self._columns.get(name)
        kind = self._schema.field(name).type
        if (column is None or column.num_chunks != 1 or column.type != kind or column.null_count
                or not pa.types.is_primitive(kind) or pa.types.is_boolean(kind)):
            return None
        return column.chunk(0).to_numpy()

    def keys(self, key_cols: Sequence[str]) -> pa.Array:
        """Its rows' keys (`row_keys` of `key_cols`, none a partition column): as its probe entry
        holds them, when in the table's types (a small file's, hashed every batch)."""
        held = self.held.columns if self.held is not None else {}
        columns = [held.get(self._names.get(c, "")) for c in key_cols]
        if all(c is not None and c.type == self._schema.field(k).type for c, k in zip(columns, key_cols)):
            return row_keys(pa.Table.from_arrays(columns, names=list(key_cols)), key_cols)
        return row_keys(self.read(key_cols), key_cols)

    def hold(self, key_cols: Sequence[str], ordering: Sequence[str], *, keys_merged: bool = False) -> None:
        """Keep what probing the file again takes in `file_cache.PROBED`, when it was read from
        Parquet: its `ordering` columns (as far as read) and its keys, the second time sorted
        (`KeyLocator`: a file probed twice is likely probed by every batch) when it is searched
        (`_SEARCHED_ROWS`), unless they are held with its partition's (`keys_merged`)."""
        if not isinstance(self._source, HeldParquet):
            return
        held = self._source.held
        columns = dict(held.columns) if held is not None else {}
        locator = held.locator if held is not None else None
        names = [self._names[c] for c in key_cols]
        if (locator is None and held is not None and self.num_rows >= _SEARCHED_ROWS and not keys_merged
                and all(n in columns for n in names)):
            locator = KeyLocator.of(row_keys(self.read(key_cols), key_cols))
        keyed = locator is not None or keys_merged
        added = {self._names[c]: _one_chunk(self._columns[c]) for c in [*key_cols, *ordering]
                 if c in self._columns and self._names[c] not in columns and not (keyed and c in key_cols)}
        if held is not None and locator is held.locator and not added:
            return
        columns = {n: c for n, c in {**columns, **added}.items() if locator is None or n not in names}
        file_cache.PROBED.put(self._source.location, held.replaced(columns, locator) if held is not None else
                              file_cache.ProbedColumns(self._source.schema_arrow, self.metadata, columns, locator))

    def _fetch(self, names: list[str]) -> list[pa.ChunkedArray]:
        if isinstance(self._source, pa.Table):
            return self._source.select(names).columns
        # One thread per file: the caller already reads a file per core (its thread pool, or
        # one Spark task per core); Arrow's reader threads on top of it cost the rewrite of
        # an events batch at 5M rows a tenth of its wall time (measured).
        return self._source.read(columns=names, use_threads=False).columns

    def _column(self, f: pa.Field, rows: np.ndarray | None) -> pa.Array | pa.ChunkedArray:
        n = self.num_rows if rows is None else len(rows)
        if f.name in self._values:  # one scalar repeated, not a list of n values: 3% of a rewrite
            return pa.repeat(pa.scalar(self._values[f.name], pa.string()), n).cast(f.type)
        if f.name in self._columns:
            column = self._columns[f.name]
            if rows is None:
                return column.cast(f.type)
            # Rows first where the types agree; a file's own type (delta-rs writes string_view,
            # which `take` has no kernel for) is cast whole first.
            return column.take(rows) if column.type == f.type else column.cast(f.type).take(rows)
        return pa.nulls(n, f.type)  # a column added since the file was written


class HeldParquet:
    """A data file's Parquet, read where its probe columns (`file_cache.PROBED`, when held) do
    not hold a column. The file is open only while a read runs (its footer read once): a
    partition's files are decided together (`file_changes`), and a partition of many small
    files must not hold a descriptor for each."""

    def __init__(self, fs: pafs.FileSystem, location: str):
        self.location = location
        self.held = file_cache.PROBED.get(location)
        self._fs = fs
        self._metadata: pq.FileMetaData | None = None if self.held is None else self.held.metadata

    @property
    def schema_arrow(self) -> pa.Schema:
        return self.held.schema if self.held is not None else self.metadata.schema.to_arrow_schema()

    @property
    def metadata(self) -> pq.FileMetaData:
        if self._metadata is None:
            with self._fs.open_input_file(self.location) as stream:
                self._metadata = pq.ParquetFile(stream).metadata
        return self._metadata

    def read(self, columns: Sequence[str], use_threads: bool = False) -> pa.Table:
        held = self.held.columns if self.held is not None else {}
        rest = [c for c in columns if c not in held]
        read = None
        if rest:
            with self._fs.open_input_file(self.location) as stream:
                read = pq.ParquetFile(stream, metadata=self._metadata).read(columns=rest, use_threads=use_threads)
        return pa.table({c: held[c] if c in held else read.column(c) for c in columns})


def _stored_rows(fs: pafs.FileSystem, location: str, schema: pa.Schema, values: Mapping[str, str | None],
                 mapping: ColumnMapping | None) -> StoredRows:
    """The file at `location`: from memory when this process wrote it lately, else its Parquet
    (its probe columns from memory when held)."""
    held = file_cache.WRITTEN.get(location)
    if held is not None:
        return StoredRows(held, schema, values, mapping)
    return StoredRows(HeldParquet(fs, location), schema, values, mapping)


def with_inserts(rewritten: list[pa.Table], inserts: pa.Table) -> list[pa.Table]:
    """The files to write for one partition: its rewritten files and the new keys. The new
    keys join the smallest rewritten file when it holds fewer rows than they are (one small
    file fewer), else get a file of their own: a file that keeps taking each batch's inserts
    grows without bound, and every later update of a key in it rewrites all of it (today's
    partition after 10 batches of the events bench: one 814k-row file rewritten per batch)."""
    if not rewritten:
        return [inserts]
    smallest = min(range(len(rewritten)), key=lambda i: rewritten[i].num_rows)
    if rewritten[smallest].num_rows >= inserts.num_rows:
        return [*rewritten, inserts]
    return [*rewritten[:smallest], pa.concat_tables([rewritten[smallest], inserts]), *rewritten[smallest + 1:]]


@dataclass(frozen=True)
class FileChange:
    """What a batch changes in one stored file."""

    gone: np.ndarray  # the stored rows replaced or deleted, ascending
    replaced: pa.Table  # the new versions of the replaced rows (in the table's schema)
    unchanged: int  # updates that were no-ops: the stored row already held their values
    deleted: np.ndarray  # the rows of `gone` deleted (the others are replaced)

    def change_rows(self, stored: StoredRows) -> list[tuple[str, pa.Table]]:
        """Its rows for the change data feed: pre-images, post-images, deletes."""
        preimages = np.setdiff1d(self.gone, self.deleted, assume_unique=True)
        return [(UPDATE_PREIMAGE, stored.read(None, preimages)), (UPDATE_POSTIMAGE, self.replaced),
                (CHANGE_DELETE, stored.read(None, self.deleted))]


def file_changes(found: Sequence[tuple[StoredRows, Hits]], rows: pa.Table, writes: Writes, *,
                 pool: Executor | None = None) -> list[FileChange]:
    """The batch's `rows` applied to each stored file of `found` (of any partitions), whose
    rows its `Hits` holds keys of `rows`. An update that is a no-op (the stored row already holds
    exactly the new values, e.g. an event delivered again with its ordering) changes nothing
    and rewrites no file. Of the stored rows' other columns, only those the change needs are
    read, and only at the rows hit; the files are decided together, so the cost follows the
    batch's rows, not the files' count or size. The stored columns are read in `pool`'s
    threads, when given and a file's are read from Parquet."""
    none = np.zeros(0, np.int64)
    nothing = [FileChange(none, writes.schema.empty_table(), 0, none)] * len(found)
    if not found:
        return []
    counts = np.array([len(h.rows) for _, h in found])
    bounds = np.concatenate([[0], np.cumsum(counts)])
    incoming = rows.take(pa.array(np.concatenate([h.incoming for _, h in found])))
    _fetch_from_parquet([s for s, _ in found], writes.ordering, pool)
    ordering = _read_at_hits(found, writes.ordering, writes.schema)
    newer = pc.fill_null(_newer([incoming.column(c) for c in writes.ordering],
                                [ordering.column(c) for c in writes.ordering], writes.incoming_wins_ties), False)
    if not pc.any(newer).as_py():
        return nothing
    updated = pc.and_(newer, pc.invert(pc.fill_null(pc.equal(incoming.column(WRITE_COLUMN), DELETE), False)))
    new = incoming.filter(updated)
    is_newer, is_updated = newer.to_numpy(zero_copy_only=False), updated.to_numpy(zero_copy_only=False)
    # An identity column keeps the stored row's value (the stream does not carry it).
    kept = [c.name for c in writes.identity.columns] if writes.identity is not None else []
    # A no-op needs the stored ordering's values, so the stored rows are compared whole only
    # where an ordering ties; partial updates take stored values from the whole row.
    ordering_schema = pa.schema([writes.schema.field(c) for c in writes.ordering])
    ties = _same_rows([new.column(f.name).cast(f.type) for f in ordering_schema], ordering.filter(updated),
                      ordering_schema)
    unchanged = writes.holds_unchanged and has_unchanged(new)  # values the source did not send (unchanged_value)
    whole = writes.partial or unchanged or ties.any()
    old = None
    if whole or kept:
        columns = writes.schema.names if whole else kept
        _fetch_from_parquet([s for s, _ in found], columns, pool)
        old = pa.concat_tables([s.read(columns, h.rows[is_updated[bounds[i]:bounds[i + 1]]])
                                for i, (s, h) in enumerate(found)])
    columns = [old.column(f.name) if f.name in kept else new.column(f.name).cast(f.type) for f in writes.schema]
    if writes.partial:
        partial = pc.fill_null(new.column(PARTIAL_COLUMN), False)
        columns = [pc.if_else(partial, pc.coalesce(c, old.column(f.name)), c) for c, f in zip(columns, writes.schema)]
    if unchanged:
        columns = keep_unchanged(columns, old, writes.schema)
    same = _same_rows(columns, old, writes.schema) if whole else np.zeros(new.num_rows, bool)
    gone = is_newer.copy()  # per hit: replaced or deleted
    gone[np.flatnonzero(is_updated)[same]] = False
    replaced = pa.table(columns, schema=writes.schema).filter(pa.array(~same))
    # Per file: its hits' slice, and its replaced rows' (both in file order).
    file_of_update = np.repeat(np.arange(len(found)), counts)[is_updated]
    replaced_bounds = np.searchsorted(file_of_update[~same], np.arange(len(found) + 1))
    no_ops_per_file = np.bincount(file_of_update[same], minlength=len(found))
    out = []
    for i, (_, h) in enumerate(found):
        part = slice(bounds[i], bounds[i + 1])
        no_ops = int(no_ops_per_file[i])
        if not gone[part].any():
            out.append(FileChange(none, nothing[0].replaced, no_ops, none))
            continue
        out.append(FileChange(h.rows[gone[part]],
                              replaced.slice(replaced_bounds[i], replaced_bounds[i + 1] - replaced_bounds[i]), no_ops,
                              h.rows[(is_newer & ~is_updated)[part]]))
    return out


def _one_chunk(column: pa.ChunkedArray) -> pa.ChunkedArray:
    """A column held for later batches, in one chunk: numpy reads it without a copy
    (`StoredRows.values`)."""
    return column if column.num_chunks == 1 else pa.chunked_array([column.combine_chunks()], column.type)


def _read_at_hits(found: Sequence[tuple[StoredRows, Hits]], columns: Sequence[str], schema: pa.Schema) -> pa.Table:
    """Each file's `columns` (of the table's `schema`) at its hit rows, one file after the
    other: what `StoredRows.read` gives, a fixed-width column without nulls gathered by numpy
    rather than a take per file (a batch hits hundreds of files, a few rows each)."""
    for s, _ in found:
        s.fetch(columns)
    out = []
    for c in columns:
        views = [s.values(c) for s, _ in found]
        if all(v is not None for v in views):
            out.append(pa.array(np.concatenate([v[h.rows] for v, (_, h) in zip(views, found)]), schema.field(c).type))
        else:
            out.append(pa.chunked_array([s.read([c], h.rows).column(0) for s, h in found], schema.field(c).type))
    return pa.table(out, schema=pa.schema([schema.field(c) for c in columns]))


def _fetch_from_parquet(stored: Sequence[StoredRows], columns: Sequence[str], pool: Executor | None) -> None:
    """Read the files' `columns` that only their Parquet holds, in `pool`'s threads when given
    (the rest are in memory: a thread each would only pass the GIL around)."""
    cold = [s for s in stored if s.reads_parquet(columns)]
    if pool is not None and len(cold) > 1:
        list(pool.map(lambda s: s.fetch(columns), cold))


def _same_rows(columns: Sequence[pa.Array], old: pa.Table, schema: pa.Schema) -> np.ndarray:
    """Per row: every column of the new row equals the stored one (nulls equal nulls). A type
    Arrow cannot compare (nested, say) counts as changed, as does NaN: rewriting is safe."""
    same = np.ones(old.num_rows, bool)
    for new, f in zip(columns, schema):
        before = old.column(f.name)
        try:
            equal = pc.fill_null(pc.equal(new, before), False)
        except (pa.ArrowNotImplementedError, pa.ArrowInvalid):
            return np.zeros(old.num_rows, bool)
        both_null = pc.and_(pc.is_null(new), pc.is_null(before))
        same &= pc.or_(equal, both_null).to_numpy(zero_copy_only=False)
    return same


def check_actions(uri: str, rewrite: Rewrite, snapshot: Mapping[str, list[StoredFile]], schema: pa.Schema,
                  partition_by: Sequence[str], mapping: ColumnMapping | None = None) -> None:
    """What no commit checks, checked before committing: every added
    file (data or change file) exists at its size, every removed file is in the snapshot the batch read, partition
    values name exactly the partition columns, files hold the table's columns (physical ones
    under a column `mapping`) and types."""
    fs, root = filesystem(uri)
    expected = set(partition_by)
    data_schema = pa.schema([f for f in schema if f.name not in expected])
    if mapping is not None:
        data_schema = mapping.physical_schema(data_schema)
    for w in rewrite.adds:
        a = w.action
        info = fs.get_file_info(f"{root}/{a.path}")
        if info.type != pafs.FileType.File or info.size != a.size:
            raise CommitCheckError(f"{uri}: file {a.path} to be added is missing or not {a.size} bytes "
                                   f"(found {info.type.name}, {info.size}); nothing was committed")
        if set(a.partition_values) != expected:
            raise CommitCheckError(f"{uri}: file {a.path} names partition columns {sorted(a.partition_values)}, "
                                   f"the table's are {sorted(expected)}; nothing was committed")
        if not w.schema.equals(data_schema):
            raise CommitCheckError(f"{uri}: file {a.path} has columns {w.schema}, the table's are {data_schema}; "
                                   "nothing was committed")
    for c in rewrite.changes:
        info = fs.get_file_info(f"{root}/{c.path}")
        if info.type != pafs.FileType.File or info.size != c.size:
            raise CommitCheckError(f"{uri}: change file {c.path} to be added is missing or not {c.size} bytes "
                                   f"(found {info.type.name}, {info.size}); nothing was committed")
    read = {f.path for files in snapshot.values() for f in files}
    for f in rewrite.removes:
        if f.path not in read or set(f.partition_values) != expected:
            raise CommitCheckError(f"{uri}: file {f.path} to be removed is not a file of the version the batch read; "
                                   "nothing was committed")


@dataclass(frozen=True)
class ProbeColumns:
    """What a later batch probes a file for: its key columns (those the files hold) and its
    ordering columns."""

    key_cols: Sequence[str]
    ordering: Sequence[str]


def write_partition_files(fs: pafs.FileSystem, root: str, tables: Sequence[pa.Table],
                          values: Mapping[str, str | None], data_schema: pa.Schema,
                          mapping: ColumnMapping | None = None, *, probe: ProbeColumns | None = None,
                          layout: FileLayout = DEFAULT_LAYOUT) -> list[WrittenFile]:
    """One partition's new data files, one per table (split where larger than the `layout`'s
    target size): which columns to dictionary-encode is decided once, on the largest (a
    partition's files hold alike values)."""
    if not tables:
        return []
    dictionary = _dictionary_columns(max(tables, key=lambda t: t.num_rows).select(data_schema.names))
    return [write_file(fs, root, piece, values, data_schema, dictionary, mapping, probe=probe, layout=layout)
            for t in tables for piece in layout.split(t)]


def write_file(fs: pafs.FileSystem, root: str, rows: pa.Table, values: Mapping[str, str | None],
               data_schema: pa.Schema, dictionary: Sequence[str], mapping: ColumnMapping | None = None, *,
               probe: ProbeColumns | None = None, layout: FileLayout = DEFAULT_LAYOUT) -> WrittenFile:
    """One new data file (partition columns live in the log, not in the file) and its action;
    `dictionary`: the columns to dictionary-encode (`_dictionary_columns`); under a column
    `mapping` the file and its stats name the columns by physical name. Its rows are held for
    the next batch (`file_cache.WRITTEN`), or, given what it is probed for (`probe`: a
    merge-on-read batch marks rows, it rewrites no file), its sorted keys and orderings alone
    (`file_cache.PROBED`)."""
    data = rows.select(data_schema.names)
    stored = data if mapping is None else mapping.to_physical(data)
    if mapping is not None:
        dictionary = mapping.physical_names(dictionary)
    folder = layout.folder(_partition_folder(values, mapping))
    path = f"{folder}part-00000-{uuid.uuid4()}-c000.snappy.parquet"
    metadata: list[pq.FileMetaData] = []
    fs.create_dir(f"{root}/{folder}".rstrip("/"), recursive=True)
    pq.write_table(stored, f"{root}/{path}", filesystem=fs, compression="snappy", coerce_timestamps="us",
                   use_dictionary=list(dictionary), metadata_collector=metadata)
    size = fs.get_file_info(f"{root}/{path}").size
    if probe is None:
        file_cache.WRITTEN.put(f"{root}/{path}", stored)
    elif file_cache.PROBED.max_bytes:  # none in Spark's writing tasks: their keys go unsorted
        in_file = (lambda c: c) if mapping is None else mapping.physical.__getitem__
        searched = rows.num_rows >= _SEARCHED_ROWS
        held = dict.fromkeys([*probe.ordering, *([] if searched else probe.key_cols)])
        file_cache.PROBED.put(f"{root}/{path}", file_cache.ProbedColumns(
            metadata[0].schema.to_arrow_schema(), metadata[0],
            {in_file(c): _one_chunk(data.column(c)) for c in held if c in data_schema.names},
            KeyLocator.of(row_keys(data, probe.key_cols)) if searched else None))
    stats = stats_json(metadata[0], stored.schema, layout=layout)
    action = AddAction(path, size, dict(values), int(time.time() * 1000), True, stats)
    return WrittenFile(action, metadata[0].schema.to_arrow_schema())


def write_change_file(fs: pafs.FileSystem, root: str, rows: pa.Table, values: Mapping[str, str | None],
                      data_schema: pa.Schema, mapping: ColumnMapping | None = None) -> ChangeFile:
    """One partition's change data file, under `_change_data/` as Delta's writers put them:
    the table's data columns (by physical name under a column `mapping`) and
    CHANGE_TYPE_COLUMN (partition values in the log)."""
    data = rows.select([*data_schema.names, CHANGE_TYPE_COLUMN])
    if mapping is not None:
        columns = mapping.to_physical(data.select(data_schema.names))
        data = columns.append_column(CHANGE_TYPE_COLUMN, data.column(CHANGE_TYPE_COLUMN))
    folder = _partition_folder(values, mapping)
    path = f"{CHANGE_DATA_FOLDER}/{folder}cdc-00000-{uuid.uuid4()}.c000.snappy.parquet"
    fs.create_dir(f"{root}/{CHANGE_DATA_FOLDER}/{folder}".rstrip("/"), recursive=True)
    pq.write_table(data, f"{root}/{path}", filesystem=fs, compression="snappy", coerce_timestamps="us")
    return ChangeFile(path, fs.get_file_info(f"{root}/{path}").size, dict(values))


def _partition_folder(values: Mapping[str, str | None], mapping: ColumnMapping | None = None) -> str:
    """A partition's Hive-style folder ("c=v/"), or "" where a value is not plain (`_PLAIN_VALUE`)
    or the table maps its columns (a folder named by a column would outlive a rename)."""
    if mapping is None and values and all(v is not None and _PLAIN_VALUE.fullmatch(v) for v in values.values()):
        return "".join(f"{c}={v}/" for c, v in values.items())
    return ""


def _dictionary_columns(data: pa.Table, sample: int = 4096) -> list[str]:
    """String columns worth dictionary-encoding: few distinct values in a sample. Parquet's
    default tries every column and falls back past a page of distinct values, which costs
    the write 2-3x for unique keys, timestamps and measures and makes no smaller file."""
    head = data.slice(0, sample)
    return [f.name for f in data.schema if (pa.types.is_string(f.type) or pa.types.is_large_string(f.type))
            and pc.count_distinct(head.column(f.name)).as_py() * 4 <= head.num_rows]


def row_keys(rows: pa.Table, key_cols: Sequence[str]) -> pa.Array:
    """Comparable keys: the column itself for one key column, the encoded key for several."""
    if len(key_cols) == 1:
        column = rows.column(key_cols[0])
        return column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    return keys.encode_keys(rows, key_cols)


def _newer(incoming: Sequence[pa.ChunkedArray], stored: Sequence[pa.ChunkedArray], incoming_wins_ties: bool):
    """Row-wise: the incoming ordering is newer than the stored one (or equal, when incoming
    wins ties); null where a value is null, as the MERGE's SQL guard."""
    a = [keys.ordering_values(c) for c in incoming]
    b = [keys.ordering_values(c) for c in stored]
    return pc.invert(arrow_greater(b, a)) if incoming_wins_ties else arrow_greater(a, b)
