"""The data files a rewrite or merge-on-read writes: one partition's new files (split to the
table's layout), their statistics and `add` actions, their rows (or, for merge-on-read, what a
later batch probes them for) held for the next batch."""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq
from deltalake.transaction import AddAction

from sink.delta_log.column_mapping import ColumnMapping
from sink.delta_log.file_layout import DEFAULT_LAYOUT, FileLayout
from sink.delta_log.stats import stats_json
from sink.lakehouse.commit import file_cache, key_locator
from sink.lakehouse.commit.actions import WrittenFile
from sink.lakehouse.commit.key_locator import KeyLocator
from sink.lakehouse.commit.stored_rows import one_chunk, row_keys

# Partition values written as a Hive-style folder name as they are; others (and nulls) as
# Delta's conventions would escape them, which delta-rs would escape once more in the log:
# such files go to the table's root, their values only in the log (readers take them there).
_PLAIN_VALUE = re.compile(r"[A-Za-z0-9_.\-]+")


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
    merge-on-read batch marks rows, and rewrites a file only once half its rows are marked),
    its sorted keys and orderings alone (`file_cache.PROBED`)."""
    data = rows.select(data_schema.names)
    stored = data if mapping is None else mapping.to_physical(data)
    if mapping is not None:
        dictionary = mapping.physical_names(dictionary)
    folder = layout.folder(partition_folder(values, mapping))
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
        searched = rows.num_rows >= key_locator.SEARCHED_ROWS
        held = dict.fromkeys([*probe.ordering, *([] if searched else probe.key_cols)])
        file_cache.PROBED.put(f"{root}/{path}", file_cache.ProbedColumns(
            metadata[0].schema.to_arrow_schema(), metadata[0],
            {in_file(c): one_chunk(data.column(c)) for c in held if c in data_schema.names},
            KeyLocator.of(row_keys(data, probe.key_cols)) if searched else None))
    stats = stats_json(metadata[0], stored.schema, layout=layout)
    action = AddAction(path, size, dict(values), int(time.time() * 1000), True, stats)
    return WrittenFile(action, metadata[0].schema.to_arrow_schema())


def partition_folder(values: Mapping[str, str | None], mapping: ColumnMapping | None = None) -> str:
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
