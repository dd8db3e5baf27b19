import pytest

from sink import columns as C
from sink.config import SinkConfig
from sink.routing import prepare, sql_string

pytestmark = pytest.mark.spark

@pytest.mark.parametrize("value", ["plain", "it's", "back\\slash", "both \\' mixed", ""])
def test_sql_string_round_trips_through_spark(spark, value):
    assert spark.sql(f"SELECT {sql_string(value)} AS v").collect()[0]["v"] == value


def test_reasons_name_columns_whose_names_need_quoting(spark):
    cfg = SinkConfig(table_uri="/t", key=["user's id"], partition_by=["d`t"], ordering="ts", writer_id="w",
                     delete_when="op = 'd'", scope="global", metrics_port=0)
    df = spark.createDataFrame([(None, "x", 1, "u"), ("a", None, 1, "u"), ("b", None, 1, "d"), ("c", "", 1, "u"),
                                ("e", "x", None, "u")], "`user's id` string, `d``t` string, ts long, op string")
    out = prepare(df, cfg, 4).select(C.REASON, C.DELETE).collect()
    assert [tuple(r) for r in out] == [
        ("null key column user's id", False), ("null partition column d`t", False),
        (None, True),  # global scope: a delete needs no partition
        ("empty partition value d`t (Delta stores it as NULL)", False), ("null ordering column ts", False)]
    # Partitioned scope: the index places the delete too (sink.tagging.placement).
    partitioned = SinkConfig(**{**cfg.__dict__, "scope": "partitioned"})
    assert [tuple(r) for r in prepare(df, partitioned, 4).select(C.REASON, C.DELETE).collect()][2] == (None, True)
