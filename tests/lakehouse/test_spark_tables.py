"""Tables created by Spark SQL with the features Spark users turn on, written by the sink's
deltalake engine: exact where delta-rs honours the feature (read back through Spark), refused
before anything is written, naming the feature, where it cannot."""

import json

import pytest
from deltalake import DeltaTable

from sink import SinkConfig, UpsertSink
from sink.errors import SchemaError, UnsupportedTableError
from tests.lakehouse.spark_sql_tables import COLUMNS, create, last_action, log_actions, spark_rows
from tests.oracle import SCHEMA, expected_rows, random_batches

pytestmark = pytest.mark.spark


def config(tmp_path, uri: str) -> SinkConfig:
    return SinkConfig(table_uri=uri, key=["id"], partition_by=["dt"], ordering="ts", delete_when="op = 'd'",
                      writer_id="w", index_dir=str(tmp_path / "index"), num_shards=2, metrics_port=0, tag_on="driver",
                      engine="deltalake")


# Deletion vectors: marked by the sink's merge-on-read commit; a change data feed: files
# rewritten, their changes written; column mapping: files read and written under physical
# names (all three the sink's log commit); a CHECK constraint: checked on the records.
@pytest.mark.parametrize("properties, constraint, update_mode", [
    ("TBLPROPERTIES ('delta.enableDeletionVectors' = 'true')", "", "merge-on-read"),
    ("TBLPROPERTIES ('delta.enableChangeDataFeed' = 'true')", "", "rewrite"),
    ("TBLPROPERTIES ('delta.columnMapping.mode' = 'name')", "", "rewrite"),
    ("TBLPROPERTIES ('delta.columnMapping.mode' = 'id', 'delta.enableDeletionVectors' = 'true', "
     "'delta.enableChangeDataFeed' = 'true')", "", "merge-on-read"),
    ("", "ts_not_negative CHECK (ts >= 0)", "rewrite"),
], ids=["deletion vectors", "change data feed", "column mapping", "column mapping by id, deletion vectors, feed",
        "CHECK constraint"])
def test_a_table_spark_created_with_a_feature_delta_rs_honours_is_written_exactly(spark, tmp_path, properties,
                                                                                   constraint, update_mode):
    """Its rows as Spark reads them, and its promise to other readers: no commit of the sink
    carries a protocol; its metadata is Spark's but for the contract's properties and the
    column the last batch adds (under column mapping, with its id and physical name)."""
    uri = str(tmp_path / "table")
    create(spark, uri, properties=properties, constraint=constraint)
    created = DeltaTable(uri).version()
    protocol, metadata = last_action(uri, "protocol"), last_action(uri, "metaData")
    batches = random_batches(41, batches=3, per_batch=150, bad_share=0)
    sink = UpsertSink(config(tmp_path, uri))
    for b, events in enumerate(batches):
        sink(spark.createDataFrame(events, SCHEMA).selectExpr("*", *["upper(v) AS w"] * (b == 2)), b)
        assert spark_rows(spark, uri) == expected_rows(batches[: b + 1]), f"after batch {b}"
    assert [r.mode for r in sink.reports] == ["append", update_mode, update_mode]
    stored = spark.read.format("delta").load(uri)
    # The rows the last batch wrote hold its w; the others none.
    assert stored.where("w IS NOT NULL").count() > 0 and stored.where("w != upper(v)").count() == 0
    assert [v for v, name, _ in log_actions(uri, created + 1) if name == "protocol"] == []
    assert last_action(uri, "protocol") == protocol
    now = last_action(uri, "metaData")
    fields = json.loads(now["schemaString"])["fields"]
    assert json.loads(metadata["schemaString"])["fields"] == fields[:-1] and fields[-1]["name"] == "w"
    added = {k: v for k, v in now["configuration"].items() if metadata["configuration"].get(k) != v}
    mapped = {"delta.columnMapping.maxColumnId"} if "columnMapping" in properties else set()
    assert {k for k in added if not k.startswith("upsert_sink.")} == mapped
    assert {k: v for k, v in now.items() if k not in ("schemaString", "configuration")} == \
        {k: v for k, v in metadata.items() if k not in ("schemaString", "configuration")}


def test_a_generated_column_the_stream_carries_is_written_and_one_it_lacks_is_named_with_its_expression(
        spark, tmp_path):
    uri = str(tmp_path / "table")
    create(spark, uri, columns=COLUMNS + ", g STRING GENERATED ALWAYS AS (upper(v))")
    batches = random_batches(43, batches=3, per_batch=150, bad_share=0)
    sink = UpsertSink(config(tmp_path, uri))
    with pytest.raises(SchemaError, match=r"generated column\(s\) \['g'\] are not in the stream: .* add them to "
                                          r"the stream's select \(upper\(v\) AS g\)"):
        sink(spark.createDataFrame(batches[0], SCHEMA), 0)
    assert DeltaTable(uri).version() == 0
    for b, events in enumerate(batches):
        sink(spark.createDataFrame(events, SCHEMA).selectExpr("*", "upper(v) AS g"), b)
        assert spark_rows(spark, uri) == expected_rows(batches[: b + 1]), f"after batch {b}"
    assert spark.read.format("delta").load(uri).where("g IS DISTINCT FROM upper(v)").count() == 0


@pytest.mark.parametrize("columns, properties, named", [
    (COLUMNS, "TBLPROPERTIES ('delta.enableRowTracking' = 'true')", "row tracking"),
    (COLUMNS + ", n BIGINT GENERATED ALWAYS AS IDENTITY", "", "identity columns"),
], ids=["row tracking", "identity column"])
def test_a_table_spark_created_with_a_feature_delta_rs_cannot_write_is_refused_before_writing(
        spark, tmp_path, columns, properties, named):
    uri = str(tmp_path / "table")
    create(spark, uri, columns=columns, properties=properties)
    version = DeltaTable(uri).version()
    sink = UpsertSink(config(tmp_path, uri))
    df = spark.createDataFrame(random_batches(42, batches=1, per_batch=50, bad_share=0)[0], SCHEMA)
    message = rf"uses {named} \(.*\): delta-rs cannot write it; engine = 'delta-spark', or 'auto' in a session with " \
              r"Delta's extension, writes it through Spark; nothing was written"
    with pytest.raises(UnsupportedTableError, match=message):
        sink.validate(df)  # the job's check before its query starts
    with pytest.raises(UnsupportedTableError, match=message):
        sink(df, 0)
    assert DeltaTable(uri).version() == version
    assert spark_rows(spark, uri) == []
