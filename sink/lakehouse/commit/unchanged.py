"""What a write carries where the stored value stays (`UNCHANGED`, in a partial update's
column the source did not send: sink.tagging.partial), and how the commit paths keep the stored value
there."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

# What a write carries where the stored value stays: one value whatever `unchanged_value` is,
# so the commit paths need not know the setting.
UNCHANGED = "__upsert_sink_unchanged__"


def is_text(field: pa.Field) -> bool:
    return text_type(field.type)


def text_type(t: pa.DataType) -> bool:
    return pa.types.is_string(t) or pa.types.is_large_string(t)


def keep_unchanged(columns: Sequence[pa.Array], old: pa.Table, schema: pa.Schema) -> list[pa.Array]:
    """`columns` (new rows in `schema`) with UNCHANGED taken from `old`, the stored rows they replace."""
    out = []
    for c, f in zip(columns, schema):
        if is_text(f):
            c = pc.if_else(pc.fill_null(pc.equal(c, UNCHANGED), False), old.column(f.name).cast(f.type), c)
        out.append(c)
    return out


def unchanged_rows(rows: pa.Table, value: str = UNCHANGED) -> pa.Array:
    """Per row of `rows`: some string column holds `value`."""
    out = pa.array(np.zeros(rows.num_rows, bool))
    for f in rows.schema:
        if is_text(f):
            out = pc.or_(out, pc.fill_null(pc.equal(rows.column(f.name), value), False))
    return out


def has_unchanged(rows: pa.Table, value: str = UNCHANGED) -> bool:
    """Some string column of `rows` holds `value` (most batches: none)."""
    return pc.any(unchanged_rows(rows, value)).as_py()
