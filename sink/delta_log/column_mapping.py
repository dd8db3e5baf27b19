"""Column mapping (PROTOCOL.md "Column Mapping"): the table's data files, statistics and
partition values name a column by its physical name (`name` mode) or its field id (`id`
mode), never by the name readers see, which a rename changes in the schema alone.

The sink's rewrite and merge-on-read read stored files and write new ones: through a
`ColumnMapping` they read a file's columns under their table names, and write files, their
statistics and their log actions under the physical ones, each column with its field id
(`PARQUET:field_id`, as Delta's Spark engine writes both modes). Top-level columns only: a
table with a nested column under column mapping stays on MERGE (`writable`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import pyarrow as pa
from deltalake import DeltaTable

from sink.delta_log.features import COLUMN_MAPPING

_PHYSICAL_NAME = "delta.columnMapping.physicalName"
_ID = "delta.columnMapping.id"
FIELD_ID = b"PARQUET:field_id"
_NESTED = ("struct", "array", "map")


@dataclass(frozen=True)
class ColumnMapping:
    """A column-mapped table's columns: table name -> physical name and field id."""

    by_id: bool  # id mode: a stored file's column is the one with the field's id
    physical: dict[str, str]
    ids: dict[str, int]

    @classmethod
    def of(cls, table: DeltaTable) -> ColumnMapping | None:
        """The table's mapping; None without column mapping."""
        mode = mode_of(table)
        if mode == "none":
            return None
        fields = table.schema().fields
        return cls(mode == "id", {f.name: str(f.metadata[_PHYSICAL_NAME]) for f in fields},
                   {f.name: int(f.metadata[_ID]) for f in fields})

    def file_columns(self, file_schema: pa.Schema) -> dict[str, str]:
        """Of a stored file's columns, those of the table: table name -> name in the file
        (a column dropped from the table, or added after the file, is not there)."""
        if self.by_id:
            in_file = {int(f.metadata[FIELD_ID]): f.name for f in file_schema if f.metadata and FIELD_ID in f.metadata}
            return {c: in_file[i] for c, i in self.ids.items() if i in in_file}
        names = set(file_schema.names)
        return {c: p for c, p in self.physical.items() if p in names}

    def to_physical(self, data: pa.Table) -> pa.Table:
        """`data`'s columns under their physical names, with their field ids."""
        return pa.Table.from_arrays(data.columns, schema=self.physical_schema(data.schema))

    def physical_schema(self, schema: pa.Schema) -> pa.Schema:
        return pa.schema([pa.field(self.physical[f.name], f.type, f.nullable, {FIELD_ID: str(self.ids[f.name])})
                          for f in schema])

    def partition_values(self, values: Mapping[str, str | None]) -> dict[str, str | None]:
        """Partition values keyed as the log keys them: by physical name."""
        return {self.physical[c]: v for c, v in values.items()}

    def physical_names(self, names: Sequence[str]) -> list[str]:
        return [self.physical[c] for c in names]


def log_keys(table: DeltaTable, partition_by: Sequence[str]) -> tuple[str, ...]:
    """The names the log's partition values go by: under column mapping the physical ones
    (sink.delta_log.reading.read_commit)."""
    mapping = ColumnMapping.of(table)
    return tuple(partition_by) if mapping is None else tuple(mapping.physical_names(partition_by))


def mode_of(table: DeltaTable) -> str:
    return (table.metadata().configuration.get(COLUMN_MAPPING) or "none").lower()


def writable(table: DeltaTable) -> bool:
    """The sink's files can carry the table's mapping: it has one, over top-level columns
    alone (a nested column's fields have physical names of their own)."""
    if mode_of(table) == "none":
        return False
    return not any(getattr(f.type, "type", None) in _NESTED for f in table.schema().fields)
