"""Checkpoints and expired log entries where Spark's writers leave them: after a commit whose
version is a multiple of `delta.checkpointInterval` (10 unless set), then the log entries
older than `delta.logRetentionDuration`, unless `delta.enableExpiredLogCleanup` is false;
removed files for VACUUM to keep for `delta.deletedFileRetentionDuration`."""

from pathlib import Path
from urllib.parse import unquote

import pyarrow as pa
import pytest
from deltalake import DeltaTable

from sink import UpsertSink
from sink.delta_log.checkpoints import checkpoint_if_due, checkpoint_interval, due, last_checkpoint
from tests.lakehouse.spark_sql_tables import create, log_actions, sink_config, spark_rows
from tests.oracle import SCHEMA, expected_rows, random_batches


@pytest.mark.parametrize("configuration, interval", [
    ({}, 10), ({"delta.checkpointInterval": "4"}, 4), ({"delta.checkpointInterval": "0"}, 10),
    ({"delta.checkpointInterval": "often"}, 10),
])
def test_the_interval_is_the_tables_or_sparks_default(configuration, interval):
    assert checkpoint_interval(configuration) == interval


@pytest.mark.parametrize("first, last, last_checkpoint, expected", [
    (9, 9, None, False), (10, 10, None, True), (9, 11, None, True), (11, 19, None, False),
    (10, 10, 10, False),  # delta-rs' own hook checkpointed it
    (19, 21, 10, True), (19, 21, 20, False), (31, 41, None, True),
])
def test_a_checkpoint_is_due_where_a_multiple_of_the_interval_is_not_covered_yet(first, last, last_checkpoint,
                                                                                 expected):
    assert due(first, last, 10, last_checkpoint) is expected


class FailingCheckpoints:
    """A table at version 10 whose checkpoint cannot be written."""

    def version(self):
        return 10

    def metadata(self):
        return type("Metadata", (), {"configuration": {}})()

    def protocol(self):
        return type("Protocol", (), {"writer_features": None})()

    def create_checkpoint(self):
        raise OSError("permission denied: _delta_log/00000000000000000010.checkpoint.parquet")


def test_a_checkpoint_that_fails_after_the_commit_is_logged_not_raised(tmp_path, caplog):
    assert checkpoint_if_due(FailingCheckpoints(), str(tmp_path), 10) is False
    assert f"{tmp_path}: no checkpoint at version 10: permission denied" in caplog.text


def checkpoints(uri: str) -> list[int]:
    return sorted(int(p.name.split(".")[0]) for p in Path(uri, "_delta_log").glob("*.checkpoint.parquet"))


def commits(uri: str) -> list[int]:
    return sorted(int(p.stem) for p in Path(uri, "_delta_log").glob("*.json"))


# Spark keeps the log at least as long as removed files.
EXPIRING = ("'delta.logRetentionDuration' = 'interval 0 seconds', "
            "'delta.deletedFileRetentionDuration' = 'interval 0 seconds'")


@pytest.mark.spark
@pytest.mark.parametrize("properties, expected_checkpoints, first_commit", [
    ("", [10], 0),
    ("TBLPROPERTIES ('delta.checkpointInterval' = '4')", [4, 8, 12], 0),
    (f"TBLPROPERTIES ({EXPIRING})", [10], 10),
    (f"TBLPROPERTIES ({EXPIRING}, 'delta.enableExpiredLogCleanup' = 'false')", [10], 0),
    ("TBLPROPERTIES ('delta.checkpointPolicy' = 'v2')", [], 0),  # v2 checkpoints only: none of delta-rs'
], ids=["spark's default interval", "the table's interval", "expired entries removed", "cleanup turned off",
        "v2 checkpoints"])
def test_the_sinks_batches_checkpoint_and_clean_the_log_as_sparks_writers_would(spark, tmp_path, properties,
                                                                               expected_checkpoints, first_commit):
    uri = str(tmp_path / "table")
    create(spark, uri, properties=properties)
    sink = UpsertSink(sink_config(tmp_path, uri))
    batches = random_batches(53, batches=12, per_batch=30, bad_share=0)
    for b, events in enumerate(batches):
        sink(spark.createDataFrame(events, SCHEMA), b)
    # Version 0: Spark's CREATE; 1: the sink's contract; then one version per batch.
    assert DeltaTable(uri).version() == 13
    assert checkpoints(uri) == expected_checkpoints
    assert last_checkpoint(uri) == (expected_checkpoints[-1] if expected_checkpoints else None)
    assert commits(uri) == list(range(first_commit, 14))
    assert spark_rows(spark, uri) == expected_rows(batches)
    scanned = pa.table(DeltaTable(uri).scan(columns=["id"])).column("id").to_pylist()
    assert sorted(scanned) == sorted(r["id"] for r in expected_rows(batches))


@pytest.mark.spark
def test_files_the_sink_removes_are_kept_by_vacuum_for_the_tables_retention(spark, tmp_path):
    """The sink deletes no file itself; its removes carry their time, by which Spark's VACUUM
    keeps them for `delta.deletedFileRetentionDuration` and then lists them, and no other."""
    uri = str(tmp_path / "table")
    create(spark, uri, properties="TBLPROPERTIES ('delta.deletedFileRetentionDuration' = 'interval 1 days')")
    sink = UpsertSink(sink_config(tmp_path, uri))
    batches = random_batches(67, batches=3, per_batch=60, bad_share=0)
    for b, events in enumerate(batches):
        sink(spark.createDataFrame(events, SCHEMA), b)
    removed = {str(Path(uri, unquote(a["path"]))) for _, name, a in log_actions(uri) if name == "remove"}
    assert removed and all(Path(p).exists() for p in removed)

    def vacuumed() -> set[str]:
        return {r[0].removeprefix("file:") for r in spark.sql(f"VACUUM delta.`{uri}` DRY RUN").collect()}

    assert vacuumed() == set()
    spark.sql(f"ALTER TABLE delta.`{uri}` SET TBLPROPERTIES "
              "('delta.deletedFileRetentionDuration' = 'interval 0 hours')")
    spark.conf.set("spark.databricks.delta.retentionDurationCheck.enabled", "false")
    try:
        assert vacuumed() == removed
    finally:
        spark.conf.unset("spark.databricks.delta.retentionDurationCheck.enabled")
    assert spark_rows(spark, uri) == expected_rows(batches)
