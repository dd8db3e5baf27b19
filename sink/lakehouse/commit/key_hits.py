"""Which of a partition's stored files hold a key the batch updates or deletes, and at which rows
(`matching_files`, `Hits`): each file probed on its key columns alone, by a search of its
sorted keys (or its partition's, merged) or one `pc.index_in` over the small files' keys; not
the rows a file's deletion vector deletes."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
from pyroaring import BitMap64

from sink.delta_log import deletion_vectors
from sink.delta_log.column_mapping import ColumnMapping
from sink.delta_log.deletion_vectors import Descriptor
from sink.delta_log.paths import file_location
from sink.lakehouse.commit import file_cache, key_locator
from sink.lakehouse.commit.actions import StoredFile
from sink.lakehouse.commit.key_locator import MergedKeys
from sink.lakehouse.commit.stored_rows import HeldParquet, StoredRows


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
                and entry.locator.num_rows >= key_locator.SEARCHED_ROWS
                and (merged is None or location not in merged.files)):
            apart.append((location, entry))
    if len(apart) >= _MERGED_FILES:
        runs = [(location, e.locator) for location, e in apart]
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
        if s.locator is not None and s.locator.num_rows >= key_locator.SEARCHED_ROWS:
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


def _stored_rows(fs: pafs.FileSystem, location: str, schema: pa.Schema, values: Mapping[str, str | None],
                 mapping: ColumnMapping | None) -> StoredRows:
    """The file at `location`: from memory when this process wrote it lately, else its Parquet
    (its probe columns from memory when held)."""
    held = file_cache.WRITTEN.get(location)
    if held is not None:
        return StoredRows(held, schema, values, mapping)
    return StoredRows(HeldParquet(fs, location), schema, values, mapping)
