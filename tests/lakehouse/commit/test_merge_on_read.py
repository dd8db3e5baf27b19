"""Merge-on-read: on a table with deletion vectors, a batch's updates and deletes mark the
stored rows in deletion vectors and write only the new row versions; Spark and delta-rs read
the table as the oracle has it after every batch."""

import json
from pathlib import Path
from urllib.parse import unquote

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from deltalake import DeltaTable, QueryBuilder
from deltalake.exceptions import CommitFailedError
from pyspark.sql import functions as F

from sink import ConstraintViolationError, SinkConfig, UpsertSink
from sink.delta_log import log_commit
from sink.delta_log.contract import Contract
from sink.delta_log.live_vectors import LiveDeletionVectors
from sink.lakehouse.commit.merge_on_read import rewrites
from sink.lakehouse.commit.writes import commit_properties
from sink.lakehouse.engines.delta_rs import DeltaTarget
from tests.lakehouse.spark_sql_tables import (
    COLUMNS,
    FEATURE_RICH_CONSTRAINT,
    FEATURE_RICH_REASON,
    amount_of,
    create,
    spark_rows,
)
from tests.oracle import SCHEMA, Event, expected_global_rows, expected_rows, random_batches, random_global_batches

pytestmark = pytest.mark.spark

# Checkpoints every 4 versions: a restarted sink reads the files' vectors from one delta-rs wrote.
DV_TABLE = "TBLPROPERTIES ('delta.enableDeletionVectors' = 'true', 'delta.checkpointInterval' = '4')"


def config(tmp_path, uri: str, tag_on: str, **extra) -> SinkConfig:
    return SinkConfig(table_uri=uri, key=["id"], partition_by=["dt"], ordering="ts", delete_when="op = 'd'",
                      writer_id="w", index_dir=str(tmp_path / "index"), num_shards=2, metrics_port=0, tag_on=tag_on,
                      engine="deltalake", **extra)


def two_batches_in(spark, tmp_path, seed: int):
    """A deletion-vector table Spark SQL created, its sink (driver tagging) two batches of three
    in: the table, the three batches and the sink."""
    uri = str(tmp_path / "table")
    create(spark, uri, properties=DV_TABLE)
    batches = random_batches(seed, batches=3, per_batch=200, bad_share=0)
    sink = UpsertSink(config(tmp_path, uri, "driver"))
    for b, events in enumerate(batches[:2]):
        sink(spark.createDataFrame(events, SCHEMA), b)
    return uri, batches, sink


def delta_rs_rows(uri: str) -> list[dict]:
    read = QueryBuilder().register("t", DeltaTable(uri)).execute("SELECT id, dt, ts, op, v FROM t").read_all()
    return sorted(pa.table(read).to_pylist(), key=lambda r: (r["dt"], r["id"]))


def log_actions(uri: str, version: int) -> list[dict]:
    return [json.loads(line) for line in (Path(uri) / "_delta_log" / f"{version:020d}.json").read_text().splitlines()]


@pytest.mark.parametrize("marked, physical, share, rewritten", [
    (4, 10, 0.5, False), (5, 10, 0.5, True), (9, 10, 1.0, False), (10, 10, 1.0, True), (1, 10, 0.0, True),
    (1, 3, 0.34, False), (2, 3, 0.34, True),
])
def test_a_file_is_rewritten_once_its_marked_rows_reach_the_share(marked, physical, share, rewritten):
    assert rewrites(marked, physical, share) is rewritten


@pytest.mark.connect(tag_on="executors")  # the writing tasks in a Connect server's executors
@pytest.mark.parametrize("tag_on", ["driver", "executors"])
def test_a_stream_on_a_deletion_vector_table_marks_rows_and_reads_as_the_oracle(spark, tmp_path, tag_on):
    uri = str(tmp_path / "table")
    create(spark, uri, properties=DV_TABLE)
    batches = random_batches(47, batches=6, per_batch=200, bad_share=0)
    sink = UpsertSink(config(tmp_path, uri, tag_on))
    for b, events in enumerate(batches):
        if b == 3:  # a restart: the files' vectors are read again, from the log and its checkpoint
            sink = UpsertSink(config(tmp_path, uri, tag_on))
        sink(spark.createDataFrame(events, SCHEMA), b)
        if b == 2:  # a replay changes nothing
            sink(spark.createDataFrame(events, SCHEMA), b)
        expected = expected_rows(batches[: b + 1])
        assert spark_rows(spark, uri) == expected, f"Spark after batch {b}"
        assert delta_rs_rows(uri) == expected, f"delta-rs after batch {b}"
    assert [r.mode for r in sink.reports] == ["merge-on-read"] * 3
    table = DeltaTable(uri)
    marked = pa.table(table.deletion_vectors()).num_rows
    assert marked > 0
    history = spark.sql(f"DESCRIBE HISTORY delta.`{uri}`").where("operation = 'MERGE'").collect()
    assert len(history) == 5 and all(json.loads(h.userMetadata)["upsert_sink.commit"] == "merge-on-read"
                                      for h in history)
    # Every batch marked rows: a file it removed is added back with its new vector, or was
    # rewritten (half its rows marked, rewrite_marked_share) or entirely deleted.
    for version in (h.version for h in history):
        actions = log_actions(uri, version)
        removed = {a["remove"]["path"] for a in actions if "remove" in a}
        readded = {a["add"]["path"] for a in actions if "add" in a and "deletionVector" in a["add"]}
        assert readded <= removed and readded, f"version {version}"
    for r in sink.reports:  # the batch line's counts are its commit's
        actions = log_actions(uri, r.table_version)
        removed = {a["remove"]["path"] for a in actions if "remove" in a}
        readded = {a["add"]["path"] for a in actions if "add" in a and "deletionVector" in a["add"]}
        assert (r.files_marked, r.files_rewritten) == (len(readded), len(removed - readded)) != (0, 0)
        assert f"files_marked={r.files_marked} files_rewritten={r.files_rewritten} " in r.summary()
    assert any(p.name.endswith(".checkpoint.parquet") for p in (Path(uri) / "_delta_log").iterdir())


def test_a_commit_another_writer_got_to_first_fails_and_leaves_its_version_alone(spark, tmp_path):
    uri = str(tmp_path / "table")
    create(spark, uri, properties=DV_TABLE)
    spark.sql(f"INSERT INTO delta.`{uri}` VALUES ('a', 'd1', 1, 'u', 'x'), ('b', 'd1', 1, 'u', 'x')")
    table = DeltaTable(uri)
    spark.sql(f"DELETE FROM delta.`{uri}` WHERE id = 'a'")  # lands on the version the sink would take
    theirs = (Path(uri) / "_delta_log" / f"{table.version() + 1:020d}.json").read_bytes()
    with pytest.raises(CommitFailedError, match=f"version {table.version() + 1} was committed by another writer"):
        log_commit.commit(table, uri, [], commit_properties("w", 0, {}, "merge-on-read"), operation="MERGE",
                          parameters={}, metrics={})
    assert (Path(uri) / "_delta_log" / f"{table.version() + 1:020d}.json").read_bytes() == theirs


def test_spark_compacting_the_files_between_tagging_and_commit_is_a_conflict_retried_exactly(
        spark, tmp_path, monkeypatch):
    """OPTIMIZE rewrites the marked files: the row positions the batch found are stale, so its
    commit must not land on top; it is retried against the compacted files."""
    uri, batches, sink = two_batches_in(spark, tmp_path, seed=53)
    commit = log_commit.commit
    optimized = []

    def optimize_first(table, *args, **kwargs):
        if not optimized:
            optimized.append(spark.sql(f"OPTIMIZE delta.`{uri}`").collect())
        return commit(table, *args, **kwargs)

    monkeypatch.setattr(log_commit, "commit", optimize_first)
    sink(spark.createDataFrame(batches[2], SCHEMA), 2)
    assert optimized and sink.reports[-1].mode == "merge-on-read" and sink.reports[-1].retries == 1
    assert spark.sql(f"DESCRIBE HISTORY delta.`{uri}`").where("operation = 'OPTIMIZE'").count() == 1
    assert spark_rows(spark, uri) == expected_rows(batches)
    assert delta_rs_rows(uri) == expected_rows(batches)


def test_a_table_with_a_feature_the_commit_does_not_write_merges_and_says_which(spark, tmp_path, caplog):
    uri = str(tmp_path / "table")
    create(spark, uri, properties="TBLPROPERTIES ('delta.enableDeletionVectors' = 'true', "
                                  "'delta.enableInCommitTimestamps' = 'true')")
    target = DeltaTarget(uri, ["dt"])
    target.open_or_create(pa.schema([]), Contract(("id",), ("dt",), "ts", "partitioned"))
    assert target.update_mode() == "merge"
    assert "the table feature 'inCommitTimestamp', which the sink's log commit does not write" in caplog.text
    plain = str(tmp_path / "plain")
    create(spark, plain, properties=DV_TABLE)
    spark.sql(f"ALTER TABLE delta.`{plain}` SET TBLPROPERTIES ('delta.enableDeletionVectors' = 'false')")
    target = DeltaTarget(plain, ["dt"])
    target.open_or_create(pa.schema([]), Contract(("id",), ("dt",), "ts", "partitioned"))
    assert target.update_mode() == "merge"  # no new vectors while the property is off
    assert "deletion vectors (a rewrite's remove cannot carry the file's deletion vector)" in caplog.text


def oracle_changes(before: list[dict], after: list[dict]) -> list[tuple]:
    """What a batch changed, as the change data feed spells it: new keys inserted, gone keys
    deleted, changed rows as their pre- and post-images."""
    old = {(r["dt"], r["id"]): r for r in before}
    new = {(r["dt"], r["id"]): r for r in after}
    changes = [("insert", r) for k, r in new.items() if k not in old]
    changes += [("delete", r) for k, r in old.items() if k not in new]
    for k in old.keys() & new.keys():
        if old[k] != new[k]:
            changes += [("update_preimage", old[k]), ("update_postimage", new[k])]
    return sorted((kind, r["id"], r["dt"], r["ts"], r["op"], r["v"]) for kind, r in changes)


@pytest.mark.parametrize("properties, tag_on, update_mode", [
    ("'delta.enableDeletionVectors' = 'true', 'delta.enableChangeDataFeed' = 'true'", "driver", "merge-on-read"),
    ("'delta.enableChangeDataFeed' = 'true'", "executors", "rewrite"),
], ids=["deletion vectors, driver", "copy-on-write, executors"])
def test_the_change_data_feed_spark_reads_is_each_batchs_changes(spark, tmp_path, properties, tag_on, update_mode):
    uri = str(tmp_path / "table")
    create(spark, uri, properties=f"TBLPROPERTIES ({properties})")
    batches = random_batches(59, batches=4, per_batch=200, bad_share=0)
    sink = UpsertSink(config(tmp_path, uri, tag_on))
    for b, events in enumerate(batches):
        sink(spark.createDataFrame(events, SCHEMA), b)
        version = sink.reports[-1].table_version
        feed = (spark.read.format("delta").option("readChangeFeed", "true").option("startingVersion", version)
                .option("endingVersion", version).load(uri).collect())
        got = sorted((r["_change_type"], r["id"], r["dt"], r["ts"], r["op"], r["v"]) for r in feed)
        assert got == oracle_changes(expected_rows(batches[:b]), expected_rows(batches[: b + 1])), f"batch {b}"
        by_delta_rs = pa.table(DeltaTable(uri).load_cdf(starting_version=version, ending_version=version))
        assert sorted((r["_change_type"], r["id"], r["dt"], r["ts"], r["op"], r["v"])
                      for r in by_delta_rs.to_pylist()) == got, f"delta-rs' feed, batch {b}"
        assert spark_rows(spark, uri) == expected_rows(batches[: b + 1]), f"batch {b}"
    assert [r.mode for r in sink.reports] == ["append", *[update_mode] * 3]
    assert any(p.is_file() for p in (Path(uri) / "_change_data").rglob("*.parquet"))


def test_a_batch_killed_between_its_vector_files_and_its_log_entry_leaves_only_unreferenced_files(
        spark, tmp_path, monkeypatch):
    uri, batches, sink = two_batches_in(spark, tmp_path, seed=61)
    version, files = DeltaTable(uri).version(), set(Path(uri).glob("deletion_vector_*.bin"))

    def killed(*args, **kwargs):
        raise KeyboardInterrupt("killed before the log entry")

    monkeypatch.setattr(log_commit, "commit", killed)
    with pytest.raises(KeyboardInterrupt):
        sink(spark.createDataFrame(batches[2], SCHEMA), 2)
    monkeypatch.undo()
    left = set(Path(uri).glob("deletion_vector_*.bin")) - files
    assert left and DeltaTable(uri).version() == version  # its vectors written, no commit names them
    live = {d.file_location(uri) for d in LiveDeletionVectors(uri).at(version).values()}
    assert not {str(p) for p in left} & live
    assert spark_rows(spark, uri) == expected_rows(batches[:2])
    sink = UpsertSink(config(tmp_path, uri, "driver"))  # the restart after the kill
    sink(spark.createDataFrame(batches[2], SCHEMA), 2)
    assert spark_rows(spark, uri) == expected_rows(batches)


@pytest.mark.parametrize("tag_on", ["driver", "executors"])
def test_a_global_scope_stream_on_a_deletion_vector_table_moves_keys_between_partitions_exactly(
        spark, tmp_path, tag_on):
    """Global scope: a key moving partition deletes its stored row there (a mark in that
    partition's file) and writes it in the new one."""
    uri = str(tmp_path / "table")
    create(spark, uri, properties=DV_TABLE)
    batches = random_global_batches(63, batches=4, per_batch=200)
    sink = UpsertSink(SinkConfig(table_uri=uri, key=["id"], partition_by=["dt"], ordering="ts",
                                 delete_when="op = 'd'", scope="global", writer_id="g", num_shards=2,
                                 index_dir=str(tmp_path / "index"), metrics_port=0, tag_on=tag_on,
                                 engine="deltalake"))
    for b, events in enumerate(batches):
        sink(spark.createDataFrame(events, SCHEMA), b)
        assert spark_rows(spark, uri) == expected_global_rows(batches[: b + 1]), f"after batch {b}"
    assert "merge-on-read" in [r.mode for r in sink.reports]


GENERATED_REASON = "generated column g (`g` <=> (upper(v))) violated"


def breaks_generated(e: Event) -> bool:
    """One upsert in seven carries a generated value other than its expression's (`checked_events`)."""
    return e.ts % 7 == 0 and (e.v or "").lower() != (e.v or "").upper()


def checked_events(spark, events: list[Event]):
    rows = [(*e, amount_of(e)) for e in events]
    return spark.createDataFrame(rows, SCHEMA + ", amount long").selectExpr(
        "*", "CASE WHEN ts % 7 = 0 THEN lower(v) ELSE upper(v) END AS g")


@pytest.mark.parametrize("tag_on", ["driver", "executors"])
def test_records_breaking_a_constraint_or_a_generated_column_never_reach_a_deletion_vector_table(
        spark, tmp_path, tag_on):
    """A CHECK constraint and a generated column, which Delta checks on every row written: the
    sink checks the records before marking and writing (no MERGE), sets the breaking ones aside
    naming what they break, and under check_constraints = "fail" refuses the batch, nothing
    committed."""
    uri = str(tmp_path / "table")
    create(spark, uri, columns=COLUMNS + ", amount BIGINT, g STRING GENERATED ALWAYS AS (upper(v))",
           properties=DV_TABLE, constraint=FEATURE_RICH_CONSTRAINT)
    batches = random_batches(64, batches=4, per_batch=200, bad_share=0)
    sink = UpsertSink(config(tmp_path, uri, tag_on))
    written = [[e for e in events if e.op == "d" or (amount_of(e) >= 0 and not breaks_generated(e))]
               for events in batches]
    for b, events in enumerate(batches):
        sink(checked_events(spark, events), b)
        assert spark_rows(spark, uri) == expected_rows(written[: b + 1]), f"after batch {b}"
    assert [r.mode for r in sink.reports] == ["append", *["merge-on-read"] * 3]
    table = spark.read.format("delta").load(uri)
    assert table.where("g IS DISTINCT FROM upper(v) OR amount < 0").count() == 0
    quarantined = DeltaTable(f"{uri}_quarantine").to_pyarrow_table(columns=["_quarantine_reason"])
    reasons = quarantined.column("_quarantine_reason").to_pylist()
    upserts = [e for events in batches for e in events if e.op != "d"]
    assert reasons.count(FEATURE_RICH_REASON) == sum(amount_of(e) < 0 for e in upserts) > 0
    assert reasons.count(GENERATED_REASON) == sum(amount_of(e) >= 0 and breaks_generated(e) for e in upserts) > 0
    sink.close()
    failing = UpsertSink(config(tmp_path, uri, tag_on, check_constraints="fail"))
    version = DeltaTable(uri).version()
    bad = Event("neg", "2025-01-01", 99, "u", "P")  # amount_of: -10
    with pytest.raises(ConstraintViolationError, match=r"key \{'id': 'neg'\} breaks .*CHECK constraint "
                                                        r"amount_not_negative \(amount >= 0\) violated"):
        failing(checked_events(spark, [Event("ok", "2025-01-02", 97, "u", "y"), bad]), 4)
    assert DeltaTable(uri).version() == version
    failing(checked_events(spark, [Event("ok", "2025-01-02", 97, "u", "y")]), 4)
    assert failing.reports[-1].mode == "append"
    assert spark_rows(spark, uri) == expected_rows([*written, [Event("ok", "2025-01-02", 97, "u", "y")]])
    failing.close()


def parquet_columns(uri: str, version: int) -> list[pa.Schema]:
    """The schemas of the data and change files a version added."""
    return [pq.read_schema(Path(uri) / unquote(a[kind]["path"])) for a in log_actions(uri, version)
            for kind in ("add", "cdc") if kind in a and "deletionVector" not in a[kind]]


@pytest.mark.parametrize("mode, tag_on", [("name", "executors"), ("id", "driver")])
def test_a_column_mapped_table_is_marked_and_written_under_physical_names_through_a_rename(
        spark, tmp_path, mode, tag_on):
    """Column mapping: stored files are read and new ones written under the columns' physical
    names (by field id in id mode), so a column renamed between batches keeps its values in the
    files written before; Spark reads the table and each batch's change feed as the oracle's."""
    uri = str(tmp_path / "table")
    create(spark, uri, properties=f"TBLPROPERTIES ('delta.columnMapping.mode' = '{mode}', "
                                  "'delta.enableDeletionVectors' = 'true', 'delta.enableChangeDataFeed' = 'true')")
    batches = random_batches(65, batches=4, per_batch=200, bad_share=0)
    sink = UpsertSink(config(tmp_path, uri, tag_on))
    for b, events in enumerate(batches):
        if b == 2:
            spark.sql(f"ALTER TABLE delta.`{uri}` RENAME COLUMN v TO value")
        value = "value" if b >= 2 else "v"
        sink(spark.createDataFrame(events, SCHEMA).withColumnRenamed("v", value), b)
        table = spark.read.format("delta").load(uri).select("id", "dt", "ts", "op", F.col(value).alias("v"))
        got = sorted((r.asDict() for r in table.collect()), key=lambda r: (r["dt"], r["id"]))
        assert got == expected_rows(batches[: b + 1]), f"after batch {b}"
        version = sink.reports[-1].table_version
        feed = (spark.read.format("delta").option("readChangeFeed", "true").option("startingVersion", version)
                .option("endingVersion", version).load(uri).collect())
        changes = sorted((r["_change_type"], r["id"], r["dt"], r["ts"], r["op"], r[value]) for r in feed)
        assert changes == oracle_changes(expected_rows(batches[:b]), expected_rows(batches[: b + 1])), f"batch {b}"
    assert [r.mode for r in sink.reports] == ["append", *["merge-on-read"] * 3]
    physical = {f["name"]: f["metadata"] for f in json.loads(DeltaTable(uri).schema().to_json())["fields"]}
    for report in sink.reports[1:]:
        for schema in parquet_columns(uri, report.table_version):
            data = [f for f in schema if f.name != "_change_type"]
            assert {f.name for f in data} == {physical[c]["delta.columnMapping.physicalName"]
                                              for c in ("id", "ts", "op", "value")}
            assert {int(f.metadata[b"PARQUET:field_id"]) for f in data} == {
                physical[c]["delta.columnMapping.id"] for c in ("id", "ts", "op", "value")}
