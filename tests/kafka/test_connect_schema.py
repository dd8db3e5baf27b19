"""schema_from_messages: the Kafka Connect schemas a batch's messages carry, as Spark types."""

import json

import pytest
from pyspark.sql.types import (
    ArrayType,
    BinaryType,
    DoubleType,
    IntegerType,
    LongType,
    MapType,
    StringType,
    StructField,
    StructType,
    TimestampNTZType,
)

from jobs.connect_types import connect_type
from jobs.job_config import SourceConfig
from jobs.kafka_source import message_schemas, message_type, schema_groups, widened
from sink.errors import ConfigError

# Debezium's envelope schema for a PostgreSQL table (id INT, name TEXT, amount NUMERIC as
# decimal.handling.mode = string, tier TEXT added later), as the JSON converter wraps it.
ROW = {"type": "struct", "optional": True, "fields": [
    {"type": "int32", "optional": False, "field": "id"},
    {"type": "string", "optional": True, "field": "name"},
    {"type": "string", "optional": True, "field": "amount"},
    {"type": "string", "optional": True, "field": "tier"},
    {"type": "int64", "optional": True, "name": "io.debezium.time.MicroTimestamp", "field": "seen"},
    {"type": "array", "optional": True, "items": {"type": "float64"}, "field": "scores"},
    {"type": "map", "optional": True, "keys": {"type": "string"}, "values": {"type": "bytes"}, "field": "tags"}]}
ENVELOPE = {"type": "struct", "name": "cdc.public.customers.Envelope", "fields": [
    {**ROW, "field": "before"}, {**ROW, "field": "after"},
    {"type": "struct", "field": "source", "fields": [{"type": "int64", "optional": True, "field": "lsn"},
                                                    {"type": "string", "optional": False, "field": "db"}]},
    {"type": "string", "optional": False, "field": "op"},
    {"type": "int64", "optional": True, "field": "ts_ms"}]}
ROW_TYPE = StructType([
    StructField("id", IntegerType()), StructField("name", StringType()), StructField("amount", StringType()),
    StructField("tier", StringType()), StructField("seen", TimestampNTZType()),
    StructField("scores", ArrayType(DoubleType())), StructField("tags", MapType(StringType(), BinaryType()))])


def test_connect_types_become_sparks_and_unknown_ones_strings():
    assert connect_type(ROW) == ROW_TYPE
    assert connect_type({"type": "something-new"}) == StringType()


def test_widening_adds_the_fields_the_messages_carry_and_keeps_the_declared_types():
    declared = StructType([StructField("op", StringType()),
                           StructField("after", StructType([StructField("id", LongType())]))])
    assert LongType() != ROW_TYPE["id"].dataType
    out = widened(declared, connect_type(ENVELOPE), ("before", "after"))
    # `id` keeps the declared BIGINT; the envelope's other top-level fields are not added.
    assert out.fieldNames() == ["op", "after"]
    assert out["after"].dataType == StructType([StructField("id", LongType()), *ROW_TYPE.fields[1:]])
    assert widened(StructType([StructField("id", LongType())]), ROW_TYPE).fieldNames() == ROW_TYPE.fieldNames()


@pytest.mark.spark
def test_a_batchs_schema_is_the_union_of_its_messages_schemas(spark):
    old = {"type": "struct", "fields": [ROW["fields"][0], ROW["fields"][1]]}
    values = [json.dumps({"schema": old, "payload": {"id": 1, "name": "a"}}),
              json.dumps({"schema": ROW, "payload": {"id": 2, "name": "b", "tier": "gold"}}),
              "{not json", None]
    raw = spark.createDataFrame([(None if v is None else bytearray(v.encode()),) for v in values], "value BINARY")
    assert message_type(schema_groups(message_schemas(raw)[0])) == ROW_TYPE


@pytest.mark.parametrize("options", [{"format": "json", "path": "/tmp/x"},
                                     {"format": "kafka", "bootstrap_servers": "b:9092", "topics": ["t"]}])
def test_schema_from_messages_needs_the_converters_wrapper(options):
    with pytest.raises(ConfigError, match="source.schema_from_messages .* needs format = 'kafka' and "
                                          "value_format = 'json-with-schema'"):
        SourceConfig(schema="id INT", schema_from_messages=True, **options)


def test_source_schema_is_optional_only_where_messages_carry_their_schema(tmp_path):
    with pytest.raises(ConfigError, match="source.schema is required .* but with format = 'kafka' and value_format "
                                          "= 'json-with-schema'"):
        SourceConfig(format="kafka", bootstrap_servers="b:9092", topics=["t"])
    assert SourceConfig(format="kafka", bootstrap_servers="b:9092", topics=["t"], value_format="json-with-schema",
                        envelope="debezium").widens


def test_a_debezium_table_without_a_key_takes_it_from_the_message_keys(tmp_path):
    from jobs.job_config import KEY_FROM_MESSAGES, load_job_config

    conf = tmp_path / "sink.toml"
    conf.write_text('[[sink]]\ntable_uri = "t"\nordering = "lsn"\ncheckpoint_dir = "c"\n'
                    '[source]\nformat = "kafka"\nbootstrap_servers = "b:9092"\ntopics = ["cdc.public.t"]\n'
                    'envelope = "debezium"\nvalue_format = "json-with-schema"\n')
    (sink,) = load_job_config(conf).sinks
    assert sink.key == [KEY_FROM_MESSAGES]  # the job reads it once Spark runs (jobs.upsert_stream.resolved)
    conf.write_text(conf.read_text().replace('envelope = "debezium"\n', 'schema = "id INT"\n'))
    with pytest.raises(ConfigError, match="key"):
        load_job_config(conf)
