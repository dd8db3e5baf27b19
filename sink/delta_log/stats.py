"""Delta per-file statistics (`add.stats` JSON) from a Parquet footer written by pyarrow.

Readers use them only to skip files, so a column whose stats cannot be written exactly is
left out (decimals: delta-rs writes them as lossy floats; floats: Parquet's min/max ignore NaN
where Spark orders it above every value; nested and binary columns).
"""

from __future__ import annotations

import json
from collections.abc import Collection
from datetime import UTC

import pyarrow as pa
import pyarrow.parquet as pq

from sink.delta_log.file_layout import DEFAULT_LAYOUT, FileLayout


def stats_json(metadata: pq.FileMetaData, schema: pa.Schema, skip: Collection[str] = (),
               layout: FileLayout = DEFAULT_LAYOUT) -> str:
    """`numRecords`, `minValues`, `maxValues` and `nullCount` of the file's columns the
    table's `layout` asks statistics for (not counting `skip`, e.g. partition columns)."""
    mins: dict[str, object] = {}
    maxs: dict[str, object] = {}
    nulls: dict[str, int] = {}
    columns = layout.stats_fields(schema, skip)
    leaves = {metadata.schema.column(i).path: i for i in range(metadata.num_columns)}
    groups = [metadata.row_group(g) for g in range(metadata.num_row_groups) if metadata.row_group(g).num_rows]
    for f in columns:
        if f.name not in leaves or not _has_exact_stats(f.type):
            continue
        chunks = [g.column(leaves[f.name]) for g in groups]
        if not chunks or not all(c.is_stats_set for c in chunks):
            continue
        nulls[f.name] = sum(c.statistics.null_count for c in chunks)
        ranged = [c.statistics for c in chunks if c.statistics.has_min_max]
        if len(ranged) == len(chunks) and ranged:
            mins[f.name] = _json_value(min(s.min for s in ranged), f.type)
            maxs[f.name] = _json_value(max(s.max for s in ranged), f.type)
    return json.dumps({"numRecords": metadata.num_rows, "minValues": mins, "maxValues": maxs, "nullCount": nulls})


def _has_exact_stats(t: pa.DataType) -> bool:
    return (pa.types.is_integer(t) or pa.types.is_string(t) or pa.types.is_large_string(t)
            or pa.types.is_boolean(t) or pa.types.is_date(t) or pa.types.is_timestamp(t))


def _json_value(value, t: pa.DataType):
    if pa.types.is_timestamp(t):
        # delta-rs' formats: with a zone in UTC and a Z, without one as written. Never truncated:
        # a max cut to milliseconds would sit below the true max and skip files it must read.
        if t.tz:
            return value.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        return value.strftime("%Y-%m-%d %H:%M:%S.%f")
    if pa.types.is_date(t):
        return value.isoformat()
    return value
