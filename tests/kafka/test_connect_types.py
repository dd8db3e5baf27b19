"""Connect's logical types decoded as Debezium sends them at its defaults (precise decimals,
adaptive time precision), against values computed here by Python from the same inputs."""

import base64
import datetime as dt
import json
import random
from decimal import Context, Decimal

import pytest
from pyspark.sql.types import (
    ArrayType,
    BinaryType,
    DateType,
    DecimalType,
    LongType,
    StringType,
    StructField,
    StructType,
    TimestampNTZType,
    TimestampType,
)

from jobs import connect_types
from jobs.kafka_source import decoded, message_schemas, message_type, schema_groups
from sink.routing import CANNOT_DECODE

EPOCH = dt.datetime(1970, 1, 1)


def decimal_schema(field: str, precision: int, scale: int) -> dict:
    return {"type": "bytes", "optional": True, "name": connect_types.DECIMAL, "version": 1, "field": field,
            "parameters": {"scale": str(scale), "connect.decimal.precision": str(precision)}}


VSD = {"type": "struct", "optional": True, "name": connect_types.VARIABLE_SCALE_DECIMAL, "field": "loose",
       "fields": [{"type": "int32", "optional": False, "field": "scale"},
                  {"type": "bytes", "optional": False, "field": "value"}]}
ROW = {"type": "struct", "optional": True, "name": "cdc.public.t.Value", "fields": [
    {"type": "int32", "optional": False, "field": "id"},
    decimal_schema("amount", 18, 6),
    decimal_schema("wide", 38, 10),
    decimal_schema("huge", 50, 4),
    VSD,
    {"type": "int32", "optional": True, "name": "io.debezium.time.Date", "field": "born"},
    {"type": "int64", "optional": True, "name": "io.debezium.time.MicroTimestamp", "field": "seen"},
    {"type": "int64", "optional": True, "name": "io.debezium.time.Timestamp", "field": "seen_ms"},
    {"type": "string", "optional": True, "name": "io.debezium.time.ZonedTimestamp", "field": "at"},
    {"type": "int64", "optional": True, "name": "io.debezium.time.MicroTime", "field": "clock"},
    {"type": "string", "optional": True, "name": "io.debezium.data.Json", "field": "doc"},
    {"type": "string", "optional": True, "name": "io.debezium.data.Uuid", "field": "uid"},
    {"type": "bytes", "optional": True, "field": "blob"},
    {"type": "int64", "optional": True, "name": "io.debezium.time.MicroDuration", "field": "span"},
    {"type": "boolean", "optional": True, "field": "flag"},
    {"type": "array", "optional": True, "items": {"type": "string", "optional": True}, "field": "tags"},
    {"type": "array", "optional": True, "items": {**decimal_schema("x", 10, 2), "optional": True}, "field": "prices"},
]}


def unscaled_b64(value: int) -> str:
    """Connect's Decimal: the unscaled value's minimal big-endian two's-complement bytes."""
    length = max(1, (value + (value < 0)).bit_length() // 8 + 1)
    return base64.b64encode(value.to_bytes(length, "big", signed=True)).decode()


def exact(unscaled: int, scale: int) -> Decimal:
    return Decimal(unscaled).scaleb(-scale, Context(prec=100))  # the default context rounds to 28 digits


def random_unscaled(rng: random.Random, digits: int) -> int:
    edges = [0, 1, -1, 127, 128, -128, -129, 255, 256, 2**63 - 1, -(2**63), 2**63, 2**64, -(2**64) - 1,
             10**digits - 1, -(10**digits - 1)]
    pick = rng.choice(edges) if rng.random() < 0.4 else rng.randrange(-(10**digits) + 1, 10**digits)
    return max(min(pick, 10**digits - 1), -(10**digits - 1))


def message(payload: dict) -> str:
    envelope = {"type": "struct", "name": "cdc.public.t.Envelope", "fields": [
        {**ROW, "field": "before"}, {**ROW, "field": "after"}, {"type": "string", "optional": False, "field": "op"}]}
    return json.dumps({"schema": envelope, "payload": {"before": None, "after": payload, "op": "c"}})


def decoded_messages(spark, payloads: list[dict]) -> list:
    """Debezium creates of `payloads` decoded as the job does a batch, by their id."""
    raw = spark.createDataFrame([(bytearray(message(p).encode()),) for p in payloads], "value BINARY") \
        .selectExpr("value", "'t' AS topic", "0 AS partition", "monotonically_increasing_id() AS offset")
    (group,) = schema_groups(message_schemas(raw)[0])
    after = message_type([group])["after"].dataType
    schema = StructType([StructField("op", StringType()), StructField("after", after)])
    return decoded(raw, schema, value_format="json-with-schema", key_schema=None, corrupt_column="_corrupt",
                   connect=group.merged).orderBy("after.id").collect()


def test_the_natural_types_of_debeziums_logical_types():
    types = {f.name: f.dataType for f in connect_types.connect_type(ROW).fields}
    assert types["amount"] == DecimalType(18, 6) and types["wide"] == DecimalType(38, 10)
    assert types["huge"] == types["loose"] == StringType()  # beyond 38 digits, variable scale: exact text
    assert (types["born"], types["seen"], types["at"]) == (DateType(), TimestampNTZType(), TimestampType())
    assert (types["clock"], types["doc"], types["blob"], types["span"]) == (StringType(), StringType(), BinaryType(),
                                                                          LongType())
    assert types["tags"] == ArrayType(StringType()) and types["prices"] == ArrayType(DecimalType(10, 2))


def test_schemas_that_decode_a_field_differently_do_not_merge():
    narrow = {"type": "struct", "fields": [decimal_schema("amount", 10, 2)]}
    wider = {"type": "struct", "fields": [decimal_schema("amount", 12, 4), {"type": "string", "field": "note"}]}
    added = {"type": "struct", "fields": [{**decimal_schema("amount", 10, 2), "optional": False},
                                          {"type": "string", "field": "note"}]}
    assert connect_types.merged([narrow, added])["fields"][1]["field"] == "note"
    with pytest.raises(connect_types.SchemaConflictError, match="'amount' is bytes .*scale=2.* and .*scale=4"):
        connect_types.merged([narrow, wider])
    groups = schema_groups([("a", narrow), ("b", wider), ("c", added)])
    assert [g.texts for g in groups] == [["a", "c"], ["b"]]


@pytest.mark.spark
def test_every_logical_type_decodes_to_the_value_python_computes(spark):
    rng = random.Random(69)
    payloads, expected = [], []
    for i in range(300):
        amount, wide, huge, loose = (random_unscaled(rng, 18), random_unscaled(rng, 38), random_unscaled(rng, 38),
                                     random_unscaled(rng, 30))
        loose_scale = rng.randrange(0, 12)
        days, micros = rng.randrange(-40_000, 40_000), rng.randrange(-(2**52), 2**52)
        clock = rng.randrange(0, 86_400_000_000)
        blob = rng.randbytes(rng.randrange(0, 40))
        prices = [None if rng.random() < 0.2 else rng.randrange(-10**9, 10**9) for _ in range(rng.randrange(0, 4))]
        at = EPOCH + dt.timedelta(microseconds=micros)
        payloads.append({
            "id": i, "amount": unscaled_b64(amount), "wide": unscaled_b64(wide), "huge": unscaled_b64(huge),
            "loose": {"scale": loose_scale, "value": unscaled_b64(loose)}, "born": days, "seen": micros,
            "seen_ms": micros // 1000, "at": at.isoformat() + "+02:00", "clock": clock,
            "doc": json.dumps({"k": [i, None]}), "uid": f"00000000-0000-0000-0000-{i:012d}",
            "blob": base64.b64encode(blob).decode(), "span": -micros, "flag": i % 2 == 0,
            "tags": ["a", None, f"t{i}"], "prices": [None if p is None else unscaled_b64(p) for p in prices]})
        expected.append({
            "id": i, "amount": exact(amount, 6), "wide": exact(wide, 10), "huge": str(exact(huge, 4)),
            "loose": exact(loose, loose_scale), "born": dt.date(1970, 1, 1) + dt.timedelta(days=days),
            "seen": at, "seen_ms": EPOCH + dt.timedelta(milliseconds=micros // 1000),
            "at": at - dt.timedelta(hours=2), "clock": (EPOCH + dt.timedelta(microseconds=clock)).strftime(
                "%H:%M:%S.%f"), "doc": json.dumps({"k": [i, None]}), "uid": f"00000000-0000-0000-0000-{i:012d}",
            "blob": blob, "span": -micros, "flag": i % 2 == 0, "tags": ["a", None, f"t{i}"],
            "prices": [None if p is None else exact(p, 2) for p in prices]})
    rows = decoded_messages(spark, payloads)
    assert [r["_corrupt"] for r in rows] == [None] * len(rows)
    got = [r["after"].asDict() for r in rows]
    for g in got:  # VariableScaleDecimal and wide decimals are exact text
        g["loose"] = Decimal(g["loose"])
        g["blob"] = bytes(g["blob"])
    assert got == expected


@pytest.mark.spark
def test_a_value_that_does_not_decode_names_its_column_type_and_value(spark):
    good = {"id": 1, "amount": unscaled_b64(5), "born": 3}
    bad = {"id": 2, "amount": "not base64!", "born": 4}
    too_big = {"id": 3, "amount": unscaled_b64(10**18), "born": 5}  # 19 digits in DECIMAL(18, 6)
    rows = decoded_messages(spark, [good, bad, too_big])
    assert rows[0]["_corrupt"] is None and rows[0]["after"]["amount"] == Decimal("0.000005")
    decimal = "bytes org.apache.kafka.connect.data.Decimal(connect.decimal.precision=18, scale=6)"
    assert rows[1]["_corrupt"].split("\n")[0] == f"{CANNOT_DECODE} column after.amount ({decimal}) value not base64!"
    assert rows[2]["_corrupt"].split("\n")[0] == (f"{CANNOT_DECODE} column after.amount ({decimal}) value "
                                                  f"{unscaled_b64(10**18)}")
    origin, text = rows[1]["_corrupt"].split("\n")[1].split(": ", 1)
    assert origin.startswith("kafka topic t partition 0 offset ") and json.loads(text)["payload"]["after"] == bad
