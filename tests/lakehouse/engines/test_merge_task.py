"""delta-rs' MERGE from one Spark task (sink.lakehouse.engines.merge_task): the writes executors tagged
never come to the driver; a task Spark runs again after its commit commits nothing; a task
that lost the race to another writer reports it."""

import json

import pyarrow as pa
import pytest
from deltalake import DeltaTable, write_deltalake

from sink import SinkConfig, UpsertSink
from sink.lakehouse.commit.writes import WRITE_COLUMN
from sink.lakehouse.engines import merge_task
from sink.lakehouse.engines.delta_rs import DeltaTarget
from sink.lakehouse.engines.merge_clauses import UpsertSpec, upsert_clauses
from sink.session import is_connect
from tests import damage
from tests.oracle import SCHEMA, expected_rows, random_batches, verify_replicas

TABLE = pa.schema([("id", pa.string()), ("dt", pa.string()), ("ts", pa.int64()), ("op", pa.string()),
                   ("v", pa.string())])


def task(uri: str, version: int, *, batch_id: int = 1, merge: bool = True) -> merge_task.MergeTask:
    spec = UpsertSpec(TABLE, TABLE.names, ["id"], ["ts"], ["dt"], incoming_wins_ties=True, partial=False)
    clauses = upsert_clauses(spec, [{"dt": "2025-01-01"}]) if merge else None
    return merge_task.MergeTask(uri, version, TABLE, clauses, False, "w", batch_id, {"upsert_sink.shards": "0"})


def writes(*rows: tuple) -> list[pa.RecordBatch]:
    """One batch per row, strings as Spark's Arrow hands them (large strings)."""
    large = pa.schema([pa.field(f.name, pa.large_string() if f.type == pa.string() else f.type)
                       for f in [*TABLE, pa.field(WRITE_COLUMN, pa.string())]])
    return [pa.RecordBatch.from_pylist([dict(zip(large.names, r))], schema=large) for r in rows]


def outcome(batches: list[pa.RecordBatch]) -> merge_task.TaskOutcome:
    return merge_task.TaskOutcome(**json.loads(batches[0].column(0)[0].as_py()))


def table_rows(uri: str) -> list[dict]:
    return sorted(DeltaTable(uri).to_pyarrow_table().to_pylist(), key=lambda r: (r["dt"], r["id"]))


@pytest.fixture
def stored(tmp_path) -> str:
    uri = str(tmp_path / "table")
    write_deltalake(uri, pa.Table.from_pylist([{"id": "a", "dt": "2025-01-01", "ts": 1, "op": "u", "v": "old"},
                                               {"id": "b", "dt": "2025-01-01", "ts": 1, "op": "u", "v": "b"}],
                                              schema=TABLE), partition_by=["dt"])
    return uri


def test_the_task_merges_its_stream_and_a_second_run_commits_nothing(stored):
    batches = writes(("a", "2025-01-01", 2, "u", "new", "update"), ("b", "2025-01-01", 2, "d", None, "delete"),
                     ("c", "2025-01-01", 2, "u", "c", "insert"))
    first = outcome(list(merge_task._commit(task(stored, 0), iter(batches))))
    assert (first.updated, first.committed_before, first.conflict) == (1, False, None)
    assert [(r["id"], r["v"]) for r in table_rows(stored)] == [("a", "new"), ("c", "c")]
    assert DeltaTable(stored).transaction_version("w") == 1
    # Spark runs the task again (its executor was lost after the commit): nothing is written.
    again = outcome(list(merge_task._commit(task(stored, 0), iter(batches))))
    assert again.committed_before and DeltaTable(stored).version() == 1


def test_a_task_behind_another_writers_commit_reports_the_conflict_and_writes_nothing(stored):
    write_deltalake(stored, pa.Table.from_pylist([{"id": "x", "dt": "2025-01-02", "ts": 1, "op": "u", "v": "x"}],
                                                 schema=TABLE), mode="append")
    got = outcome(list(merge_task._commit(task(stored, 0), iter(writes(("a", "2025-01-01", 2, "u", "new",
                                                                        "update"))))))
    assert "a commit landed after version 0, which the batch was tagged against" in got.conflict
    assert DeltaTable(stored).version() == 1 and DeltaTable(stored).transaction_version("w") is None


def test_an_append_task_appends_the_inserts(stored):
    batches = [b.drop_columns([WRITE_COLUMN]) for b in writes(("c", "2025-01-01", 2, "u", "c", "insert"))]
    got = outcome(list(merge_task._commit(task(stored, 0, merge=False), iter(batches))))
    assert (got.updated, got.conflict) == (0, None)
    assert [r["id"] for r in table_rows(stored)] == ["a", "b", "c"]


@pytest.mark.spark
@pytest.mark.connect
def test_executor_tagging_under_delta_rs_merge_never_brings_the_writes_to_the_driver(spark, tmp_path, monkeypatch):
    """commit_mode = "merge" makes updates commit through delta-rs' MERGE: from one Spark task,
    the driver-held commit never taken. The table is exact after every batch, a replay and a
    lost replica; the feed, replayed alone, gives the same table. Through Spark Connect too
    (where the client cannot list the server's cached data)."""
    def driver_held(*args, **kwargs):
        raise AssertionError("the batch's writes came to the driver")

    monkeypatch.setattr(DeltaTarget, "commit", driver_held)
    uri = str(tmp_path / "table")
    DeltaTable.create(uri, TABLE, partition_by=["dt"], configuration={"delta.enableChangeDataFeed": "true"})
    cfg = SinkConfig(table_uri=uri, key=["id"], partition_by=["dt"], ordering="ts", delete_when="op = 'd'",
                     writer_id="w", index_dir=str(tmp_path / "index"), num_shards=3, metrics_port=0,
                     tag_on="executors", engine="deltalake", commit_mode="merge")
    sink = UpsertSink(cfg)
    batches = random_batches(61, batches=5, per_batch=200)
    for b, events in enumerate(batches):
        if b == 3:
            damage.lose(tmp_path / "index")
        sink(spark.createDataFrame(events, SCHEMA), b)
        assert table_rows(uri) == expected_rows(batches[: b + 1]), f"after batch {b}"
        if b == 2:
            version = DeltaTable(uri).version()
            sink(spark.createDataFrame(events, SCHEMA), b)  # a replay
            assert sink.reports[-1].mode == "skipped" and DeltaTable(uri).version() == version
    assert [r.mode for r in sink.reports if r.mode != "skipped"] == ["append", "merge", "merge", "merge", "merge"]
    assert table_rows(uri) == sorted(replayed_feed(uri).values(), key=lambda r: (r["dt"], r["id"]))
    if not is_connect(spark):
        cached = [str(rdd.name()) for rdd in spark.sparkContext._jsc.getPersistentRDDs().values()]
        assert [name for name in cached if not name.startswith("Delta Table State")] == []  # the writes were let go
    sink.close()
    assert sum(r["entries_checked"] for r in verify_replicas(cfg)) > 0


def replayed_feed(uri: str) -> dict[tuple, dict]:
    """The table rebuilt from its change data feed alone, in commit order."""
    changes = pa.table(DeltaTable(uri).load_cdf(starting_version=0)).to_pylist()
    state: dict[tuple, dict] = {}
    for change in sorted(changes, key=lambda c: c["_commit_version"]):
        row = {f: change[f] for f in TABLE.names}
        if change["_change_type"] in ("insert", "update_postimage"):
            state[(row["dt"], row["id"])] = row
        elif change["_change_type"] == "delete":
            state.pop((row["dt"], row["id"]), None)
    return state
