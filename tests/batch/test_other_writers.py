"""Other writers' commits recorded where every replica finds them (sink.batch.other_writers):
what they delete, what a RESTORE undoes."""

import pyarrow as pa
import pytest
from deltalake import DeltaTable

from sink import OtherWriterCommitError, SinkConfig, UpsertSink
from sink.batch.other_writers import Undone, removed_rows, undone_by
from sink.delta_log.reading import CommitSummary
from tests import damage
from tests.lakehouse.spark_sql_tables import create, spark_rows
from tests.oracle import SCHEMA, Event, TableModel, random_batches


def commit(version, apps=None, operation="WRITE", parameters=None, sink=False):
    info = {"operation": operation, "operationParameters": parameters or {}}
    if sink:
        info["upsert_sink.shards"] = "0"
    return CommitSummary(version, apps or {}, frozenset(["p"]), info)


def test_removed_rows_are_the_keys_a_commit_left_without_a_row_at_their_newest_ordering():
    before = pa.table({"id": ["a", "b", "b", "c", None], "dt": ["1", "1", "1", "2", "1"], "ts": [1, 2, 5, 3, 9]})
    after = pa.table({"id": ["a", "c"], "dt": ["1", "1"], "ts": [7, 7]})
    # Partitioned scope: c moved to another partition, so (2, c) is gone; a null key is no key.
    assert removed_rows(before, after, ["id", "dt"], ["ts"]).to_pylist() == [
        {"id": "b", "dt": "1", "ts": 5}, {"id": "c", "dt": "2", "ts": 3}]
    # Global scope: c still has a row.
    assert removed_rows(before, after, ["id"], ["ts"]).to_pylist() == [{"id": "b", "dt": "1", "ts": 5}]


def test_a_restore_undoes_the_sink_batches_and_other_commits_after_its_version():
    restore = commit(9, operation="RESTORE", parameters={"version": 4, "timestamp": None})
    between = [commit(5, {"w": 3}, sink=True), commit(6, {"v": 10}, sink=True), commit(7, operation="DELETE"),
               commit(8, {"w": 4}, sink=True)]
    undone = undone_by(restore, 4, between)
    assert undone == Undone(4, 9, {"w": (3, 4), "v": (10, 10)})
    assert undone.versions == (5, 8)
    assert undone.predicate() == (
        "(`_tombstone_writer_id` = '(other writers)' AND `_tombstone_batch_id` BETWEEN 5 AND 8) OR "
        "(`_tombstone_writer_id` = 'w' AND `_tombstone_batch_id` BETWEEN 3 AND 4) OR "
        "(`_tombstone_writer_id` = 'v' AND `_tombstone_batch_id` BETWEEN 10 AND 10)")


def test_a_restore_back_into_what_an_earlier_restore_undid_is_refused_naming_both():
    # Version 6 restored to 2 (undoing 3..5, their tombstones dropped); version 8 restores to 4.
    earlier = commit(6, operation="RESTORE", parameters={"version": "2"})
    with pytest.raises(OtherWriterCommitError, match=r"version 8 \(RESTORE\).*version 6 \(RESTORE\) had undone"):
        undone_by(commit(8, operation="RESTORE", parameters={"version": 4}), 4, [commit(5), earlier, commit(7)])
    # A restore to a version after the earlier one's target undoes it as any other commit.
    assert undone_by(commit(8, operation="RESTORE", parameters={"version": 1}), 1,
                     [commit(v) for v in range(2, 6)] + [earlier, commit(7)]).batches == {}


# --- through the sink, on tables Spark SQL created ------------------------------------------------

def config(tmp_path, uri, **extra):
    settings = dict(table_uri=uri, key=["id"], partition_by=["dt"], ordering="ts", delete_when="op = 'd'",
                    writer_id="w", index_dir=str(tmp_path / "index"), num_shards=2, metrics_port=0, tag_on="driver")
    return SinkConfig(**{**settings, **extra})


def table_rows(uri):
    rows = pa.table(DeltaTable(uri).scan(columns=["id", "dt", "ts", "op", "v"])).to_pylist()
    return sorted(rows, key=lambda r: (r["dt"], r["id"]))


@pytest.mark.spark
def test_a_restore_two_batches_back_leaves_the_table_as_if_they_never_came(spark, tmp_path, caplog):
    """The issue's case: RESTORE ... TO VERSION AS OF two sink batches back, on a table with a
    change data feed. Rows the restore brought back, deletes it undid, keys its undone batches
    inserted: the next batches apply to the table as restored, and a rebuilt replica agrees
    (under delta-spark, and during a batch: tests/test_maintenance.py)."""
    uri = str(tmp_path / "t")
    create(spark, uri, properties="TBLPROPERTIES ('delta.enableChangeDataFeed' = 'true')")
    cfg = config(tmp_path, uri)
    batches = random_batches(7, batches=8, per_batch=200, bad_share=0)
    model, sink = TableModel(), UpsertSink(cfg)
    for b, events in enumerate(batches):
        if b == 4:
            version = DeltaTable(uri).version()
            spark.sql(f"RESTORE TABLE delta.`{uri}` TO VERSION AS OF {version - 2}")
            model.restore(version - 2)
        if b == 6:  # what the restore undid is remembered by the tables, not only the replicas
            sink.close()
            damage.lose(tmp_path / "index")
            sink = UpsertSink(cfg)
        sink(spark.createDataFrame(events, SCHEMA), b)
        model.batch(events)
        model.remember(DeltaTable(uri).version())
        assert table_rows(uri) == model.rows(), f"after batch {b}"
    assert spark_rows(spark, uri) == model.rows()
    restored = [r.getMessage() for r in caplog.records if "RESTORE" in r.getMessage()]
    assert len(restored) == 1 and "batches 2..3 of writer 'w'" in restored[0], restored
    sink.close()


@pytest.mark.spark
def test_a_key_the_restore_brought_back_is_deleted_by_a_newer_delete_and_its_undone_deletes_no_longer_count(
        spark, tmp_path):
    uri = str(tmp_path / "t")
    create(spark, uri)
    sink = UpsertSink(config(tmp_path, uri))
    sink(spark.createDataFrame([Event("k", "2025-01-01", 1, "u", "first")], SCHEMA), 0)
    sink(spark.createDataFrame([Event("k", "2025-01-01", 5, "d", "gone"), Event("m", "2025-01-01", 5, "d", "x")],
                               SCHEMA), 1)
    version = DeltaTable(uri).version()
    spark.sql(f"RESTORE TABLE delta.`{uri}` TO VERSION AS OF {version - 1}")
    # k is back at ts 1: a delete newer than that removes it. The restore undid the delete of m
    # at ts 5: an upsert of m older than it is written.
    sink(spark.createDataFrame([Event("k", "2025-01-01", 3, "d", "again"), Event("m", "2025-01-01", 2, "u", "new")],
                               SCHEMA), 2)
    assert [(r["id"], r["v"]) for r in table_rows(uri)] == [("m", "new")]
    sink.close()


@pytest.mark.spark
@pytest.mark.parametrize("rebuilt", [False, True], ids=["replica kept", "replica rebuilt"])
def test_a_delete_by_another_writer_outlives_a_rebuilt_replica(spark, tmp_path, rebuilt):
    """The issue's case: a GDPR DELETE by Spark SQL on a table with a change data feed, then the
    replicas rebuilt (as after a SIGKILL): older re-deliveries of the deleted keys stay out
    either way, newer ones come back."""
    uri = str(tmp_path / "t")
    create(spark, uri, properties="TBLPROPERTIES ('delta.enableChangeDataFeed' = 'true')")
    cfg = config(tmp_path, uri)
    first = [Event(f"k{i}", "2025-01-01", 10, "u", "first") for i in range(6)]
    model, sink = TableModel(), UpsertSink(cfg)
    sink(spark.createDataFrame(first, SCHEMA), 0)
    model.batch(first)
    spark.sql(f"DELETE FROM delta.`{uri}` WHERE id IN ('k1', 'k2', 'k3')")
    model.removed([("2025-01-01", k) for k in ("k1", "k2", "k3")])
    if rebuilt:
        sink.close()
        damage.lose(tmp_path / "index")
        sink = UpsertSink(cfg)
    again = [Event("k1", "2025-01-01", 9, "u", "older re-delivery"), Event("k2", "2025-01-01", 10, "u", "tie"),
             Event("k3", "2025-01-01", 11, "u", "newer"), Event("k4", "2025-01-01", 9, "u", "stale")]
    sink(spark.createDataFrame(again, SCHEMA), 1)
    model.batch(again)
    assert table_rows(uri) == model.rows()
    assert {r["id"] for r in table_rows(uri)} == {"k0", "k2", "k3", "k4", "k5"}
    assert sink.reports[-1].ops["stale"] == 2
    sink.close()
