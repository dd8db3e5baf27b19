"""CDC options, checked on the published examples they come from."""

import pytest
from deltalake import DeltaTable

from sink import SchemaError, SinkConfig, UpsertSink
from sink.errors import ConfigError

pytestmark = pytest.mark.spark

# Databricks' AUTO CDC (APPLY CHANGES) SCD type 1 example: changes of users, deleted by
# operation = 'DELETE', sequenced by sequenceNum, stored without the operation column.
USERS = "userId INT, name STRING, city STRING, operation STRING, sequenceNum INT"
CHANGES = [
    (124, "Raul", "Oaxaca", "INSERT", 1),
    (123, "Isabel", "Monterrey", "INSERT", 1),
    (125, "Mercedes", "Tijuana", "INSERT", 2),
    (126, "Lily", "Cancun", "INSERT", 2),
    (123, None, None, "DELETE", 6),
    (125, "Mercedes", "Guadalajara", "UPDATE", 6),
    (125, "Mercedes", "Mexicali", "UPDATE", 5),
    (123, "Isabel", "Chihuahua", "UPDATE", 5),
]


def users_config(tmp_path, **extra):
    return SinkConfig(table_uri=str(tmp_path / "users"), key=["userId"], ordering="sequenceNum",
                      delete_when="operation = 'DELETE'", writer_id="users", index_dir=str(tmp_path / "index"),
                      num_shards=2, metrics_port=0, **extra)


def test_except_columns_route_records_but_are_not_stored(spark, tmp_path):
    cfg = users_config(tmp_path, except_columns=["operation"])
    sink = UpsertSink(cfg)
    sink(spark.createDataFrame(CHANGES[:4], USERS), 0)
    sink(spark.createDataFrame(CHANGES[4:], USERS), 1)
    table = DeltaTable(cfg.table_uri)
    assert table.schema().to_arrow().names == ["userId", "name", "city", "sequenceNum"]
    # The published result (the example also drops sequenceNum; the sink keeps its ordering column).
    assert sorted(tuple(r.values()) for r in table.to_pyarrow_table().to_pylist()) == [
        (124, "Raul", "Oaxaca", 1), (125, "Mercedes", "Guadalajara", 6), (126, "Lily", "Cancun", 2)]


def test_except_columns_must_be_in_the_stream_and_leave_the_ordering_stored(spark, tmp_path):
    with pytest.raises(ConfigError, match=r"except_columns \['sequenceNum'\] are key, partition or ordering"):
        users_config(tmp_path, except_columns=["operation", "sequenceNum"])
    sink = UpsertSink(users_config(tmp_path, except_columns=["op"]))
    with pytest.raises(SchemaError, match=r"except_columns \['op'\] are not in the stream"):
        sink.validate(spark.createDataFrame(CHANGES, USERS))


def test_excepting_a_column_the_table_stores_is_refused(spark, tmp_path):
    UpsertSink(users_config(tmp_path))(spark.createDataFrame(CHANGES[:4], USERS), 0)
    sink = UpsertSink(users_config(tmp_path, except_columns=["operation"]))
    with pytest.raises(SchemaError, match=r"except_columns \['operation'\] are columns .* stores"):
        sink(spark.createDataFrame(CHANGES[4:], USERS), 1)
