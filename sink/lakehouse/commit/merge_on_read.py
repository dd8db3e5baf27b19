"""Merge-on-read: a stored file is kept, the rows the batch replaces or deletes marked deleted
by a new deletion vector (`Mark`), unless enough of its rows would be marked that it is
rewritten instead (`rewrites`); the vectors of a batch written in one file, each paired with
its file and the stats a file with a deletion vector carries."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
from pyroaring import BitMap64

from sink.delta_log import deletion_vectors
from sink.delta_log.column_mapping import ColumnMapping
from sink.delta_log.file_layout import FileLayout
from sink.delta_log.paths import file_location
from sink.delta_log.stats import stats_json
from sink.lakehouse.commit import file_cache
from sink.lakehouse.commit.actions import MarkedFile, StoredFile


def rewrites(marked: int, physical_rows: int, rewrite_marked_share: float) -> bool:
    """Whether merge-on-read rewrites a file rather than marking rows in it: once the rows
    marked deleted after the batch (`marked`: its deletion vector's and the batch's) reach
    `rewrite_marked_share` of its `physical_rows` (the option's; default
    `writes.REWRITE_MARKED_SHARE`). Copying the rest then costs no more rows
    than are dead (at the default, half of them), and readers stop reading dead rows; a file
    whose every row goes is removed, whatever the share."""
    return marked >= physical_rows or marked >= rewrite_marked_share * physical_rows


@dataclass(frozen=True)
class Mark:
    """Merge-on-read: a stored file's rows to delete from now on, old deletion vector included."""

    stored: StoredFile
    rows: BitMap64
    physical_rows: int
    metadata: pq.FileMetaData | None = None  # its Parquet footer, when the probe read it


def store_marks(fs: pafs.FileSystem, root: str, marks: Sequence[Mark], mapping: ColumnMapping | None,
                 layout: FileLayout) -> list[MarkedFile]:
    """Write the marks' deletion vectors (one file for all of them) and pair them with their
    files (a mark leaves a row of its file: one whose every row goes is rewritten, `rewrites`)."""
    if not marks:
        return []
    descriptors = deletion_vectors.write_file(fs, root, [m.rows for m in marks])
    out = []
    for m, d in zip(marks, descriptors):
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
