"""Spark side of a batch: schema checks, and the helper columns routing and tagging need."""

from __future__ import annotations

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F
from pyspark.sql.types import BooleanType, LongType, StringType, StructField, StructType

from sink import columns as C
from sink import keys
from sink.config import SinkConfig
from sink.errors import SchemaError


def validate_schema(cfg: SinkConfig, schema: StructType) -> None:
    """Fail before the first batch when the config names columns the stream lacks."""
    types = {f.name: f.dataType.typeName() for f in schema.fields}
    roles = [("key", c, keys.KEY_TYPES) for c in cfg.key]
    roles += [("partition_by", c, keys.PARTITION_TYPES) for c in cfg.partition_by]
    roles.append(("ordering", cfg.ordering, keys.ORDERING_TYPES))
    for role, col, accepted in roles:
        if col not in types:
            raise SchemaError(
                f"{role} column {col!r} is not in the stream; the stream's columns are {sorted(types)}"
            )
        if types[col] not in accepted:
            raise SchemaError(
                f"{role} column {col!r} has type {types[col]}; accepted types: {list(accepted)}"
            )
    clashing = [n for n in types if n.startswith(C.PREFIX)]
    if clashing:
        raise SchemaError(f"column(s) {clashing} use the sink's reserved prefix {C.PREFIX!r}")


def validate_stream(cfg: SinkConfig, df: DataFrame) -> None:
    """`validate_schema` plus analysis of `delete_when` against the stream's columns."""
    validate_schema(cfg, df.schema)
    if cfg.delete_when:
        try:
            result = df.select(F.expr(cfg.delete_when)).schema.fields[0].dataType
        except Exception as e:
            raise SchemaError(f"delete_when = {cfg.delete_when!r} does not apply to the stream: {e}") from e
        if not isinstance(result, BooleanType):
            raise SchemaError(
                f"delete_when = {cfg.delete_when!r} must be a boolean expression, it gives {result.typeName()}"
            )


def quarantine_reason(cfg: SinkConfig, schema: StructType) -> Column:
    """Why a record cannot be written (NULL when it can), first failing check wins. An empty
    string partition value is refused too: Delta stores it as NULL, so the row would not
    come back under the value it was written with."""
    checks = [(F.col(c).isNull(), f"null key column {c}") for c in cfg.key]
    # In global scope the index knows where a key lives: a delete needs no partition.
    upsert = ~F.coalesce(F.expr(cfg.delete_when), F.lit(False)) if cfg.scope == "global" and cfg.delete_when \
        else F.lit(True)
    for c in cfg.partition_by:
        checks.append((F.col(c).isNull() & upsert, f"null partition column {c}"))
        if isinstance(schema[c].dataType, StringType):
            checks.append((F.col(c) == F.lit(""), f"empty partition value {c} (Delta stores it as NULL)"))
    checks.append((F.col(cfg.ordering).isNull(), f"null ordering column {cfg.ordering}"))
    reason = F.lit(None).cast(StringType())
    for failed, why in reversed(checks):
        reason = F.when(failed, F.lit(why)).otherwise(reason)
    return reason


def prepare(df: DataFrame, cfg: SinkConfig, num_shards: int) -> DataFrame:
    """Add the helper columns: scan sequence and input file, quarantine reason, encoded key, shard,
    ordering as BIGINT and the delete flag."""
    key_expr = keys.spark_key_expr(cfg.key)
    ordering_type = df.schema[cfg.ordering].dataType.typeName()
    delete = F.coalesce(F.expr(cfg.delete_when), F.lit(False)) if cfg.delete_when else F.lit(False)
    # Scan sequence and input file give the arrival order that breaks ordering ties inside
    # a batch (sink.arrival); both are stable across re-evaluations of a file source's batch.
    return df.select(
        "*",
        F.monotonically_increasing_id().alias(C.SEQ),
        F.xxhash64(F.input_file_name()).alias(C.FILE),
        quarantine_reason(cfg, df.schema).alias(C.REASON),
        F.expr(key_expr).alias(C.KEY),
        F.expr(keys.spark_shard_expr(key_expr, num_shards)).alias(C.SHARD),
        F.expr(keys.spark_ordering_expr(cfg.ordering, ordering_type)).alias(C.ORDERING),
        delete.alias(C.DELETE),
    )


def tagged_schema(stream_schema: StructType) -> StructType:
    """What the tagging task returns: the stream's columns (nullable), the quarantine reason,
    the delete flag, encoded key, shard and ordering value (the driver's changelog needs
    them) and the tags."""
    fields = [StructField(f.name, f.dataType, True) for f in stream_schema.fields]
    fields += [
        StructField(C.REASON, StringType(), True),
        StructField(C.DELETE, BooleanType(), True),
        StructField(C.KEY, StringType(), True),
        StructField(C.SHARD, LongType(), True),
        StructField(C.ORDERING, LongType(), True),
        StructField(C.OP, StringType(), True),
        StructField(C.WRITE, StringType(), True),
        StructField(C.STORED_AT, StringType(), True),
        StructField(C.LOCATION, StringType(), True),
        StructField(C.HIT, BooleanType(), True),
        StructField(C.STATS, StringType(), True),
    ]
    return StructType(fields)


