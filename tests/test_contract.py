"""The table remembers the sink's contract: a restart with another key, partitioning,
ordering or scope is refused before anything is written."""

import pyarrow as pa
import pytest
from deltalake import DeltaTable, write_deltalake

from sink import ContractMismatchError, SchemaError, SinkConfig, UpsertSink
from sink.cli import main
from sink.delta_log.contract import Contract

pytestmark = pytest.mark.spark

SCHEMA = "tenant_id string, order_id string, region string, updated_at long, op string"


def orders_config(tmp_path, **changes):
    values = dict(table_uri=str(tmp_path / "orders"), key=["tenant_id", "order_id"], partition_by=["region"],
                  ordering="updated_at", delete_when="op = 'd'", writer_id="orders",
                  index_dir=str(tmp_path / "index"), num_shards=1, metrics_port=0)
    return SinkConfig(**{**values, **changes})


def rows(uri):
    return sorted((r["tenant_id"], r["order_id"], r["updated_at"]) for r in DeltaTable(uri).to_pyarrow_table()
                  .to_pylist())


def test_a_restart_with_another_key_is_refused_naming_both_and_writes_nothing(spark, tmp_path):
    UpsertSink(orders_config(tmp_path))(spark.createDataFrame(
        [("t1", "o1", "eu", 1, "u"), ("t2", "o1", "eu", 1, "u")], SCHEMA), 0)
    version = DeltaTable(str(tmp_path / "orders")).version()
    narrower = UpsertSink(orders_config(tmp_path, key=["order_id"]))
    with pytest.raises(ContractMismatchError, match=r"key: \('tenant_id', 'order_id'\) vs \('order_id',\).*--rewrite"):
        narrower(spark.createDataFrame([("t1", "o1", "eu", 5, "u")], SCHEMA), 1)
    assert DeltaTable(str(tmp_path / "orders")).version() == version
    assert rows(str(tmp_path / "orders")) == [("t1", "o1", 1), ("t2", "o1", 1)]


def test_another_partitioning_is_refused_with_both_named(spark, tmp_path):
    UpsertSink(orders_config(tmp_path))(spark.createDataFrame([("t1", "o1", "eu", 1, "u")], SCHEMA), 0)
    with pytest.raises(SchemaError, match=r"partitioned by \['region'\], the config's partition_by is \[\]"):
        UpsertSink(orders_config(tmp_path, partition_by=[]))(
            spark.createDataFrame([("t1", "o1", "eu", 5, "u")], SCHEMA), 1)


def test_a_table_without_a_contract_gets_one_and_recording_it_costs_no_reload(spark, tmp_path):
    uri = str(tmp_path / "orders")
    write_deltalake(uri, pa.table({"tenant_id": ["t1"], "order_id": ["o1"], "region": ["eu"],
                                   "updated_at": pa.array([1], pa.int64()), "op": ["u"]}), partition_by=["region"])
    cfg = orders_config(tmp_path, peek_max_keys=0)  # the partition is held from the first batch on
    sink = UpsertSink(cfg)
    sink(spark.createDataFrame([("t1", "o1", "eu", 2, "u")], SCHEMA), 0)
    assert DeltaTable(uri).metadata().configuration["upsert_sink.key"] == '["tenant_id", "order_id"]'
    assert sink.reports[-1].ops["update"] == 1
    # Recording the contract again (the CLI after a deliberate change) changes no row: the
    # replicas keep every partition.
    conf = tmp_path / "sink.toml"
    conf.write_text(f'[sink]\ntable_uri = "{uri}"\nkey = ["tenant_id", "order_id"]\npartition_by = ["region"]\n'
                    f'ordering = "updated_at"\nwriter_id = "orders"\nindex_dir = "{tmp_path / "index"}"\n')
    assert main(["contract", "--config", str(conf), "--rewrite"]) == 0
    sink(spark.createDataFrame([("t1", "o1", "eu", 3, "u")], SCHEMA), 1)
    report = sink.reports[-1]
    assert (report.invalidated, sum(report.partition_loads.values()), report.ops["update"]) == (0, 0, 1)
    assert rows(uri) == [("t1", "o1", 3)]


def test_a_contract_recorded_before_history_tables_reads_as_type_1():
    """Tables recorded before scd_type existed have no such property: they are type 1."""
    old = {f"upsert_sink.{k}": v for k, v in (("key", '["id"]'), ("partition_by", "[]"), ("ordering", '"ts"'),
                                              ("scope", '"partitioned"'), ("key_encoding", '"string-v1"'))}
    recorded = Contract.from_properties(old)
    assert (recorded.scd_type, recorded.track_history) == (1, None)
    two = Contract(("id",), (), "ts", "partitioned", "string-v1", scd_type=2, track_history=("except", ("city",)))
    assert Contract.from_properties(two.properties()) == two
    assert recorded.differences(two) == ["scd_type: 1 vs 2", "track_history: None vs ('except', ('city',))"]
