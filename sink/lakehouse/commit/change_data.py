"""The change data feed (PROTOCOL.md "Change Data Files"): a partition's changed rows, each with
its change type, written as a change file under `_change_data/` (its `cdc` action)."""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from sink.delta_log.column_mapping import ColumnMapping
from sink.lakehouse.commit.actions import ChangeFile
from sink.lakehouse.commit.data_files import partition_folder

# The change data feed (PROTOCOL.md "Change Data Files"): where its files go, their column
# naming each row's change, and its values.
CHANGE_DATA_FOLDER = "_change_data"
CHANGE_TYPE_COLUMN = "_change_type"
CHANGE_INSERT, CHANGE_DELETE = "insert", "delete"
UPDATE_PREIMAGE, UPDATE_POSTIMAGE = "update_preimage", "update_postimage"


def change_table(parts: Sequence[tuple[str, pa.Table]]) -> pa.Table:
    """The change data feed's rows: each part's rows with their change type."""
    return pa.concat_tables([t.append_column(CHANGE_TYPE_COLUMN, pa.repeat(pa.scalar(kind, pa.string()), t.num_rows))
                             for kind, t in parts])


def write_change_file(fs: pafs.FileSystem, root: str, rows: pa.Table, values: Mapping[str, str | None],
                      data_schema: pa.Schema, mapping: ColumnMapping | None = None) -> ChangeFile:
    """One partition's change data file, under `_change_data/` as Delta's writers put them:
    the table's data columns (by physical name under a column `mapping`) and
    CHANGE_TYPE_COLUMN (partition values in the log)."""
    data = rows.select([*data_schema.names, CHANGE_TYPE_COLUMN])
    if mapping is not None:
        columns = mapping.to_physical(data.select(data_schema.names))
        data = columns.append_column(CHANGE_TYPE_COLUMN, data.column(CHANGE_TYPE_COLUMN))
    folder = partition_folder(values, mapping)
    path = f"{CHANGE_DATA_FOLDER}/{folder}cdc-00000-{uuid.uuid4()}.c000.snappy.parquet"
    fs.create_dir(f"{root}/{CHANGE_DATA_FOLDER}/{folder}".rstrip("/"), recursive=True)
    pq.write_table(data, f"{root}/{path}", filesystem=fs, compression="snappy", coerce_timestamps="us")
    return ChangeFile(path, fs.get_file_info(f"{root}/{path}").size, dict(values))
