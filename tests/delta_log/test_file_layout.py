"""What a table's properties ask of the files the sink writes: the columns with statistics
(as Spark collects them), random prefixes, a target size."""

import json
import re

import pyarrow as pa
import pytest
from deltalake import DeltaTable

from sink import UpsertSink
from sink.delta_log import metadata_commit
from sink.delta_log.file_layout import FileLayout, byte_size, leaf_count
from tests.lakehouse.spark_sql_tables import COLUMNS, create, log_actions, sink_config, spark_rows
from tests.oracle import SCHEMA, expected_rows, random_batches

FILE = pa.schema([("id", pa.string()), ("ts", pa.int64()), ("s", pa.struct([("a", pa.int64()), ("b", pa.int64())])),
                  ("op", pa.string()), ("v", pa.string())])


@pytest.mark.parametrize("configuration, names", [
    ({}, ["id", "ts", "s", "op", "v"]),
    ({"delta.dataSkippingNumIndexedCols": "2"}, ["id", "ts"]),
    ({"delta.dataSkippingNumIndexedCols": "3"}, ["id", "ts", "s"]),  # s counts its two leaves
    ({"delta.dataSkippingNumIndexedCols": "4"}, ["id", "ts", "s"]),
    ({"delta.dataSkippingNumIndexedCols": "0"}, []),
    ({"delta.dataSkippingNumIndexedCols": "-1"}, ["id", "ts", "s", "op", "v"]),
    ({"delta.dataSkippingNumIndexedCols": "many"}, ["id", "ts", "s", "op", "v"]),
    ({"delta.dataSkippingNumIndexedCols": "1", "delta.dataSkippingStatsColumns": " v , `ts`"}, ["ts", "v"]),
    ({"delta.dataSkippingStatsColumns": "V,Ts"}, ["ts", "v"]),  # as Spark resolves names
])
def test_the_columns_with_statistics_are_those_the_properties_name(configuration, names):
    assert [f.name for f in FileLayout.of(configuration).stats_fields(FILE)] == names


def test_named_statistics_columns_are_found_by_physical_name_under_column_mapping():
    layout = FileLayout.of({"delta.dataSkippingStatsColumns": "V"}, {"id": "col-1", "v": "col-2"})
    assert [f.name for f in layout.stats_fields(pa.schema([("col-1", pa.string()), ("col-2", pa.string())]))] == \
        ["col-2"]


def test_partition_columns_take_no_statistics_and_count_for_none():
    layout = FileLayout.of({"delta.dataSkippingNumIndexedCols": "1"})
    assert [f.name for f in layout.stats_fields(pa.schema([("dt", pa.string()), ("id", pa.string())]),
                                                skip={"dt"})] == ["id"]


def test_a_struct_counts_its_leaves():
    assert leaf_count(FILE.field("s").type) == 2 and leaf_count(pa.list_(pa.int64())) == 1


@pytest.mark.parametrize("value, size", [
    ("134217728", 134217728), ("128mb", 128 << 20), ("1 GB", 1 << 30), ("64k", 64 << 10), (None, None),
    ("", None), ("0", None), ("big", None), ("12tb", None),
])
def test_a_target_file_size_is_read_with_its_unit(value, size):
    assert byte_size(value) == size


def test_random_prefixes_replace_the_partition_folder():
    assert FileLayout.of({}).folder("dt=1/") == "dt=1/"
    assert re.fullmatch(r"[A-Za-z0-9]{2}/", FileLayout.of({"delta.randomizeFilePrefixes": "true"}).folder("dt=1/"))
    layout = FileLayout.of({"delta.randomizeFilePrefixes": "TRUE", "delta.randomPrefixLength": "5"})
    assert re.fullmatch(r"[A-Za-z0-9]{5}/", layout.folder(""))


def test_rows_larger_than_the_target_are_split_in_order_and_whole():
    rows = pa.table({"id": [f"k{i:05}" for i in range(1000)]})
    pieces = FileLayout.of({"delta.targetFileSize": str(rows.nbytes // 4)}).split(rows)
    assert len(pieces) == 4 and all(p.nbytes <= rows.nbytes // 4 + 100 for p in pieces)
    assert pa.concat_tables(pieces) == rows
    assert FileLayout.of({}).split(rows) == [rows]


def stats_keys(uri: str, first: int) -> set[tuple[str, ...]]:
    """The column sets of the statistics of the files added from version `first` on."""
    stats = [json.loads(a["stats"]) for v, name, a in log_actions(uri, first) if name == "add" and a.get("stats")]
    return {tuple(sorted(s["nullCount"])) for s in stats}


@pytest.mark.spark
@pytest.mark.parametrize("properties, update_mode, tag_on", [
    ("'delta.dataSkippingNumIndexedCols' = '2'", "rewrite", "driver"),
    ("'delta.dataSkippingStatsColumns' = 'v,ts'", "rewrite", "executors"),
    ("'delta.dataSkippingNumIndexedCols' = '2', 'delta.enableDeletionVectors' = 'true'", "merge-on-read", "driver"),
    ("'delta.dataSkippingStatsColumns' = 'op', 'delta.columnMapping.mode' = 'name'", "rewrite", "driver"),
], ids=["first columns", "named columns, written by Spark's tasks", "deletion vectors", "column mapping"])
def test_the_sinks_files_carry_the_statistics_sparks_do(spark, tmp_path, properties, update_mode, tag_on):
    """Spark's INSERT into the same table is the oracle of which columns carry statistics."""
    uri = str(tmp_path / "table")
    create(spark, uri, properties=f"TBLPROPERTIES ({properties})")
    spark.sql(f"INSERT INTO delta.`{uri}` VALUES ('spark', '2025-01-01', 0, 'u', 'x')")
    sparks = stats_keys(uri, 0)
    spark.sql(f"DELETE FROM delta.`{uri}`")
    start = DeltaTable(uri).version() + 1
    sink = UpsertSink(sink_config(tmp_path, uri, tag_on=tag_on))
    batches = random_batches(59, batches=3, per_batch=100, bad_share=0)
    for b, events in enumerate(batches):
        sink(spark.createDataFrame(events, SCHEMA), b)
    assert [r.mode for r in sink.reports] == ["append", update_mode, update_mode]
    assert spark_rows(spark, uri) == expected_rows(batches)
    assert len(sparks) == 1 and stats_keys(uri, start) == sparks


@pytest.mark.spark
def test_random_prefixes_and_a_target_size_shape_the_sinks_files(spark, tmp_path):
    uri = str(tmp_path / "table")
    create(spark, uri, properties="TBLPROPERTIES ('delta.randomizeFilePrefixes' = 'true')")
    # Delta's Spark engine refuses to set delta.targetFileSize (Databricks' property, and delta-rs').
    metadata_commit.set_properties(DeltaTable(uri), uri, {"delta.targetFileSize": "512"})
    spark.sql(f"INSERT INTO delta.`{uri}` VALUES ('spark', '2025-01-01', 0, 'u', 'x')")
    sink = UpsertSink(sink_config(tmp_path, uri))
    batches = random_batches(61, batches=3, per_batch=400, bad_share=0)
    for b, events in enumerate(batches):
        sink(spark.createDataFrame(events, SCHEMA), b)
    spark_row = {"id": "spark", "dt": "2025-01-01", "ts": 0, "op": "u", "v": "x"}
    assert spark_rows(spark, uri) == sorted([*expected_rows(batches), spark_row], key=lambda r: (r["dt"], r["id"]))
    # Versions 2-3: the properties and the contract; 4: the first batch, an append of 400 rows in few partitions.
    added = [(v, a) for v, name, a in log_actions(uri, 4) if name == "add"]
    assert added and all(re.fullmatch(r"[A-Za-z0-9]{2}/part-[^/]+\.parquet", a["path"]) for _, a in added)
    first = [a for v, a in added if v == 4]
    assert len(first) >= 3 * len({e.dt for e in batches[0]})
    assert sum(json.loads(a["stats"])["numRecords"] for a in first) == len(expected_rows(batches[:1]))


@pytest.mark.spark
def test_a_table_kept_on_merge_takes_delta_rs_appends_whatever_its_prefixes(spark, tmp_path):
    """A column-mapped table with a nested column commits through MERGE (its fields have
    physical names of their own, which the sink's writer does not give): random prefixes do
    not turn its appends into the sink's own files."""
    uri = str(tmp_path / "table")
    create(spark, uri, columns=COLUMNS + ", s STRUCT<a: STRING>",
           properties="TBLPROPERTIES ('delta.randomizeFilePrefixes' = 'true', 'delta.columnMapping.mode' = 'name')")
    sink = UpsertSink(sink_config(tmp_path, uri))
    batches = random_batches(73, batches=2, per_batch=60, bad_share=0)
    for b, events in enumerate(batches):
        sink(spark.createDataFrame(events, SCHEMA).selectExpr("*", "named_struct('a', v) AS s"), b)
    assert [r.mode for r in sink.reports] == ["append", "merge"]
    assert spark_rows(spark, uri) == expected_rows(batches)
    assert spark.read.format("delta").load(uri).where("s.a IS DISTINCT FROM v").count() == 0
