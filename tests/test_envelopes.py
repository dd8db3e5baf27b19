"""The ready job's CDC envelopes, flattened into the sink's flat records."""

import pytest
from pyspark.sql.types import LongType, StringType, StructField, StructType, TimestampType

from jobs.envelopes import UNAVAILABLE_VALUE, debezium_select
from jobs.job_config import SourceConfig
from jobs.upsert_stream import for_debezium
from sink import SinkConfig
from sink.errors import ConfigError

ROW = StructType([StructField("shop_id", LongType()), StructField("order_id", LongType()),
                  StructField("status", StringType()), StructField("created at", TimestampType())])
KEY_ONLY = StructType([StructField("shop_id", LongType()), StructField("order_id", LongType())])


def envelope(before=ROW, after=ROW, source=True, **extra):
    fields = [StructField("op", StringType()), StructField("ts_ms", LongType()),
              StructField("before", before), StructField("after", after)]
    if source:
        fields.append(StructField("source", StructType([StructField("lsn", LongType()),
                                                        StructField("txId", LongType())])))
    return StructType(fields + [StructField(n, t) for n, t in extra.items()])


def test_debezium_rows_come_from_after_and_from_before_for_deletes():
    assert debezium_select(envelope(before=KEY_ONLY)) == [
        "CASE WHEN op = 'd' THEN before.`shop_id` ELSE after.`shop_id` END AS `shop_id`",
        "CASE WHEN op = 'd' THEN before.`order_id` ELSE after.`order_id` END AS `order_id`",
        # The default replica identity's deletes carry only the key: the rest is null.
        "CASE WHEN op = 'd' THEN NULL ELSE after.`status` END AS `status`",
        "CASE WHEN op = 'd' THEN NULL ELSE after.`created at` END AS `created at`",
        "op", "ts_ms", "source.lsn AS lsn"]


def test_debezium_without_an_lsn_in_source_orders_by_what_the_user_selects():
    assert debezium_select(envelope(source=False))[-2:] == ["op", "ts_ms"]


def test_a_schema_that_is_not_a_debezium_envelope_is_a_config_error():
    with pytest.raises(ConfigError, match=r"needs the envelope's fields op, before and after .* lacks \['before'\]"):
        debezium_select(StructType([f for f in envelope().fields if f.name != "before"]))
    with pytest.raises(ConfigError, match="before and after must be STRUCTs"):
        debezium_select(envelope(after=StringType()))
    clashing = StructType([*ROW.fields, StructField("lsn", LongType())])
    with pytest.raises(ConfigError, match=r"column\(s\) \['lsn'\] clash with the envelope's"):
        debezium_select(envelope(before=clashing, after=clashing))


def test_an_unknown_envelope_names_the_accepted_ones():
    with pytest.raises(ConfigError, match=r"source.envelope = 'maxwell' is not accepted; accepted values: "
                                          r"\['none', 'debezium'\]"):
        SourceConfig(path="in", schema="id STRING", envelope="maxwell")


def debezium_sink(**extra):
    return SinkConfig(table_uri="/tmp/t", key=["order_id"], ordering="lsn", writer_id="orders", metrics_port=0,
                      **extra)


DEBEZIUM_SOURCE = SourceConfig(schema="op STRING, ts_ms BIGINT, before STRUCT<order_id: BIGINT>, "
                                      "after STRUCT<order_id: BIGINT, status: STRING, note: STRING>",
                               envelope="debezium", path="/tmp/landing")


@pytest.mark.spark
def test_a_debezium_table_keeps_stored_values_for_the_placeholder_and_quarantines_creates_holding_it(spark):
    cfg = for_debezium(debezium_sink(quarantine_when="status = 'x'"), DEBEZIUM_SOURCE,
                       ["order_id", "status", "note", "op", "ts_ms"])
    assert cfg.unchanged_value == UNAVAILABLE_VALUE and cfg.freshness_column == "ts_ms"
    assert cfg.quarantine_when == (f"(status = 'x') OR op IN ('c', 'r') AND (`status` = '{UNAVAILABLE_VALUE}' OR "
                                   f"`note` = '{UNAVAILABLE_VALUE}')")


@pytest.mark.spark
def test_a_debezium_history_table_or_one_without_op_quarantines_every_record_holding_the_placeholder(spark):
    for cfg in (for_debezium(debezium_sink(scd_type=2), DEBEZIUM_SOURCE, ["order_id", "status", "op"]),
                for_debezium(debezium_sink(), DEBEZIUM_SOURCE, ["order_id", "status"])):  # no op: creates unknown
        assert cfg.unchanged_value is None
        assert cfg.quarantine_when == f"`status` = '{UNAVAILABLE_VALUE}'"


def test_a_debezium_table_with_its_own_unchanged_value_is_left_as_configured():
    cfg = for_debezium(debezium_sink(unchanged_value="??"), DEBEZIUM_SOURCE, ["order_id", "status", "op"])
    assert (cfg.unchanged_value, cfg.quarantine_when) == ("??", None)
