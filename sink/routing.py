"""The Spark side of a batch, which its checks and prepare phases run (sink/batch/checks.py,
sink/batch/prepare.py): the stream's schema checked against the config, and the helper
columns routing and tagging need (shard, key, ordering, write, the quarantine reason of a bad
record)."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

from pyspark.sql import DataFrame
from pyspark.sql import functions as F
from pyspark.sql.types import BooleanType, LongType, StringType, StructField, StructType

from sink import columns as C
from sink import keys
from sink.config import SinkConfig
from sink.config.options import HIDDEN_ORDERING_PREFIX
from sink.errors import SchemaError
from sink.history import HISTORY_COLUMNS
from sink.ordering import helper_columns
from sink.session import session_kind

log = logging.getLogger(__name__)


def validate_schema(cfg: SinkConfig, schema: StructType) -> None:
    """Fail before the first batch when the config names columns the stream lacks."""
    types = {f.name: f.dataType.typeName() for f in schema.fields}
    roles = [("key", c, keys.KEY_TYPES) for c in cfg.key]
    roles += [("partition_by", c, keys.PARTITION_TYPES) for c in cfg.partition_by]
    roles += [("ordering", c, keys.ORDERING_TYPES) for c in cfg.ordering_columns]
    for role, col, accepted in roles:
        if col not in types:
            raise SchemaError(
                f"{role} column {col!r} is not in the stream; the stream's columns are {sorted(types)}"
            )
        if types[col] not in accepted:
            raise SchemaError(
                f"{role} column {col!r} has type {types[col]}; accepted types: {list(accepted)}"
            )
    fresh = cfg.freshness_column
    if fresh is not None and types.get(fresh) not in FRESHNESS_TYPES:
        raise SchemaError(f"freshness_column {fresh!r} " + (f"has type {types[fresh]}" if fresh in types else
                          f"is not in the stream (its columns: {sorted(types)})") +
                          f"; accepted types: {list(FRESHNESS_TYPES)} (a BIGINT holds epoch milliseconds)")
    missing = [c for c in cfg.except_columns if c not in types]
    if missing:
        raise SchemaError(f"except_columns {missing} are not in the stream; the stream's columns are {sorted(types)}")
    corrupt = cfg.corrupt_record_column
    if corrupt in types and types[corrupt] != "string":
        raise SchemaError(f"corrupt_record_column {corrupt!r} has type {types[corrupt]} in the stream; Spark's "
                          "corrupt-record column is a string (set corrupt_record_column to another name if this "
                          "column is data)")
    clashing = [n for n in types if n.startswith(C.PREFIX)]
    if clashing:
        raise SchemaError(f"column(s) {clashing} use the sink's reserved prefix {C.PREFIX!r}")
    if cfg.scd_type == 2:
        _validate_history(cfg, types)
    for ordering, hidden in cfg.hidden_ordering.items():
        if hidden in types:
            raise SchemaError(f"the stream has a column {hidden!r}, where the table keeps the ordering column "
                              f"{ordering!r} that except_columns leaves out: rename it in the stream")


def _validate_history(cfg: SinkConfig, types: dict[str, str]) -> None:
    reserved = [n for n in types if n in HISTORY_COLUMNS]
    if reserved:
        raise SchemaError(f"the stream has column(s) {reserved}, which scd_type = 2 adds to the table: rename them "
                          "in the stream")
    for name, named in (("track_history_columns", cfg.track_history_columns),
                        ("track_history_except_columns", cfg.track_history_except_columns)):
        unstored = [c for c in named or () if c not in types or c in cfg.unstored_columns]
        if unstored:
            raise SchemaError(f"{name} {unstored} are not columns the table stores (stream columns not in "
                              f"except_columns); the stream's columns are {sorted(types)}")


def with_hidden_ordering(df: DataFrame, cfg: SinkConfig) -> DataFrame:
    """`df` plus a copy of each ordering column except_columns leaves out, under the name the
    table keeps it (`SinkConfig.hidden_ordering`); `cfg` is the config as the user wrote it."""
    hidden = cfg.hidden_ordering
    if not hidden:
        return df
    return df.selectExpr("*", *(f"{keys.quoted_column(c)} AS {keys.quoted_column(h)}" for c, h in hidden.items()))


def validate_stream(cfg: SinkConfig, df: DataFrame) -> None:
    """`validate_schema` plus analysis of `delete_when` against the stream's columns, and a
    warning when the stream's file source would turn unparseable values into nulls."""
    validate_schema(cfg, df.schema)
    warning = unguarded_parsing(cfg, session_kind(df.sparkSession).stream_sources(df), df.schema.fieldNames())
    if warning:
        log.warning(warning)
    for name, expr in (("delete_when", cfg.delete_when), ("quarantine_when", cfg.quarantine_when)):
        if not expr:
            continue
        try:
            result = df.select(F.expr(expr)).schema.fields[0].dataType
        except Exception as e:
            raise SchemaError(f"{name} = {expr!r} does not apply to the stream: {e}") from e
        if not isinstance(result, BooleanType):
            raise SchemaError(f"{name} = {expr!r} must be a boolean expression, it gives {result.typeName()}")


# The source-time column's types (sink.freshness): epoch milliseconds, or a timestamp.
FRESHNESS_TYPES = ("long", "timestamp", "timestamp_ntz")


# Spark's readers that parse text into typed columns: a value that does not parse is read as
# null in PERMISSIVE mode (their default), and only the corrupt-record column keeps its text.
PARSED_FORMATS = ("json", "csv")


def unguarded_parsing(cfg: SinkConfig, sources: Sequence[tuple[str, Mapping[str, str]]],
                      columns: Sequence[str]) -> str | None:
    """Why a JSON or CSV source in PERMISSIVE mode would write nulls over good values: the
    stream lacks the corrupt-record column the sink quarantines on (None: it has it)."""
    for fmt, options in sources:
        options = {k.lower(): v for k, v in options.items()}
        if fmt.lower() not in PARSED_FORMATS or options.get("mode", "PERMISSIVE").upper() != "PERMISSIVE":
            continue
        reader_column = options.get("columnnameofcorruptrecord", cfg.corrupt_record_column)
        if reader_column != cfg.corrupt_record_column:
            return (f"the stream's {fmt} source keeps unparseable records in {reader_column!r} "
                    f"(columnNameOfCorruptRecord), but corrupt_record_column = {cfg.corrupt_record_column!r}: "
                    f"set corrupt_record_column = {reader_column!r} so that such records are quarantined")
        if reader_column not in columns:
            return (f"the stream reads {fmt} files in PERMISSIVE mode without the corrupt-record column "
                    f"{reader_column!r} in its schema: a value Spark cannot parse is read as null and written "
                    f"over the stored value. Add `{reader_column} STRING` to the reader's schema (the sink "
                    "quarantines such records with their raw text), or read with mode FAILFAST")
    return None


def sql_string(value: str) -> str:
    """A Spark SQL string literal of `value`."""
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


# How a corrupt-record text starts whose first line says why (a value that did not decode, and
# its column): that line is the quarantine reason (the ready job's Kafka source writes them).
CANNOT_DECODE = "cannot decode"
# The reason of an upsert with a null partition column (a delete is placed by the index).
NULL_PARTITION = "null partition column"


def quarantine_reason(cfg: SinkConfig, schema: StructType, constraints: Mapping[str, str] = {}) -> str:
    """SQL for why a record cannot be written (NULL when it can), first failing check wins.
    An empty string partition value is refused too: Delta stores it as NULL, so the row
    would not come back under the value it was written with. `constraints`: what an upsert must
    meet (`features.row_checks`: label -> expression), false or null breaking one, as Delta
    checks them."""
    col = keys.quoted_column
    checks = []
    corrupt = None
    if cfg.corrupt_record_column in schema.fieldNames():
        # First: PERMISSIVE reading nulls what did not parse, so every later check would mislead.
        corrupt = f"{col(cfg.corrupt_record_column)} IS NOT NULL"
        checks.append((corrupt, f"corrupt record: {cfg.corrupt_record_column} holds its raw text (a value that did "
                                "not parse as its schema type, or a malformed line)"))
    checks += [(f"{col(c)} IS NULL", f"null key column {c}") for c in cfg.key]
    # The index knows where a key lives: a delete needs no partition (global scope: the
    # keyspace says; partitioned scope: sink.tagging.placement looks in every partition). A history
    # table in partitioned scope places every event by its own partition.
    located = cfg.scd_type == 1 or cfg.scope == "global"
    upsert = f" AND NOT {_delete_sql(cfg)}" if cfg.delete_when and located else ""
    for c in cfg.partition_by:
        checks.append((f"{col(c)} IS NULL{upsert}", f"{NULL_PARTITION} {c}"))
        if isinstance(schema[c].dataType, StringType):
            checks.append((f"{col(c)} = ''", f"empty partition value {c} (Delta stores it as NULL)"))
    checks += [(f"{col(c)} IS NULL", f"null ordering column {c}") for c in stream_ordering(cfg)]
    if cfg.quarantine_when:
        checks.append((f"coalesce(({cfg.quarantine_when}), false)", f"quarantine_when: {cfg.quarantine_when}"))
    for label, expr in constraints.items():
        checks.append((f"NOT {_delete_sql(cfg)} AND NOT coalesce(({expr}), false)", violation(label, expr)))
    whens = " ".join(f"WHEN {failed} THEN {sql_string(why)}" for failed, why in checks)
    if corrupt:
        # A source that says why a value did not decode does so in the text's first line.
        text = col(cfg.corrupt_record_column)
        whens = (f"WHEN {corrupt} AND startswith({text}, {sql_string(CANNOT_DECODE)}) THEN "
                 f"concat('corrupt record: ', substring_index({text}, '\\n', 1)) {whens}")
    return f"CASE {whens} ELSE CAST(NULL AS STRING) END"


def violation(label: str, expression: str) -> str:
    """The quarantine reason of an upsert breaking the table's check `label`."""
    return f"{label} ({expression}) violated"


def stream_ordering(cfg: SinkConfig) -> list[str]:
    """The stream's names of the ordering columns of a config `as_stored`."""
    names = [c.removeprefix(HIDDEN_ORDERING_PREFIX) for c in cfg.ordering_columns]
    return [n if n in cfg.except_columns else c for n, c in zip(names, cfg.ordering_columns)]


def _delete_sql(cfg: SinkConfig) -> str:
    return f"coalesce(({cfg.delete_when}), false)" if cfg.delete_when else "false"


def prepare(df: DataFrame, cfg: SinkConfig, num_shards: int, *, file_column: str | None = None,
            with_key: bool = True, constraints: Mapping[str, str] = {}) -> DataFrame:
    """Add the helper columns: scan sequence and input file, quarantine reason, encoded key, shard,
    ordering values as BIGINT (one per ordering column) and the delete flag. One selectExpr:
    building the plan column by column costs a py4j round trip per expression (~0.05 s a batch).
    `with_key=False` leaves the encoded key out, for a batch collected as Arrow, where
    `keys.encode_keys` makes it from the key columns at a fraction of Spark's cost to compute
    and ship it (a single string key is the key column itself). `file_column`: SQL for the
    record's input file (`SessionKind.file_column`); None leaves it out, for a batch not tagged.
    `constraints`: the table's row checks upserts are quarantined for breaking."""
    key_expr = keys.spark_key_expr(cfg.key)
    orderings = [f"{keys.spark_ordering_expr(c, df.schema[c].dataType.typeName())} AS {helper}"
                 for c, helper in zip(cfg.ordering_columns, helper_columns(len(cfg.ordering_columns)))]
    # Scan sequence and input file give the arrival order that breaks ordering ties inside
    # a batch (sink.arrival); both are stable across re-evaluations of a file source's batch.
    return df.selectExpr(
        "*",
        f"monotonically_increasing_id() AS {C.SEQ}",
        *([f"{file_column} AS {C.FILE}"] if file_column else []),
        f"{quarantine_reason(cfg, df.schema, constraints)} AS {C.REASON}",
        *([f"{key_expr} AS {C.KEY}"] if with_key else []),
        f"{keys.spark_shard_expr(key_expr, num_shards)} AS {C.SHARD}",
        *orderings,
        f"{_delete_sql(cfg)} AS {C.DELETE}",
    )


def tagged_schema(stream_schema: StructType, ordering_width: int = 1) -> StructType:
    """What the tagging task returns: the stream's columns (nullable), the quarantine reason,
    the delete flag, encoded key, shard and ordering values (the driver's changelog needs
    them) and the tags."""
    fields = [StructField(f.name, f.dataType, True) for f in stream_schema.fields]
    fields += [
        StructField(C.REASON, StringType(), True),
        StructField(C.DELETE, BooleanType(), True),
        StructField(C.KEY, StringType(), True),
        StructField(C.SHARD, LongType(), True),
        *(StructField(c, LongType(), True) for c in helper_columns(ordering_width)),
        StructField(C.OP, StringType(), True),
        StructField(C.WRITE, StringType(), True),
        StructField(C.STORED_AT, StringType(), True),
        StructField(C.LOCATION, StringType(), True),
        StructField(C.HIT, BooleanType(), True),
        StructField(C.STATS, StringType(), True),
        StructField(C.PARTIAL, BooleanType(), True),
    ]
    return StructType(fields)


