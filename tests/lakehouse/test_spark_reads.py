"""Delta's own Spark engine reads what the sink writes: the rows, the history of commits, and
the app transaction that makes each batch exactly-once."""

import pytest

from sink import SinkConfig, UpsertSink
from tests.oracle import SCHEMA, expected_rows, random_batches

pytestmark = pytest.mark.spark


def spark_rows(spark, uri):
    rows = [r.asDict() for r in spark.read.format("delta").load(uri).collect()]
    return sorted(rows, key=lambda r: (r["dt"], r["id"]))


def app_version(spark, uri, app_id):
    """The batch Delta's own log reader records for `app_id` (its SetTransaction)."""
    delta_log = spark._jvm.org.apache.spark.sql.delta.DeltaLog.forTable(spark._jsparkSession, uri)
    recorded = delta_log.unsafeVolatileSnapshot().transactions().get(app_id)
    return recorded.get() if recorded.isDefined() else None


@pytest.mark.parametrize("tag_on, commit_mode", [("driver", "auto"), ("executors", "auto"), ("driver", "merge")])
def test_spark_reads_the_sinks_table_its_commits_and_its_app_transaction(spark, tmp_path, tag_on, commit_mode):
    cfg = SinkConfig(table_uri=str(tmp_path / "table"), key=["id"], partition_by=["dt"], ordering="ts",
                     delete_when="op = 'd'", checkpoint_dir=str(tmp_path / "cp"), index_dir=str(tmp_path / "index"),
                     metrics_port=0, num_shards=2, tag_on=tag_on, commit_mode=commit_mode)
    batches = random_batches(31, batches=4, per_batch=200)
    sink = UpsertSink(cfg)
    for b, events in enumerate(batches):
        sink(spark.createDataFrame(events, SCHEMA), b)
        assert spark_rows(spark, cfg.table_uri) == expected_rows(batches[: b + 1]), f"after batch {b}"
    sink.close()

    count = spark.sql(f"SELECT count(*) AS n FROM delta.`{cfg.table_uri}`").first().n
    assert count == len(expected_rows(batches))
    history = {r.version: r for r in spark.sql(f"DESCRIBE HISTORY delta.`{cfg.table_uri}`").collect()}
    assert sorted(history) == list(range(sink.reports[-1].table_version + 1))
    operations = {"append": {"WRITE"}, "rewrite": {"MERGE"}, "merge": {"MERGE"}}
    for report in sink.reports:
        assert history[report.table_version].operation in operations[report.mode], report.summary()
    assert {r.mode for r in sink.reports} >= {"append", "merge" if commit_mode == "merge" else "rewrite"}
    assert app_version(spark, cfg.table_uri, sink.writer_id) == len(batches) - 1
    assert app_version(spark, cfg.table_uri, "another-writer") is None
