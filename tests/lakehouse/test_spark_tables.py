"""Tables created by Spark SQL with the features Spark users turn on, written by the sink's
deltalake engine: exact where delta-rs honours the feature (read back through Spark), refused
before anything is written, naming the feature, where it cannot."""

import json
from pathlib import Path

import pyarrow as pa
import pytest
from deltalake import DeltaTable

from sink import UpsertSink
from sink.errors import SchemaError, UnsupportedTableError
from tests.lakehouse.spark_sql_tables import COLUMNS, create, last_action, log_actions, sink_config, spark_rows
from tests.oracle import SCHEMA, expected_rows, random_batches

pytestmark = pytest.mark.spark


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
    ("TBLPROPERTIES ('delta.checkpointPolicy' = 'v2')", "", "rewrite"),
    # The sink's replay of live deletion vectors reads classic checkpoints only.
    ("TBLPROPERTIES ('delta.checkpointPolicy' = 'v2', 'delta.enableDeletionVectors' = 'true')", "", "merge"),
], ids=["deletion vectors", "change data feed", "column mapping", "column mapping by id, deletion vectors, feed",
        "CHECK constraint", "v2 checkpoints", "v2 checkpoints, deletion vectors"])
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
    sink = UpsertSink(sink_config(tmp_path, uri))
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
    sink = UpsertSink(sink_config(tmp_path, uri))
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
    sink = UpsertSink(sink_config(tmp_path, uri))
    df = spark.createDataFrame(random_batches(42, batches=1, per_batch=50, bad_share=0)[0], SCHEMA)
    message = rf"uses {named} \(.*\): delta-rs cannot write it; engine = 'delta-spark', or 'auto' in a session with " \
              r"Delta's extension, writes it through Spark; nothing was written"
    with pytest.raises(UnsupportedTableError, match=message):
        sink.validate(df)  # the job's check before its query starts
    with pytest.raises(UnsupportedTableError, match=message):
        sink(df, 0)
    assert DeltaTable(uri).version() == version
    assert spark_rows(spark, uri) == []


@pytest.mark.parametrize("properties, update_mode", [
    ("", "rewrite"),
    ("TBLPROPERTIES ('delta.enableDeletionVectors' = 'true')", "merge-on-read"),
], ids=["plain", "deletion vectors"])
def test_a_shallow_clone_is_updated_and_its_source_left_as_it_was(spark, tmp_path, properties, update_mode):
    """A shallow clone's add actions name the source's files (and deletion vectors) by
    absolute, percent-encoded URI: here under a directory with a space, in partitions whose
    values hold a colon and a percent sign, which Spark escapes in the directory name and the
    log encodes again. The sink reads, marks and removes them there; the source keeps them."""
    source, clone = str(tmp_path / "source table"), str(tmp_path / "clone")
    create(spark, source, properties=properties)
    batches = [[e._replace(dt=f"{e.dt} 1:x%") if e.dt else e for e in events]
               for events in random_batches(47, batches=3, per_batch=150, bad_share=0)]
    batches[0] = [e for e in batches[0] if e.op != "d"]  # Spark writes it: no tombstone holds its deletes
    # The first batch's rows, and rows deleted again: with deletion vectors, vectors the clone names by path.
    extra = [(f"x{r['id']}", *list(r.values())[1:]) for r in expected_rows(batches[:1])[::3]]
    rows = [tuple(r.values()) for r in expected_rows(batches[:1])] + extra
    spark.createDataFrame(rows, SCHEMA).write.format("delta").mode("append").save(source)
    spark.sql(f"DELETE FROM delta.`{source}` WHERE id LIKE 'x%'")
    source_rows, source_version = spark_rows(spark, source), DeltaTable(source).version()
    spark.sql(f"CREATE TABLE delta.`{clone}` SHALLOW CLONE delta.`{source}`")
    cloned = [a["path"] for _, name, a in log_actions(clone) if name == "add"]
    assert cloned and all(p.startswith("file:/") and "source%20table" in p and "%253A" in p for p in cloned)
    sink = UpsertSink(sink_config(tmp_path, clone))
    for b, events in enumerate(batches[1:], start=1):
        sink(spark.createDataFrame(events, SCHEMA), b)
        assert spark_rows(spark, clone) == expected_rows(batches[: b + 1]), f"after batch {b}"
        scanned = pa.table(DeltaTable(clone).scan(columns=["id", "dt", "v"])).to_pylist()
        assert sorted(scanned, key=lambda r: (r["dt"], r["id"])) == \
            [{c: r[c] for c in ("id", "dt", "v")} for r in expected_rows(batches[: b + 1])], f"delta-rs, batch {b}"
    assert [r.mode for r in sink.reports] == [update_mode, update_mode]
    removed = {a["path"] for _, name, a in log_actions(clone) if name == "remove"}
    assert removed & set(cloned), "the batches updated rows of the source's files"
    assert spark_rows(spark, source) == source_rows and DeltaTable(source).version() == source_version


@pytest.mark.parametrize("properties, update_mode", [
    ("", "rewrite"),
    ("TBLPROPERTIES ('delta.enableDeletionVectors' = 'true')", "merge-on-read"),
], ids=["copy-on-write", "deletion vectors"])
def test_the_sinks_update_commits_read_as_sparks_merge(spark, tmp_path, properties, update_mode):
    """What DESCRIBE HISTORY dashboards and log readers take from a commit: the operation and
    its metrics as Spark names them, a txnId per commit, a remove with the file's row count,
    a marked file's add with its modification time."""
    uri = str(tmp_path / "table")
    create(spark, uri, properties=properties)
    batches = random_batches(71, batches=3, per_batch=150, bad_share=0)
    sink = UpsertSink(sink_config(tmp_path, uri))
    seen = []  # the rows after each batch, by (dt, id)
    for b, events in enumerate(batches):
        sink(spark.createDataFrame(events, SCHEMA), b)
        seen.append({(r["dt"], r["id"]): r for r in spark_rows(spark, uri)})
    assert [r.mode for r in sink.reports] == ["append", update_mode, update_mode]
    history = {r.version: r for r in spark.sql(f"DESCRIBE HISTORY delta.`{uri}`").collect()}
    infos = {v: a for v, name, a in log_actions(uri) if name == "commitInfo"}
    sinks = [r.table_version for r in sink.reports]
    assert len({infos[v]["txnId"] for v in sinks}) == 3 and all(len(infos[v]["txnId"]) == 36 for v in sinks)
    for report, (before, after) in zip(sink.reports[1:], zip(seen, seen[1:])):
        row = history[report.table_version]
        assert row.operation == "MERGE" and row.operationParameters["commitPath"] == (
            "merge-on-read" if properties else "copy-on-write")
        metrics = {k: int(v) for k, v in row.operationMetrics.items()}
        # What the commit changed, from the rows Spark reads before and after it.
        assert (metrics["numTargetRowsInserted"], metrics["numTargetRowsUpdated"], metrics["numTargetRowsDeleted"]) \
            == (len(after.keys() - before.keys()), sum(before[k] != after[k] for k in before.keys() & after.keys()),
                len(before.keys() - after.keys())), report.summary()
    adds: dict[str, dict] = {}  # the latest add of each path
    removed, marked = 0, 0
    for version, name, action in log_actions(uri):
        stored = adds.get(action.get("path"))
        if name == "remove" and version in sinks:
            assert json.loads(action["stats"]) == {"numRecords": json.loads(stored["stats"])["numRecords"]}
            removed += 1
        if name == "add":
            if version in sinks and stored is not None:
                assert action["modificationTime"] == stored["modificationTime"]
                marked += 1
            adds[action["path"]] = action
    assert removed > 0 and (marked > 0) == bool(properties)


def test_a_marked_files_tags_are_kept_from_the_log_and_from_a_checkpoint(spark, tmp_path):
    """Tags an earlier writer gave its files (as Databricks' writers tag theirs) stay on the
    files the sink marks and re-adds, read from the JSON commits and, by a sink started after
    a checkpoint, from the checkpoint; the files it removes name them too."""
    uri = str(tmp_path / "table")
    create(spark, uri, properties="TBLPROPERTIES ('delta.enableDeletionVectors' = 'true', "
                                  "'delta.checkpointInterval' = '3')")
    batches = random_batches(79, batches=4, per_batch=150, bad_share=0)
    batches[0] = [e for e in batches[0] if e.op != "d"]  # Spark writes it: no tombstone holds its deletes
    spark.createDataFrame([tuple(r.values()) for r in expected_rows(batches[:1])], SCHEMA) \
        .write.format("delta").mode("append").save(uri)
    written = Path(uri, "_delta_log", f"{DeltaTable(uri).version():020d}.json")
    tagged = {}
    lines = []
    for line in written.read_text().splitlines():
        action = json.loads(line)
        if "add" in action:
            action["add"]["tags"] = tagged[action["add"]["path"]] = {"INSERTION_TIME": "1700000000000000",
                                                                    "ZCUBE_ID": action["add"]["path"][-20:]}
        lines.append(json.dumps(action))
    written.write_text("\n".join(lines) + "\n")
    first = DeltaTable(uri).version() + 1
    for b, events in enumerate(batches[1:], start=1):
        sink = UpsertSink(sink_config(tmp_path, uri))  # a new process: the vectors and tags replayed anew
        sink(spark.createDataFrame(events, SCHEMA), b)
        assert spark_rows(spark, uri) == expected_rows(batches[: b + 1]), f"after batch {b}"
    assert sorted(Path(uri, "_delta_log").glob("*.checkpoint.parquet")), "a sink started after a checkpoint"
    named = [(name, a) for _, name, a in log_actions(uri, first) if name in ("add", "remove") and a["path"] in tagged]
    assert {name for name, _ in named} == {"add", "remove"}
    assert all(a.get("tags") == tagged[a["path"]] for _, a in named)
