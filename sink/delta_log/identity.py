"""Identity columns (PROTOCOL.md "Identity Columns"): values the writer generates for new rows,
`start + k * step` for k >= 0, each beyond the column's high-water mark, which the commit that
writes them raises (a `metaData` action, as Delta's Spark engine commits it).

The sink's own commits write them: a new row gets the next values (`IdentityValues`), an
updated row keeps the stored row's value (sink.lakehouse.commit.file_changes). Uniqueness rests
on the log commit's conflict check: a commit landing after the version the batch read fails the
batch, which draws again from the mark that commit left.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
from deltalake import DeltaTable

_PREFIX = "delta.identity."
START = "delta.identity.start"
STEP = "delta.identity.step"
HIGH_WATER_MARK = "delta.identity.highWaterMark"
# The commit info tag Spark's identity commits carry.
SCHEMA_UPDATE_TAG = "delta.identity.schemaUpdate"


@dataclass(frozen=True)
class IdentityColumn:
    name: str
    start: int
    step: int
    high_water_mark: int | None  # None: no value generated yet

    @classmethod
    def of(cls, table: DeltaTable) -> tuple[IdentityColumn, ...]:
        """The table's identity columns: any field with identity metadata, so that one lacking
        its start or step fails here rather than passing for a plain column the stream fills."""
        return tuple(cls(f.name, int(f.metadata[START]), int(f.metadata[STEP]),
                         int(f.metadata[HIGH_WATER_MARK]) if HIGH_WATER_MARK in f.metadata else None)
                     for f in table.schema().fields if any(k.startswith(_PREFIX) for k in f.metadata or {}))

    def first_k(self) -> int:
        """The k of the first value beyond the high-water mark (above it for a positive step,
        below for a negative one); 0 when none was generated."""
        if self.high_water_mark is None:
            return 0
        return max(0, (self.high_water_mark - self.start) // self.step + 1)

    def value(self, k: int) -> int:
        return self.start + k * self.step

    def beyond(self, a: int, b: int) -> int:
        """Of two values, the one further along the step."""
        return max(a, b) if self.step > 0 else min(a, b)


class IdentityValues:
    """Hands out a batch's new values. Threads share one (a batch's partitions are written in
    threads); Spark's writing tasks each take every `stride`-th k from their `offset` (their
    task index among `stride`), so no two tasks draw the same value and none has to ask."""

    def __init__(self, columns: Sequence[IdentityColumn], *, stride: int = 1, offset: int = 0):
        self.columns = tuple(columns)
        self._stride, self._offset = stride, offset
        self._drawn = 0
        self._lock = threading.Lock()

    def fill(self, rows: pa.Table) -> pa.Table:
        """`rows` (new rows, in the table's schema) with their identity values."""
        if not rows.num_rows:
            return rows
        with self._lock:
            first = self._drawn
            self._drawn += rows.num_rows
        steps = self._offset + self._stride * (first + np.arange(rows.num_rows, dtype=np.int64))
        for c in self.columns:
            i = rows.schema.get_field_index(c.name)
            values = pa.array(c.start + (c.first_k() + steps) * c.step, rows.schema.field(i).type)
            rows = rows.set_column(i, rows.schema.field(i), values)
        return rows

    def high(self) -> dict[str, int]:
        """Per column, the value furthest along its step that was handed out (none: nothing)."""
        if not self._drawn:
            return {}
        last = self._offset + self._stride * (self._drawn - 1)
        return {c.name: c.value(c.first_k() + last) for c in self.columns}


def metadata_action(table: DeltaTable, highs: Sequence[Mapping[str, int]]) -> dict:
    """The table's `metaData` action with each identity column's high-water mark raised to the
    value furthest along its step among `highs` (several writers' values; never lowered), as
    the commit writing those values must carry it."""
    schema = json.loads(table.schema().to_json())
    columns = {c.name: c for c in IdentityColumn.of(table)}
    for f in schema["fields"]:
        c = columns.get(f["name"])
        values = [high[f["name"]] for high in highs if f["name"] in high]
        if c is None or not values:
            continue
        if c.high_water_mark is not None:
            values.append(c.high_water_mark)
        mark = values[0]
        for v in values[1:]:
            mark = c.beyond(mark, v)
        f["metadata"][HIGH_WATER_MARK] = mark
    m = table.metadata()
    action = {"id": m.id, "format": {"provider": "parquet", "options": {}},
              "schemaString": json.dumps(schema, separators=(",", ":")), "partitionColumns": list(m.partition_columns),
              "configuration": dict(m.configuration), "createdTime": m.created_time}
    if m.name is not None:
        action["name"] = m.name
    if m.description is not None:
        action["description"] = m.description
    return {"metaData": action}
