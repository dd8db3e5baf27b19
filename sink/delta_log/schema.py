"""What a stream's schema may do against its table's: add columns, widen numbers; nothing
that would drop a column or change a value on the way in."""

from __future__ import annotations

from collections.abc import Mapping

import pyarrow as pa

from sink.errors import ContractMismatchError, SchemaError
from sink.history import END_AT, HISTORY_COLUMNS, RUN_EVENTS, START_AT


def _plain(t: pa.DataType) -> pa.DataType:
    """Arrow has several layouts of one logical type; Delta stores one."""
    if pa.types.is_large_string(t) or pa.types.is_string_view(t):
        return pa.string()
    if pa.types.is_large_binary(t) or pa.types.is_binary_view(t):
        return pa.binary()
    if pa.types.is_dictionary(t):
        return _plain(t.value_type)
    return t


def plain_layouts(rows: pa.Table) -> pa.Table:
    """`rows` with every column in the layout Delta stores (delta-rs' scans give views and
    dictionaries)."""
    return rows.cast(pa.schema([f.with_type(_plain(f.type)) for f in rows.schema]))


def fits(stream: pa.DataType, table: pa.DataType) -> bool:
    """Whether every value of `stream` type is stored unchanged in a `table` column: the same
    type, or a wider integer or float. (Integers keep their text form when widened, so key
    columns keep their encoding too.)"""
    stream, table = _plain(stream), _plain(table)
    if stream == table:
        return True
    if pa.types.is_signed_integer(stream) and pa.types.is_signed_integer(table):
        return table.bit_width >= stream.bit_width
    if pa.types.is_floating(stream) and pa.types.is_floating(table):
        return table.bit_width >= stream.bit_width
    if pa.types.is_timestamp(stream) and pa.types.is_timestamp(table):
        return stream.unit == table.unit and (stream.tz is None) == (table.tz is None)
    return False


def pending(added: list[pa.Field], present: pa.Schema) -> list[pa.Field]:
    """Of the batch's `added` fields, those `present` (the table's schema) lacks, or holds in
    another shape (a history table's RUN_EVENTS widened by a new untracked column): a retry
    finds the rest in place."""
    return [f for f in added if f.name not in present.names or _shape(present.field(f.name).type) != _shape(f.type)]


def with_added(present: pa.Schema, added: list[pa.Field]) -> pa.Schema:
    """The table's schema once the batch's `added` fields are in: a new field at the end, a
    widened one in its place."""
    widened = {f.name: f for f in added if f.name in present.names}
    return pa.schema([*(widened.get(f.name, f) for f in present), *(f for f in added if f.name not in present.names)])


def added_columns(stream: pa.Schema, table: pa.Schema, roles: Mapping[str, str], evolution: str,
                  generated: Mapping[str, str] | None = None) -> list[pa.Field]:
    """The stream's columns the table lacks, to add (nullable) in the batch's commit; raises
    SchemaError for a column the table has and the stream lacks (`generated`: the table's
    generated columns and their expressions, which the stream must carry too), a type a cast
    would change values of (naming the column and its role), or new columns under
    `evolution = "fail"`."""
    gone = [n for n in table.names if n not in stream.names]
    computed = {n: e for n, e in (generated or {}).items() if n in gone}
    if computed:
        selects = ", ".join(f"{e} AS {n}" for n, e in computed.items())
        raise SchemaError(f"the table's generated column(s) {list(computed)} are not in the stream: the sink writes "
                          f"the values the stream carries and computes none; add them to the stream's select "
                          f"({selects}): Delta checks each value against its expression")
    if gone:
        raise SchemaError(f"the table's column(s) {gone} are not in the stream (dropped or renamed?): the sink "
                          "never drops a column; add them back to the stream, or migrate the table first")
    for field in stream:
        if field.name in table.names and not fits(field.type, table.field(field.name).type):
            role = f"{roles[field.name]} column" if field.name in roles else "column"
            raise SchemaError(
                f"{role} {field.name!r} is {field.type} in the stream and {table.field(field.name).type} in the "
                "table: storing it would change values (a cast the sink does not make); cast it in the query, "
                "or migrate the table")
    added = [pa.field(f.name, f.type, nullable=True) for f in stream if f.name not in table.names]
    if added and evolution == "fail":
        raise SchemaError(f"the stream has column(s) {[f.name for f in added]} the table lacks and "
                          "schema_evolution = 'fail'; set schema_evolution = 'add_columns' to add them")
    return added


def check_history_columns(uri: str, table: pa.Schema, expected: list[pa.Field]) -> None:
    """The table must have the history columns the config gives it (`expected`; none for
    scd_type 1): a history table written otherwise (other tracked columns, ignore_null_updates
    switched) keeps events that config would read back wrong."""
    found = [f for f in table if f.name in HISTORY_COLUMNS]
    if not expected:
        if found:
            raise ContractMismatchError(f"{uri} is a history table (it has {[f.name for f in found]}, written "
                                        "with scd_type = 2); the config says scd_type = 1")
        return
    missing = [c for c in (START_AT, END_AT, RUN_EVENTS) if c not in table.names]
    if missing:
        raise ContractMismatchError(f"{uri} is not a history table (it lacks {missing}): scd_type = 2 writes to a "
                                    "table it creates, or one it wrote")
    if [(f.name, _shape(f.type)) for f in found] != [(f.name, _shape(f.type)) for f in expected]:
        raise ContractMismatchError(
            f"{uri} keeps its history in {[f'{f.name}: {f.type}' for f in found]}, the config's would be "
            f"{[f'{f.name}: {f.type}' for f in expected]}: it was written with other track_history or "
            "ignore_null_updates settings; restore them, or write the history into a new table")


def _shape(t: pa.DataType):
    """A type as nested tuples, whatever a list's item field is named (Delta reads `element`)."""
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        return ("list", _shape(t.value_type))
    if pa.types.is_struct(t):
        return ("struct", tuple((t.field(i).name, _shape(t.field(i).type)) for i in range(t.num_fields)))
    return str(t)
