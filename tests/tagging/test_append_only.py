"""A table with `delta.appendOnly = true` (as Spark users create one) gets inserts only: a
key's records that would update or delete its stored row go to quarantine with their reason
(or fail the batch, by config), the rest are written, and no commit removes a file."""

import pyarrow as pa
import pytest
from deltalake import DeltaTable

from sink import SinkConfig, UpsertSink
from sink.errors import AppendOnlyError, ConfigError, UnsupportedTableError
from sink.tagging.append_only import stored_row_changes
from tests.lakehouse.spark_sql_tables import create, log_actions, spark_rows
from tests.oracle import SCHEMA, Event

APPEND_ONLY = "TBLPROPERTIES ('delta.appendOnly' = 'true')"


def config(tmp_path, uri: str, **options) -> SinkConfig:
    return SinkConfig(**{"table_uri": uri, "key": ["id"], "partition_by": ["dt"], "ordering": "ts",
                         "delete_when": "op = 'd'", "writer_id": "w", "index_dir": str(tmp_path / "index"),
                         "num_shards": 2, "metrics_port": 0, **options})


def test_the_records_of_a_key_whose_write_changes_its_stored_row_are_set_aside_with_its_reason():
    rows = pa.table({"id": ["a", "b", "a", "c", "d"]})
    groups = pa.array([b"p\x00a", b"p\x00b", b"p\x00a", b"p\x00c", b"p\x00d"])
    write = pa.array([None, "insert", "update", "delete", "tombstone"])
    aside, reasons = stored_row_changes(rows, groups, write, key_cols=["id"], table_uri="t", fails=False)
    assert aside.tolist() == [True, False, True, True, False]
    assert reasons == [f"append-only table: the key's records would {w} its stored row {{'id': {k!r}}} (t has "
                       "delta.appendOnly = true: inserts only)" for w, k in [("update", "a"), ("update", "a"),
                                                                             ("delete", "c")]]
    assert stored_row_changes(rows, groups, pa.array(["insert", None, None, "tombstone", None]), key_cols=["id"],
                              table_uri="t", fails=True) is None
    with pytest.raises(AppendOnlyError, match=r"would update its stored row \{'id': 'a'\} .* append_only_changes = "
                                              r"'fail': nothing was written"):
        stored_row_changes(rows, groups, write, key_cols=["id"], table_uri="t", fails=True)


@pytest.mark.spark
@pytest.mark.parametrize("tag_on", ["driver", "executors"])
def test_updates_and_deletes_of_stored_rows_go_to_quarantine_and_the_inserts_are_written(spark, tmp_path, tag_on):
    uri = str(tmp_path / "table")
    create(spark, uri, properties=APPEND_ONLY)
    created = DeltaTable(uri).version()
    sink = UpsertSink(config(tmp_path, uri, tag_on=tag_on))
    first = [Event("a", "d1", 1, "u", "a1"), Event("b", "d1", 1, "u", "b1"), Event("c", "d2", 1, "u", "c1")]
    sink(spark.createDataFrame(first, SCHEMA), 0)
    second = [Event("a", "d1", 2, "u", "a2"), Event("a", "d1", 3, "u", "a3"), Event("c", "d2", 2, "d", None),
              Event("e", "d1", 2, "u", "e2"), Event("f", "d2", 2, "u", "f1"), Event("f", "d2", 3, "u", "f2")]
    sink(spark.createDataFrame(second, SCHEMA), 1)
    assert spark_rows(spark, uri) == [
        {"id": i, "dt": d, "ts": t, "op": "u", "v": v}
        for i, d, t, v in [("a", "d1", 1, "a1"), ("b", "d1", 1, "b1"), ("e", "d1", 2, "e2"), ("c", "d2", 1, "c1"),
                           ("f", "d2", 3, "f2")]]
    quarantined = DeltaTable(sink.config.resolved_quarantine_uri).to_pyarrow_table().to_pylist()
    assert sorted((r["id"], r["ts"], r["_quarantine_reason"]) for r in quarantined) == [
        (k, ts, f"append-only table: the key's records would {w} its stored row {{'id': {k!r}}} ({uri} has "
                "delta.appendOnly = true: inserts only)") for k, ts, w in [("a", 2, "update"), ("a", 3, "update"),
                                                                            ("c", 2, "delete")]]
    report = sink.reports[-1]
    assert (report.records_in, report.ops["quarantined"], report.ops["insert"], report.ops["update"]) == (6, 3, 2, 0)
    ours = log_actions(uri, created + 1)
    assert [a for _, name, a in ours if name == "remove" and a["dataChange"]] == []
    assert [name for _, name, _ in ours if name == "protocol"] == []  # the contract recorded, no feature added
    sink(spark.createDataFrame(second, SCHEMA), 2)  # the same again: the index knows e and f now
    assert len(spark_rows(spark, uri)) == 5


@pytest.mark.spark
def test_with_fail_a_change_to_a_stored_row_fails_the_batch_and_writes_nothing(spark, tmp_path):
    uri = str(tmp_path / "table")
    create(spark, uri, properties=APPEND_ONLY)
    sink = UpsertSink(config(tmp_path, uri, tag_on="driver", append_only_changes="fail"))
    sink(spark.createDataFrame([Event("a", "d1", 1, "u", "a1")], SCHEMA), 0)
    version = DeltaTable(uri).version()
    with pytest.raises(AppendOnlyError, match=r"would update its stored row \{'id': 'a'\}"):
        sink(spark.createDataFrame([Event("a", "d1", 2, "u", "a2"), Event("b", "d1", 2, "u", "b2")], SCHEMA), 1)
    assert DeltaTable(uri).version() == version


@pytest.mark.spark
def test_a_history_table_made_append_only_by_its_owner_is_refused(spark, tmp_path):
    uri = str(tmp_path / "table")
    sink = UpsertSink(config(tmp_path, uri, tag_on="driver", scd_type=2))
    sink(spark.createDataFrame([Event("a", "d1", 1, "u", "a1")], SCHEMA), 0)
    spark.sql(f"ALTER TABLE delta.`{uri}` SET {APPEND_ONLY}")
    version = DeltaTable(uri).version()
    with pytest.raises(UnsupportedTableError, match="is append-only .* a history table"):
        sink(spark.createDataFrame([Event("a", "d1", 2, "u", "a2")], SCHEMA), 1)
    assert DeltaTable(uri).version() == version


def test_append_only_changes_names_its_values(tmp_path):
    with pytest.raises(ConfigError, match=r"append_only_changes.*'quarantine', 'fail'"):
        config(tmp_path, str(tmp_path / "t"), append_only_changes="drop").validate()


@pytest.mark.spark
def test_a_key_set_aside_for_an_unsent_value_too_leaves_the_rest_applied(spark, tmp_path):
    """Both kinds of set-aside in one shard: a change to a stored row, and a new key holding
    unchanged_value (nothing stored to keep): each quarantined with its own reason."""
    uri = str(tmp_path / "table")
    create(spark, uri, properties=APPEND_ONLY)
    sink = UpsertSink(config(tmp_path, uri, tag_on="driver", num_shards=1, unchanged_value="__unsent__"))
    sink(spark.createDataFrame([Event("a", "d1", 1, "u", "a1")], SCHEMA), 0)
    sink(spark.createDataFrame([Event("a", "d1", 2, "u", "a2"), Event("g", "d1", 2, "u", "__unsent__"),
                                Event("h", "d1", 2, "u", "h1")], SCHEMA), 1)
    assert [(r["id"], r["v"]) for r in spark_rows(spark, uri)] == [("a", "a1"), ("h", "h1")]
    quarantined = DeltaTable(sink.config.resolved_quarantine_uri).to_pyarrow_table().to_pylist()
    assert sorted((r["id"], r["_quarantine_reason"].split(":")[0]) for r in quarantined) == [
        ("a", "append-only table"), ("g", "unsent value")]
