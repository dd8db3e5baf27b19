"""What the batch changes in the stored files its keys hit (`file_changes`): the rows replaced or
deleted, their new versions, the updates that are no-ops; decided for all the files found at
once, reading only the columns a change needs at the rows hit."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Executor
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from sink import keys
from sink.lakehouse.commit.change_data import CHANGE_DELETE, UPDATE_POSTIMAGE, UPDATE_PREIMAGE
from sink.lakehouse.commit.key_hits import Hits
from sink.lakehouse.commit.stored_rows import StoredRows
from sink.lakehouse.commit.unchanged import has_unchanged, keep_unchanged
from sink.lakehouse.commit.writes import (
    DELETE,
    PARTIAL_COLUMN,
    WRITE_COLUMN,
    Writes,
)
from sink.ordering import arrow_greater


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


def _newer(incoming: Sequence[pa.ChunkedArray], stored: Sequence[pa.ChunkedArray], incoming_wins_ties: bool):
    """Row-wise: the incoming ordering is newer than the stored one (or equal, when incoming
    wins ties); null where a value is null, as the MERGE's SQL guard."""
    a = [keys.ordering_values(c) for c in incoming]
    b = [keys.ordering_values(c) for c in stored]
    return pc.invert(arrow_greater(b, a)) if incoming_wins_ties else arrow_greater(a, b)
