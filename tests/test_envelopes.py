"""The ready job's CDC envelopes, flattened into the sink's flat records."""

import pytest
from pyspark.sql.types import LongType, StringType, StructField, StructType, TimestampType

from jobs.envelopes import debezium_select
from jobs.job_config import SourceConfig
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
