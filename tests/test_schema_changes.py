"""The stream's schema against the table's: new columns are added in the batch's commit;
dropped, retyped or lossy columns are refused before anything is written."""

import pyarrow as pa
import pytest
from deltalake import DeltaTable, write_deltalake
from prometheus_client import REGISTRY

from sink import SchemaError, SinkConfig, UpsertSink
from tests.oracle import SCHEMA, Event, expected_rows

pytestmark = pytest.mark.spark


def config(tmp_path, **extra):
    return SinkConfig(table_uri=str(tmp_path / "table"), key=["id"], partition_by=["dt"], ordering="ts",
                      delete_when="op = 'd'", writer_id=extra.pop("writer_id", "schema"),
                      index_dir=str(tmp_path / "index"), num_shards=1, metrics_port=0, **extra)


def rows(uri):
    return sorted(DeltaTable(uri).to_pyarrow_table().to_pylist(), key=lambda r: (r["dt"], r["id"]))


@pytest.mark.parametrize("tag_on", ["driver", "executors"])  # executors: Spark tasks write the wider files
def test_a_new_column_mid_stream_is_added_in_the_batchs_commit_and_costs_no_reload(spark, tmp_path, tag_on):
    cfg = config(tmp_path, tag_on=tag_on)
    sink = UpsertSink(cfg)
    first = [Event("a", "2025-01-01", 1, "u", "x"), Event("b", "2025-01-01", 1, "u", "x")]
    sink(spark.createDataFrame(first, SCHEMA), 0)
    version = DeltaTable(cfg.table_uri).version()
    wider = SCHEMA + ", note string"
    sink(spark.createDataFrame([("a", "2025-01-01", 2, "u", "y", "hello"), ("c", "2025-01-01", 2, "u", "y", None)],
                               wider), 1)
    # The column joins in a metadata commit just before the batch's, as Spark's ADD COLUMNS.
    history = DeltaTable(cfg.table_uri).history(2)
    assert [h["operation"] for h in history] == ["MERGE", "ADD COLUMNS"]
    assert history[0]["upsert_sink.commit"] == "rewrite"
    assert DeltaTable(cfg.table_uri).version() == version + 2
    assert [(r["id"], r["v"], r["note"]) for r in rows(cfg.table_uri)] == [
        ("a", "y", "hello"), ("b", "x", None), ("c", "y", None)]
    sink(spark.createDataFrame([("d", "2025-01-01", 3, "u", "z", "new", 7)], wider + ", n long"), 2)  # an append
    assert [h["operation"] for h in DeltaTable(cfg.table_uri).history(2)] == ["WRITE", "ADD COLUMNS"]
    report = sink.reports[-1]
    assert (report.invalidated, sum(report.partition_loads.values()), report.mode) == (0, 0, "append")
    assert [(r["note"], r["n"]) for r in rows(cfg.table_uri)] == [("hello", None), (None, None), (None, None),
                                                                  ("new", 7)]


def test_with_schema_evolution_fail_a_new_column_is_refused_by_name(spark, tmp_path):
    cfg = config(tmp_path, schema_evolution="fail")
    UpsertSink(cfg)(spark.createDataFrame([Event("a", "2025-01-01", 1, "u", "x")], SCHEMA), 0)
    with pytest.raises(SchemaError, match=r"\['note'\] the table lacks and schema_evolution = 'fail'"):
        UpsertSink(cfg)(spark.createDataFrame([("a", "2025-01-01", 2, "u", "y", "n")], SCHEMA + ", note string"), 1)
    assert "note" not in DeltaTable(cfg.table_uri).schema().to_arrow().names


@pytest.mark.parametrize("table_types, stream_schema, message", [
    # Key BIGINT in the table, STRING in the stream: "0042" would be a second row for 42.
    ({"id": pa.int64()}, "id string, dt string, ts long, op string, v string",
     "key column 'id' is string in the stream and int64 in the table"),
    # DOUBLE into a STRING column: 1.0 would be stored as '1'.
    ({"v": pa.string()}, "id string, dt string, ts long, op string, v double",
     "column 'v' is double in the stream and string in the table"),
    ({}, "id string, dt string, ts long, op string", r"the table's column\(s\) \['v'\] are not in the stream"),
])
def test_a_stream_that_would_change_or_drop_values_is_refused_before_writing(spark, tmp_path, table_types,
                                                                              stream_schema, message):
    arrow = pa.schema([("id", table_types.get("id", pa.string())), ("dt", pa.string()), ("ts", pa.int64()),
                       ("op", pa.string()), ("v", table_types.get("v", pa.string()))])
    write_deltalake(str(tmp_path / "table"), pa.Table.from_pylist(
        [{"id": 42 if pa.types.is_integer(arrow.field("id").type) else "42", "dt": "2025-01-01", "ts": 1,
          "op": "u", "v": "1"}], schema=arrow), partition_by=["dt"])
    version = DeltaTable(str(tmp_path / "table")).version()
    values = {"id": "0042", "dt": "2025-01-01", "ts": 5, "op": "u", "v": 1.0}
    df = spark.createDataFrame([tuple(values[c.split()[0]] for c in stream_schema.split(", "))], stream_schema)
    sink = UpsertSink(config(tmp_path))
    with pytest.raises(SchemaError, match=message):
        sink.validate(df)  # what the job calls before starting the query
    with pytest.raises(SchemaError, match=message):
        sink(df, 0)
    assert DeltaTable(str(tmp_path / "table")).version() == version


def test_an_empty_partition_value_goes_to_quarantine_with_its_reason(spark, tmp_path):
    cfg = config(tmp_path)
    sink = UpsertSink(cfg)
    events = [Event("a", "2025-01-01", 1, "u", "ok"), Event("b", "", 1, "u", "empty")]
    sink(spark.createDataFrame(events, SCHEMA), 0)
    assert rows(cfg.table_uri) == expected_rows([events[:1]])
    quarantined = DeltaTable(cfg.resolved_quarantine_uri).to_pyarrow_table().to_pylist()
    assert [(r["id"], r["_quarantine_reason"]) for r in quarantined] == [
        ("b", "empty partition value dt (Delta stores it as NULL)")]


def test_a_key_in_several_partitions_of_a_batch_is_counted_and_logged(spark, tmp_path, caplog):
    cfg = config(tmp_path, writer_id="spread")
    sink = UpsertSink(cfg)
    events = [Event("a", "2025-01-01", 1, "u", "x"), Event("a", "2025-01-02", 2, "u", "y"),
              Event("b", "2025-01-01", 1, "u", "x"), Event("c", "2025-01-03", 1, "u", "x"),
              Event("c", "2025-01-04", 1, "u", "x")]
    with caplog.at_level("WARNING", logger="sink"):
        sink(spark.createDataFrame(events, SCHEMA), 0)
    assert sink.reports[-1].keys_in_several_partitions == 2
    assert REGISTRY.get_sample_value("upsert_sink_keys_in_several_partitions_total", {"sink": "spread"}) == 2
    assert "2 key(s) have records in several partitions" in caplog.text and "scope = 'global'" in caplog.text
    assert len(rows(cfg.table_uri)) == 5  # partitioned scope: one row per (partition, key)


def test_a_new_key_already_stored_in_another_partition_is_counted_and_logged(spark, tmp_path, caplog):
    cfg = config(tmp_path, writer_id="elsewhere", peek_max_keys=0)  # the check looks in the partitions held
    sink = UpsertSink(cfg)
    stored = [Event("a", "2025-01-01", 1, "u", "x"), Event("b", "2025-01-01", 1, "u", "x"),
              Event("c", "2025-01-02", 1, "d", None)]
    sink(spark.createDataFrame(stored, SCHEMA), 0)
    # a and b live in 2025-01-01 (c was deleted, so a row for it elsewhere is no second row).
    later = [Event("a", "2025-01-03", 2, "u", "y"), Event("b", "2025-01-01", 2, "u", "y"),
             Event("c", "2025-01-03", 2, "u", "y"), Event("d", "2025-01-03", 2, "u", "y")]
    with caplog.at_level("WARNING", logger="sink"):
        sink(spark.createDataFrame(later, SCHEMA), 1)
    report = sink.reports[-1]
    assert (report.keys_in_other_partition, report.keys_checked_in_other_partitions) == (1, 3)  # a, c, d checked
    assert report.other_partition_example == ["a", "dt=2025-01-03", "dt=2025-01-01"]
    assert REGISTRY.get_sample_value("upsert_sink_keys_in_other_partition_total", {"sink": "elsewhere"}) == 1
    assert "1 of 3 new key(s) checked are already stored in another partition" in caplog.text
    assert rows(cfg.table_uri) == expected_rows([stored, later])  # partitioned scope: a has two rows


def test_the_cross_partition_check_is_off_at_zero(spark, tmp_path):
    cfg = config(tmp_path, writer_id="unchecked", cross_partition_check=0)
    sink = UpsertSink(cfg)
    sink(spark.createDataFrame([Event("a", "2025-01-01", 1, "u", "x")], SCHEMA), 0)
    sink(spark.createDataFrame([Event("a", "2025-01-02", 2, "u", "y")], SCHEMA), 1)
    assert (sink.reports[-1].keys_in_other_partition, sink.reports[-1].keys_checked_in_other_partitions) == (0, 0)
