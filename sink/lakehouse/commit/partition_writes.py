"""One partition's writes (`rewrite_partition`): the tables to write (its rewritten files, then
its new keys), the files they replace, the no-op updates, the marks (merge-on-read) and the
change data feed's rows; then its files written."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
from pyroaring import BitMap64

from sink.delta_log import deletion_vectors
from sink.lakehouse.commit.actions import Rewrite, StoredFile
from sink.lakehouse.commit.change_data import CHANGE_INSERT, change_table, write_change_file
from sink.lakehouse.commit.data_files import ProbeColumns, write_partition_files
from sink.lakehouse.commit.file_changes import FileChange
from sink.lakehouse.commit.key_hits import FoundFile, file_key_columns
from sink.lakehouse.commit.merge_on_read import Mark, rewrites
from sink.lakehouse.commit.shares import Share
from sink.lakehouse.commit.writes import (
    DELETE,
    INSERT,
    UPDATE,
    WRITE_COLUMN,
    Writes,
    conform,
)


def rewrite_partition(fs: pafs.FileSystem, root: str, rows: pa.Table, values: Mapping[str, str | None],
                      found: Sequence[FoundFile], decided: Sequence[FileChange], probed: np.ndarray,
                      writes: Writes, share: Share | None = None) -> tuple[Rewrite, list[Mark]]:
    """The writes `rows` of one partition (its partition `values`), whose files `found` hold
    keys of its updates and deletes (at `probed` among `rows`), what they change in each
    (`decided`): the rewritten files and new keys written, the files they replace,
    (merge-on-read) the files whose rows it marks deleted, and (a change data feed) its change
    file; of a `share`, its part alone (no change data feed, no identity column)."""
    done = _partition_tables(rows, found, decided, probed, writes, share)
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


def _partition_tables(rows: pa.Table, found: Sequence[FoundFile], decided: Sequence[FileChange], probed: np.ndarray,
                      writes: Writes, share: Share | None = None) -> PartitionWrites:
    """One partition: the tables to write (rewritten files, then new keys), the files they
    replace, the no-op updates, (merge-on-read) the files whose rows are marked deleted
    instead (but those marked enough to be rewritten, `rewrites`), their new row versions
    written with the new keys, and (`writes.change_data`) the
    rows of its change data feed. Of a `share`: the files it owns (their counts too), the new
    rows of its keys."""
    if share is not None and (writes.change_data or writes.identity is not None):
        raise ValueError("a share of a partition's writes writes no change data feed and no identity values")
    owned = None if share is None else share.owned([f for f, *_ in found])
    matched = np.zeros(rows.num_rows, bool)
    fresh: list[pa.Table] = []  # a share's new row versions
    outputs: list[pa.Table] = []
    removed: list[StoredFile] = []
    marks: list[Mark] = []
    change_rows: list[tuple[str, pa.Table]] = []
    unchanged = updated = deleted_rows = 0
    for (f, stored, hits, deleted), change in zip(found, decided):
        matched[probed[hits.incoming]] = True
        if owned is not None:
            fresh.append(change.replaced.filter(pa.array(share.homes(change.replaced, writes.key_cols))))
            if f.path not in owned:
                continue
        unchanged += change.unchanged
        if not len(change.gone):
            continue
        updated += change.replaced.num_rows
        deleted_rows += len(change.deleted)
        removed.append(f)
        if writes.change_data:
            change_rows.extend(change.change_rows(stored))
        replaced = [change.replaced] if owned is None else []
        marked = len(deleted) + len(change.gone)  # the batch's rows are live ones: none of them in `deleted`
        if writes.merge_on_read and not rewrites(marked, stored.num_rows, writes.rewrite_marked_share):
            marks.append(Mark(f, deleted | BitMap64(change.gone.tolist()), stored.num_rows, stored.metadata))
            outputs.extend(replaced)
        else:
            kept = np.ones(stored.num_rows, bool)
            kept[change.gone] = False
            kept[deletion_vectors.positions(deleted)] = False
            outputs.append(pa.concat_tables([stored.read().filter(pa.array(kept)), *replaced]))
    # New keys, and updates of keys no file holds, are new rows (the MERGE inserts them too).
    new_keys = pc.and_(pa.array(~matched), pc.not_equal(rows.column(WRITE_COLUMN), DELETE))
    if share is not None:
        new_keys = pc.and_(new_keys, pa.array(share.homes(rows, writes.key_cols)))
    inserts = conform(rows.filter(new_keys), writes.schema) if pc.any(new_keys).as_py() else None
    if inserts is not None and writes.identity is not None:
        inserts = writes.identity.fill(inserts)
    if inserts is not None and writes.change_data:
        change_rows.append((CHANGE_INSERT, inserts))
    inserted = inserts.num_rows if inserts is not None else 0
    if fresh:  # a share's new row versions join its new keys
        inserts = pa.concat_tables([*fresh, *([inserts] if inserts is not None else [])])
        inserts = inserts if inserts.num_rows else None
    if writes.merge_on_read:  # the new row versions and the new keys: one new file
        outputs = [t for t in outputs if t.num_rows] + ([inserts] if inserts is not None else [])
        outputs = [pa.concat_tables(outputs)] if outputs else []
    elif inserts is not None:
        outputs = with_inserts(outputs, inserts)
    # Every partition's changes, new keys too: a reader takes a version's changes from its
    # change files alone once it has any (PROTOCOL.md "Change Data Files").
    feed = change_table(change_rows) if change_rows else None
    counts = {INSERT: inserted, UPDATE: updated, DELETE: deleted_rows}
    return PartitionWrites(outputs, removed, unchanged, marks, feed, counts)


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
