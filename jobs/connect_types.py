"""Kafka Connect's schemas as Spark types, and the SQL that decodes a value as Connect's JSON
converter writes it into the value a user expects (Debezium at its defaults).

Connect's JSON converter writes a logical type in its primitive's form: a `Decimal` as the
base64 of its unscaled value's big-endian two's-complement bytes, a `Date` as days since
1970, a `MicroTimestamp` as epoch microseconds. Each message carries its schema, which names
the logical type; the job reads a batch's schemas once, then every value of a field is parsed
in its wire form (`Decoding.wire`) and decoded by Spark SQL (no Python per record).

| Connect schema | Spark type |
|---|---|
| `org.apache.kafka.connect.data.Decimal` (precision <= 38, 0 <= scale <= precision) | `DECIMAL(p,s)` |
| `Decimal` otherwise, `io.debezium.data.VariableScaleDecimal` | `STRING`: the exact decimal text |
| `io.debezium.time.Date`, Connect `Date` | `DATE` |
| `io.debezium.time.Timestamp` / `MicroTimestamp` / `NanoTimestamp`, Connect `Timestamp` | `TIMESTAMP_NTZ` |
| `io.debezium.time.ZonedTimestamp` | `TIMESTAMP` (the instant) |
| `Time` / `MicroTime` / `NanoTime`, Connect `Time` | `STRING` `HH:mm:ss.SSSSSS` (Delta has no time type) |
| `io.debezium.time.ZonedTime`, `Json`, `Uuid`, `Enum`, `EnumSet`, `Xml`, `Ltree`, `Interval` | `STRING` as sent |
| `io.debezium.time.MicroDuration` | `BIGINT` microseconds |
| `bytes`, `io.debezium.data.Bits` | `BINARY` |
| `int8`..`int64`, `float32`, `float64`, `boolean`, `string` | `TINYINT`..`BIGINT`, `FLOAT`, `DOUBLE`, ... |
| `struct`, `array`, `map` | theirs, their parts decoded alike |
| anything else | `STRING`: the JSON text |

`Json` stays STRING, not VARIANT: a VARIANT column adds the `variantType` feature to the
Delta table's protocol, which locks out every reader without it.

A declared type (the job's `source.schema`, or the Delta table's column) wins over the
natural one: the decoded value is cast to it (`try_cast`; bytes to STRING keep their base64
text). A value that does not decode, or does not fit the declared type, is a decode failure:
the record goes to quarantine with the column, its Connect type and its raw value.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from pyspark.sql.types import (
    ArrayType,
    BinaryType,
    BooleanType,
    ByteType,
    DataType,
    DateType,
    DecimalType,
    DoubleType,
    FloatType,
    IntegerType,
    LongType,
    MapType,
    ShortType,
    StringType,
    StructField,
    StructType,
    TimestampNTZType,
    TimestampType,
)

from sink.keys import quoted_column

PRIMITIVES = {"int8": ByteType(), "int16": ShortType(), "int32": IntegerType(), "int64": LongType(),
              "float32": FloatType(), "float64": DoubleType(), "boolean": BooleanType(), "string": StringType(),
              "bytes": BinaryType()}
DECIMAL = "org.apache.kafka.connect.data.Decimal"
VARIABLE_SCALE_DECIMAL = "io.debezium.data.VariableScaleDecimal"
# Spark's DECIMAL holds 38 digits; an unscaled value of up to 16 bytes fits in two 64-bit halves.
MAX_DIGITS, MAX_BYTES = 38, 16
EPOCH_NTZ = "TIMESTAMP_NTZ'1970-01-01 00:00:00'"
# Logical types sent as text, and kept as such.
TEXTS = ("io.debezium.time.ZonedTime", "io.debezium.data.Json", "io.debezium.data.Uuid", "io.debezium.data.Enum",
         "io.debezium.data.EnumSet", "io.debezium.data.Xml", "io.debezium.data.Ltree", "io.debezium.time.Interval")
# Epoch offsets: the unit Spark's timestampadd takes, and SQL of the count in it.
TIMESTAMPS = {"io.debezium.time.Timestamp": ("MILLISECOND", "{}"),
              "org.apache.kafka.connect.data.Timestamp": ("MILLISECOND", "{}"),
              "io.debezium.time.MicroTimestamp": ("MICROSECOND", "{}"),
              "io.debezium.time.NanoTimestamp": ("MICROSECOND", "({0} - pmod({0}, 1000)) div 1000")}
TIMES = {"io.debezium.time.Time": "{} * 1000L", "org.apache.kafka.connect.data.Time": "{} * 1000L",
         "io.debezium.time.MicroTime": "{}", "io.debezium.time.NanoTime": "({0} - pmod({0}, 1000)) div 1000"}
DATES = ("io.debezium.time.Date", "org.apache.kafka.connect.data.Date")
# What a schema says beyond how its value is decoded.
_NOT_DECODING = ("field", "optional", "default", "doc", "version")


@dataclass(frozen=True)
class Decoding:
    """One Connect value's way into Spark: `wire`, the type JSON is read as; `sql`, the decoded
    value from the wire value's SQL (None: the wire value is it); `type`, what that gives."""

    type: DataType
    wire: DataType
    label: str
    sql: Callable[[str], str] | None = None


def label(schema: dict) -> str:
    """A Connect schema as an operator reads it: `bytes org.apache.kafka.connect.data.Decimal(scale=6, ...)`."""
    text = schema.get("type", "?")
    if schema.get("name"):
        text += f" {schema['name']}"
    if schema.get("parameters"):
        text += "(" + ", ".join(f"{k}={v}" for k, v in sorted(schema["parameters"].items())) + ")"
    return text


def decoding(schema: dict) -> Decoding:
    """How a value of Connect `schema` (a primitive or logical type; structs, arrays and maps are
    `planned` field by field) is read and decoded."""
    kind, name, text = schema.get("type"), schema.get("name"), label(schema)
    params = schema.get("parameters") or {}
    if name == DECIMAL:
        return _decimal(params, text)
    if name == VARIABLE_SCALE_DECIMAL:
        wire = StructType([StructField("scale", IntegerType()), StructField("value", StringType())])
        return Decoding(StringType(), wire, text, lambda e: _decimal_text(_unscaled(f"{e}.value"), f"{e}.scale"))
    if name in DATES:
        return Decoding(DateType(), IntegerType(), text, lambda e: f"date_from_unix_date({e})")
    if name in TIMESTAMPS:
        unit, count = TIMESTAMPS[name]
        return Decoding(TimestampNTZType(), LongType(), text,
                        lambda e: f"timestampadd({unit}, {count.format(e)}, {EPOCH_NTZ})")
    if name == "io.debezium.time.ZonedTimestamp":
        return Decoding(TimestampType(), StringType(), text, lambda e: f"try_cast({e} AS TIMESTAMP)")
    if name in TIMES:
        micros = TIMES[name]
        return Decoding(StringType(), LongType(), text, lambda e: (
            f"date_format(timestampadd(MICROSECOND, {micros.format(e)}, {EPOCH_NTZ}), 'HH:mm:ss.SSSSSS')"))
    if name in TEXTS:
        return Decoding(StringType(), StringType(), text)
    if kind == "bytes":  # io.debezium.data.Bits too: the bits' bytes as sent
        return Decoding(BinaryType(), StringType(), text, lambda e: f"try_to_binary({e}, 'base64')")
    if kind in PRIMITIVES:
        return Decoding(PRIMITIVES[kind], PRIMITIVES[kind], text)
    return Decoding(StringType(), StringType(), text)  # Spark reads any JSON value as its text


def _decimal(params: dict, text: str) -> Decoding:
    scale = int(params.get("scale", 0))
    precision = params.get("connect.decimal.precision")
    if precision is not None and 0 <= scale <= int(precision) <= MAX_DIGITS:
        p = int(precision)
        return Decoding(DecimalType(p, scale), StringType(), text,
                        lambda e: f"try_cast(concat({_unscaled(e, p)}, 'E-', {scale}) AS DECIMAL({p}, {scale}))")
    return Decoding(StringType(), StringType(), text, lambda e: _decimal_text(_unscaled(e), str(scale)))


def _unscaled(b64: str, digits: int = MAX_DIGITS) -> str:
    """SQL of the decimal text of a base64 big-endian two's-complement integer of `digits`
    digits at most (null beyond 16 bytes). Up to 18 digits it fits 8 bytes, which conv reads
    as a signed 64-bit number once sign-extended; beyond, a negative one's bytes are
    complemented (-(~v) - 1), so both 8-byte halves read as unsigned by conv and the sum stays
    within DECIMAL(38, 0)."""
    h = f"hex(try_to_binary({b64}, 'base64'))"
    negative = f"substr({h}, 1, 1) >= '8'"
    if digits <= 18:
        extended = f"lpad({h}, 16, CASE WHEN {negative} THEN 'F' ELSE '0' END)"
        return f"CASE WHEN length({h}) BETWEEN 1 AND 16 THEN conv({extended}, 16, -10) END"
    digits = f"lpad(CASE WHEN {negative} THEN translate({h}, '0123456789ABCDEF', 'FEDCBA9876543210') ELSE {h} END, " \
             f"32, '0')"
    magnitude = (f"try_add(try_multiply(CAST(conv(substr({digits}, 1, 16), 16, 10) AS DECIMAL(38, 0)), "
                 f"18446744073709551616BD), CAST(conv(substr({digits}, 17, 16), 16, 10) AS DECIMAL(38, 0)))")
    # The sign as text: Spark's negation of a DECIMAL(38, 0) near 10^38 overflows wrongly.
    value = f"concat(CASE WHEN {negative} THEN '-' ELSE '' END, CAST(try_add({magnitude}, " \
            f"CASE WHEN {negative} THEN 1 ELSE 0 END) AS STRING))"
    return f"CASE WHEN length({h}) BETWEEN 1 AND {2 * MAX_BYTES} THEN {value} END"


def _decimal_text(unscaled: str, scale: str) -> str:
    """SQL of a decimal's exact text from its unscaled integer's text and its scale."""
    sign = f"CASE WHEN {unscaled} LIKE '-%' THEN '-' ELSE '' END"
    magnitude = f"TRIM(LEADING '-' FROM {unscaled})"
    digits = f"lpad({magnitude}, greatest(length({magnitude}), {scale} + 1), '0')"  # lpad cuts a longer text
    point = (f"concat({sign}, substr({digits}, 1, length({digits}) - {scale}), '.', "
             f"substr({digits}, length({digits}) - {scale} + 1))")
    return (f"CASE WHEN {unscaled} IS NULL THEN NULL WHEN {scale} <= 0 THEN concat({unscaled}, "
            f"repeat('0', -{scale})) ELSE {point} END")


def connect_type(schema: dict) -> DataType:
    """A Connect schema's natural Spark type (the table at the top of this module)."""
    kind = schema.get("type")
    if kind == "struct" and schema.get("name") != VARIABLE_SCALE_DECIMAL:
        return StructType([StructField(f["field"], connect_type(f), True) for f in schema.get("fields", [])])
    if kind == "array":
        return ArrayType(connect_type(schema.get("items", {})), True)
    if kind == "map":
        return MapType(connect_type(schema.get("keys", {})), connect_type(schema.get("values", {})), True)
    return decoding(schema).type


@dataclass
class Failure:
    """A decoded value that may fail: its column's path, Connect type, the SQL true where it
    failed, and the SQL of its raw value; `wire` and `names`, where it is no array's or map's
    part: the SQL of its wire value and the field names that lead to it from the top-level
    column, so that its failure can be told from the decoded column (decoded once)."""

    path: str
    connect: str
    failed: str
    raw: str
    wire: str | None = None
    names: tuple[str, ...] | None = None

    def failed_in(self, decoded: str) -> str:
        """SQL true where it failed, `decoded` being the decoded top-level column's SQL."""
        if self.names is None:
            return self.failed
        value = ".".join([decoded, *map(quoted_column, self.names)])
        return f"({self.wire} IS NOT NULL AND {value} IS NULL)"


@dataclass
class Planned:
    """A value's wire type and the SQL of its decoded value (`sql`, from the wire value's)."""

    wire: DataType
    sql: str
    failures: list[Failure] = field(default_factory=list)


def planned(expr: str, target: DataType, schema: dict | None, path: str, depth: int = 0,
            names: tuple[str, ...] | None = ()) -> Planned:
    """How the value at SQL `expr`, of Connect `schema` (None: the messages do not say), is read
    and becomes `target`, its failures named by `path` (`names`: the fields from the top-level
    column to it; None inside an array or map)."""
    if schema is None:
        return Planned(target, expr)
    kind = schema.get("type")
    if isinstance(target, StructType) and kind == "struct" and schema.get("name") != VARIABLE_SCALE_DECIMAL:
        by_name = {f["field"]: f for f in schema.get("fields", [])}
        parts = [(f, planned(f"{expr}.{quoted_column(f.name)}", f.dataType, by_name.get(f.name), f"{path}.{f.name}",
                             depth, None if names is None else (*names, f.name))) for f in target.fields]
        wire = StructType([StructField(f.name, p.wire, True) for f, p in parts])
        failures = [x for _, p in parts for x in p.failures]
        if all(p.sql == f"{expr}.{quoted_column(f.name)}" for f, p in parts):
            return Planned(wire, expr, failures)
        fields = ", ".join(f"{_literal(f.name)}, {p.sql}" for f, p in parts)
        return Planned(wire, f"CASE WHEN {expr} IS NULL THEN NULL ELSE named_struct({fields}) END", failures)
    if isinstance(target, ArrayType) and kind == "array":
        var = f"x{depth}"
        item = planned(var, target.elementType, schema.get("items"), f"{path}[]", depth + 1, None)
        failures = [Failure(f.path, f.connect, f"coalesce(exists({expr}, {var} -> {f.failed}), false)",
                            f"to_json({expr})") for f in item.failures]
        sql = expr if item.sql == var else f"transform({expr}, {var} -> {item.sql})"
        return Planned(ArrayType(item.wire, True), sql, failures)
    if isinstance(target, MapType) and kind == "map":
        k, v = f"k{depth}", f"v{depth}"
        value = planned(v, target.valueType, schema.get("values"), f"{path}{{}}", depth + 1, None)
        failures = [Failure(f.path, f.connect, f"coalesce(exists(map_values({expr}), {v} -> {f.failed}), false)",
                            f"to_json({expr})") for f in value.failures]
        sql = expr if value.sql == v else f"transform_values({expr}, ({k}, {v}) -> {value.sql})"
        return Planned(MapType(target.keyType, value.wire, True), sql, failures)
    return _leaf(expr, target, schema, path, names)


def _leaf(expr: str, target: DataType, schema: dict, path: str, names: tuple[str, ...] | None) -> Planned:
    d = decoding(schema)
    if isinstance(target, StringType) and isinstance(d.type, BinaryType):
        return Planned(StringType(), expr)  # declared as text: the base64 text as sent
    if d.sql is None and target == d.type:
        return Planned(d.wire, expr)
    value = d.sql(expr) if d.sql else expr
    if target != d.type:
        value = f"CAST({value} AS STRING)" if isinstance(target, StringType) else \
            f"try_cast({value} AS {target.simpleString()})"
    raw = f"to_json({expr})" if isinstance(d.wire, StructType) else f"CAST({expr} AS STRING)"
    failure = Failure(path, d.label, f"({expr} IS NOT NULL AND ({value}) IS NULL)", raw, expr, names)
    return Planned(d.wire, value, [failure])


def _literal(text: str) -> str:
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def signature(schema: dict) -> dict:
    """`schema` without what does not change how its values decode (names of fields kept)."""
    out = {k: v for k, v in schema.items() if k not in _NOT_DECODING}
    if "fields" in out:
        out["fields"] = [{**signature(f), "field": f["field"]} for f in out["fields"]]
    for part in ("items", "keys", "values"):
        if part in out:
            out[part] = signature(out[part])
    return out


class SchemaConflictError(ValueError):
    """Two schemas give one field different decodings (a column's type changed at the source)."""


def merged(schemas: Iterable[dict]) -> dict | None:
    """One struct schema holding every field of `schemas` (structs), nested structs alike;
    SchemaConflictError where two decode a field differently. None: no schemas."""
    out = None
    for s in schemas:
        out = s if out is None else _merge(out, s)
    return out


def _merge(a: dict, b: dict) -> dict:
    if a.get("type") == "struct" == b.get("type") and a.get("name") == b.get("name") \
            and a.get("name") != VARIABLE_SCALE_DECIMAL:
        fields = {f["field"]: f for f in a.get("fields", [])}
        for f in b.get("fields", []):
            fields[f["field"]] = _merge(fields[f["field"]], f) if f["field"] in fields else f
        return {**a, "fields": list(fields.values())}
    if json.dumps(signature(a), sort_keys=True) != json.dumps(signature(b), sort_keys=True):
        raise SchemaConflictError(f"field {a.get('field')!r} is {label(a)} in one message and {label(b)} in another")
    return a
