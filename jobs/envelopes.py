"""CDC envelopes the ready job unpacks into the flat records the sink takes (`[source] envelope`)."""

from __future__ import annotations

from pyspark.sql.types import StringType, StructType

from sink.errors import ConfigError
from sink.keys import quoted_column

ENVELOPES = ("none", "debezium")
# The columns the Debezium envelope adds beside the row's own.
DEBEZIUM_COLUMNS = ("op", "ts_ms", "lsn")
# Debezium's stand-in for a value the database did not send (`unavailable.value.placeholder`):
# PostgreSQL leaves an unchanged TOASTed value out of an update under REPLICA IDENTITY DEFAULT.
UNAVAILABLE_VALUE = "__debezium_unavailable_value"


def debezium_select(schema: StructType, carried: tuple[str, ...] = ()) -> list[str]:
    """Spark SQL expressions that flatten Debezium's `{op, ts_ms, source, before, after}`: one
    column per field of `after` (taken from `before` for deletes, op = 'd', whose `after` is
    null; a field `before` lacks, as with the default replica identity's key-only deletes,
    is null), `op` (c create, u update, r snapshot read, d delete), `ts_ms` when the schema
    has it, and `lsn` from `source.lsn` when the source struct has one (Postgres); the
    `carried` columns beside the envelope as they are."""
    fields = {f.name: f.dataType for f in schema.fields}
    missing = [n for n in ("op", "before", "after") if n not in fields]
    if missing:
        raise ConfigError(f"source.envelope = 'debezium' needs the envelope's fields op, before and after in "
                          f"source.schema; it lacks {missing}")
    after, before = fields["after"], fields["before"]
    if not isinstance(after, StructType) or not isinstance(before, StructType):
        raise ConfigError("source.envelope = 'debezium': before and after must be STRUCTs of the row's columns "
                          "in source.schema")
    clashing = [n for n in after.fieldNames() if n in DEBEZIUM_COLUMNS]
    if clashing:
        raise ConfigError(f"source.envelope = 'debezium': the row's column(s) {clashing} clash with the envelope's "
                          f"{list(DEBEZIUM_COLUMNS)}; flatten it with source.select instead")
    exprs = []
    for name in after.fieldNames():
        q = quoted_column(name)
        deleted = f"before.{q}" if name in before.fieldNames() else "NULL"
        exprs.append(f"CASE WHEN op = 'd' THEN {deleted} ELSE after.{q} END AS {q}")
    exprs.append("op")
    if "ts_ms" in fields:
        exprs.append("ts_ms")
    source = fields.get("source")
    if isinstance(source, StructType) and "lsn" in source.fieldNames():
        exprs.append("source.lsn AS lsn")
    return [*exprs, *(quoted_column(c) for c in carried)]


def unavailable_guard(schema: StructType, columns: list[str], ops: tuple[str, ...] = ()) -> str | None:
    """A `quarantine_when` expression true for a record whose string column (of `after`, among
    the stream's `columns`) holds Debezium's placeholder for a value it did not receive, where
    the stored value cannot be kept: in a history table, or in the events of `ops` (all when
    empty), and writing the placeholder would be silent damage (None: no such column)."""
    after = {f.name: f.dataType for f in schema["after"].dataType.fields}
    strings = [n for n in columns if isinstance(after.get(n), StringType)]
    if not strings:
        return None
    held = " OR ".join(f"{quoted_column(n)} = '{UNAVAILABLE_VALUE}'" for n in strings)
    return f"op IN ({', '.join(repr(op) for op in ops)}) AND ({held})" if ops else held
