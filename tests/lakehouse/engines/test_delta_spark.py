"""engine = "delta-spark": tables created by Spark SQL with the features Spark users turn on,
written exactly (read back through Spark against the oracle); Spark's commits carrying the app
transaction; a table switching engine between runs."""

import json

import pytest
from deltalake import DeltaTable

from sink import SinkConfig, UpsertSink
from sink.delta_log import log_commit
from sink.errors import ConfigError, SchemaError, UnsupportedTableError
from sink.lakehouse.engines.delta_spark import DeltaSparkTarget
from tests import damage
from tests.conf_session import ConfSession
from tests.lakehouse.spark_sql_tables import (
    COLUMNS,
    FEATURE_RICH_REASON,
    amount_of,
    create,
    create_feature_rich,
    spark_rows,
)
from tests.oracle import SCHEMA, Event, expected_rows, random_batches, verify_replicas

pytestmark = pytest.mark.spark

def config(tmp_path, uri: str, **extra) -> SinkConfig:
    settings = dict(table_uri=uri, key=["id"], partition_by=["dt"], ordering="ts", delete_when="op = 'd'",
                    writer_id="w", index_dir=str(tmp_path / "index"), num_shards=2, metrics_port=0, tag_on="driver",
                    engine="delta-spark")
    return SinkConfig(**{**settings, **extra})


def log_actions(uri: str, version: int) -> list[dict]:
    with open(f"{uri}/_delta_log/{version:020d}.json") as f:
        return [json.loads(line) for line in f if line.strip()]


def deletion_vectors(uri: str) -> int:
    """Files of the table's log given a deletion vector, over all its commits."""
    return sum(1 for v in range(DeltaTable(uri).version() + 1) for a in log_actions(uri, v)
               if a.get("add", {}).get("deletionVector"))


DV = "TBLPROPERTIES ('delta.enableDeletionVectors' = 'true')"
CDF = "TBLPROPERTIES ('delta.enableChangeDataFeed' = 'true')"
# A deletion-vector table under commit_mode = "merge": Spark's MERGE, which writes deletion
# vectors (under "auto" the sink marks rows itself: merge-on-read).
MERGING = {"commit_mode": "merge"}
COLUMN_MAPPING = "TBLPROPERTIES ('delta.columnMapping.mode' = 'name')"
IDENTITY = COLUMNS + ", n BIGINT GENERATED ALWAYS AS IDENTITY"


@pytest.mark.parametrize("columns, properties, constraint, stream_adds", [
    (COLUMNS, DV, "", ""),
    (COLUMNS, CDF, "", ""),
    (COLUMNS, COLUMN_MAPPING, "", ""),
    (COLUMNS, "", "ts_not_negative CHECK (ts >= 0)", ""),
    (COLUMNS + ", g STRING GENERATED ALWAYS AS (upper(v))", "", "", "upper(v) AS g"),
    (IDENTITY, "", "", ""),
    (COLUMNS, "TBLPROPERTIES ('delta.enableRowTracking' = 'true')", "", ""),
], ids=["deletion vectors", "change data feed", "column mapping", "CHECK constraint", "generated column",
        "identity column", "row tracking"])
def test_a_table_spark_created_with_a_feature_is_written_exactly_by_delta_spark(spark, tmp_path, columns, properties,
                                                                                constraint, stream_adds):
    uri = str(tmp_path / "table")
    create(spark, uri, columns=columns, properties=properties, constraint=constraint)
    batches = random_batches(51, batches=4, per_batch=150, bad_share=0)
    cfg = config(tmp_path, uri)
    sink = UpsertSink(cfg)
    for b, events in enumerate(batches):
        if b == 3:  # a new replica, bootstrapped from the table as Spark's MERGEs left it
            sink = UpsertSink(cfg)
            damage.lose(tmp_path / "index")
        df = spark.createDataFrame(events, SCHEMA)
        sink(df.selectExpr("*", stream_adds) if stream_adds else df, b)
        assert spark_rows(spark, uri) == expected_rows(batches[: b + 1]), f"after batch {b}"
        assert DeltaTable(uri).transaction_version("w") == b
    # The sink checks CHECK constraints and generated columns on the records before writing
    # them; it writes the change files and physical column names itself (its log commit).
    logged = properties in (CDF, COLUMN_MAPPING) or columns == IDENTITY
    mode = {DV: "merge-on-read"}.get(properties, "rewrite" if logged or constraint or stream_adds else "merge")
    assert [r.mode for r in sink.reports] == [mode]
    # Spark's MERGE or the sink's log commit, which reads as one.
    merges = 3
    assert spark.sql(f"DESCRIBE HISTORY delta.`{uri}`").where("operation = 'MERGE'").count() == merges
    sink.close()
    assert sum(r["entries_checked"] for r in verify_replicas(cfg)) > 0
    if properties == DV:
        assert deletion_vectors(uri) > 0
    if stream_adds:
        assert spark.read.format("delta").load(uri).where("g IS DISTINCT FROM upper(v)").count() == 0
    if columns == IDENTITY:
        counts = spark.sql(f"SELECT count(*) AS rows, count(DISTINCT n) AS ids, count(n) AS set FROM delta.`{uri}`")
        assert counts.first().asDict() == {"rows": len(expected_rows(batches)), "ids": len(expected_rows(batches)),
                                           "set": len(expected_rows(batches))}


def high_water_mark(uri: str) -> int:
    n = next(f for f in DeltaTable(uri).schema().fields if f.name == "n")
    return int(n.metadata["delta.identity.highWaterMark"])


@pytest.mark.parametrize("tag_on, properties, update_mode", [
    ("driver", "", "rewrite"), ("executors", DV, "merge-on-read"),
], ids=["driver, rewrite", "executors, deletion vectors"])
def test_identity_values_new_rows_get_beyond_the_high_water_mark_and_updated_rows_keep(spark, tmp_path, tag_on,
                                                                                      properties, update_mode):
    """The sink's own commits write an identity column's values: each row keeps its value
    through updates, a new row gets the next `start + k * step` beyond the column's high-water
    mark, which the same commit raises to the highest value given; Spark's inserts before and
    after draw from the same mark, so no value is ever given twice."""
    uri = str(tmp_path / "table")
    create(spark, uri, columns=COLUMNS + ", n BIGINT GENERATED ALWAYS AS IDENTITY (START WITH 10 INCREMENT BY 3)",
           properties=properties)
    spark.sql(f"INSERT INTO delta.`{uri}` (id, dt, ts, op, v) VALUES ('spark', '2025-01-01', 0, 'u', 'before')")
    before = {"id": "spark", "dt": "2025-01-01", "ts": 0, "op": "u", "v": "before"}
    batches = random_batches(59, batches=4, per_batch=150, bad_share=0)
    sink = UpsertSink(config(tmp_path, uri, tag_on=tag_on, num_shards=3))
    held = {("2025-01-01", "spark"): 10}  # (dt, id) -> n, after the last batch
    for b, events in enumerate(batches):
        mark = high_water_mark(uri)
        sink(spark.createDataFrame(events, SCHEMA), b)
        rows = spark.read.format("delta").load(uri).collect()
        expected = sorted([before, *expected_rows(batches[: b + 1])], key=lambda r: (r["dt"], r["id"]))
        assert spark_rows(spark, uri) == expected, f"after batch {b}"
        now = {(r.dt, r.id): r.n for r in rows}
        assert len(set(now.values())) == len(rows), f"a value given twice after batch {b}"
        assert all((n - 10) % 3 == 0 and n <= high_water_mark(uri) for n in now.values())
        assert {k: n for k, n in now.items() if k in held} == {k: held[k] for k in now if k in held}, "an update kept"
        assert all(n > mark for k, n in now.items() if k not in held), f"a new row at or below the mark {mark}"
        assert high_water_mark(uri) == max(now.values()) or high_water_mark(uri) == mark
        held = now
    assert {r.mode for r in sink.reports} == {"append", update_mode}
    assert "spark" not in engines_of_updates(spark, uri)[1:]  # the sink's commits, not Spark's MERGE
    sink.close()
    spark.sql(f"INSERT INTO delta.`{uri}` (id, dt, ts, op, v) VALUES ('after', '2025-01-02', 0, 'u', 'after')")
    after = spark.sql(f"SELECT n FROM delta.`{uri}` WHERE id = 'after'").first().n
    assert after > max(held.values()) and after == high_water_mark(uri)


def test_a_check_reading_an_identity_column_leaves_the_batch_to_sparks_merge(spark, tmp_path):
    """The records lack the identity values the commit gives them, so a CHECK constraint on the
    column cannot be checked on them: Spark writes the table (under check_constraints = "fail"
    its MERGE checks the rows); under "quarantine" the sink refuses, naming the constraint."""
    uri = str(tmp_path / "table")
    create(spark, uri, columns=IDENTITY, constraint="n_positive CHECK (n > 0)")
    batches = random_batches(60, batches=2, per_batch=60, bad_share=0)
    sink = UpsertSink(config(tmp_path, uri, check_constraints="fail"))
    for b, events in enumerate(batches):
        sink(spark.createDataFrame(events, SCHEMA), b)
        assert spark_rows(spark, uri) == expected_rows(batches[: b + 1]), f"after batch {b}"
    assert [r.mode for r in sink.reports] == ["append", "merge"]
    assert set(engines_of_updates(spark, uri)) == {"spark"}
    sink.close()
    quarantining = UpsertSink(config(tmp_path, uri, writer_id="q"))
    with pytest.raises(SchemaError, match=r"CHECK constraint n_positive \(n > 0\) does not apply to the stream"):
        quarantining(spark.createDataFrame(batches[0], SCHEMA), 0)
    quarantining.close()


def test_spark_shows_the_sinks_commits_with_their_operation_metrics_and_app_transaction(spark, tmp_path):
    uri = str(tmp_path / "table")
    create(spark, uri, properties=DV)
    batches = random_batches(52, batches=2, per_batch=100, bad_share=0)
    sink = UpsertSink(config(tmp_path, uri, **MERGING))
    for b, events in enumerate(batches):
        sink(spark.createDataFrame(events, SCHEMA), b)
    history = {r["version"]: r for r in spark.sql(f"DESCRIBE HISTORY delta.`{uri}`").collect()}
    appended, merged = history[2], history[3]  # after the table's creation and the sink's contract
    assert (appended["operation"], merged["operation"]) == ("WRITE", "MERGE")
    assert int(appended["operationMetrics"]["num_added_rows"]) == len(expected_rows(batches[:1]))  # delta-rs
    assert int(merged["operationMetrics"]["numTargetDeletionVectorsAdded"]) > 0
    recorded = [json.loads(h["userMetadata"]) for h in (appended, merged)]
    assert [(r["upsert_sink.app_transaction"], r["upsert_sink.commit"]) for r in recorded] == [
        ("w:0", "append"), ("w:1", "merge")]
    assert [(a["txn"]["appId"], a["txn"]["version"]) for a in log_actions(uri, 3) if "txn" in a] == [("w", 1)]


@pytest.mark.parametrize("properties", ["", CDF], ids=["plain", "change data feed"])
def test_a_table_switches_engine_between_runs_without_replaying_or_skipping_a_batch(spark, tmp_path, properties):
    uri = str(tmp_path / "table")
    create(spark, uri, properties=properties)
    batches = random_batches(53, batches=6, per_batch=150, bad_share=0)
    done = []
    for engine, run in [("deltalake", [0, 1]), ("delta-spark", [1, 2, 3]), ("deltalake", [3, 4, 5])]:
        sink = UpsertSink(config(tmp_path, uri, engine=engine))  # a restart under the other engine
        for b in run:  # each run starts by replaying the batch the last one committed
            sink(spark.createDataFrame(batches[b], SCHEMA), b)
            assert (sink.reports[-1].mode == "skipped") == (b in done)
            done.append(b)
            assert spark_rows(spark, uri) == expected_rows(batches[: b + 1]), f"{engine}, batch {b}"
            assert DeltaTable(uri).transaction_version("w") == b
        sink.close()
    ops = [r["operation"] for r in spark.sql(f"DESCRIBE HISTORY delta.`{uri}`").orderBy("version").collect()]
    assert ops.count("MERGE") == 5  # every update batch: the sink's log commit or Spark's MERGE


def test_the_stream_must_not_carry_an_identity_column(spark, tmp_path):
    uri = str(tmp_path / "table")
    create(spark, uri, columns=IDENTITY)
    df = spark.createDataFrame(random_batches(54, batches=1, per_batch=20, bad_share=0)[0], SCHEMA)
    with pytest.raises(SchemaError, match=r"identity column\(s\) \['n'\], whose values Delta generates"):
        UpsertSink(config(tmp_path, uri)).validate(df.selectExpr("*", "1L AS n"))


def test_delta_spark_needs_deltas_extension_in_the_session():
    target = DeltaSparkTarget("/nowhere", ["dt"])
    with pytest.raises(ConfigError, match=r"engine = 'delta-spark' needs Delta's extension .* "
                                          r"spark.sql.extensions = io.delta.sql.DeltaSparkSessionExtension"):
        target.attach(ConfSession())
    target.attach(ConfSession(**{"spark.sql.extensions": "a.Other,io.delta.sql.DeltaSparkSessionExtension"}))


def test_an_added_column_joins_a_table_only_spark_can_write(spark, tmp_path):
    uri = str(tmp_path / "table")
    create(spark, uri, properties="TBLPROPERTIES ('delta.enableRowTracking' = 'true')")
    batches = random_batches(55, batches=2, per_batch=60, bad_share=0)
    sink = UpsertSink(config(tmp_path, uri))
    sink(spark.createDataFrame(batches[0], SCHEMA), 0)
    sink(spark.createDataFrame(batches[1], SCHEMA).selectExpr("*", "length(v) AS size"), 1)
    table = spark.read.format("delta").load(uri)
    assert table.schema["size"].dataType.simpleString() == "int"
    assert spark_rows(spark, uri) == expected_rows(batches)
    assert table.where("size IS NOT NULL").count() > 0
    assert table.where("size IS NOT NULL AND size <> length(v)").count() == 0


def test_executor_tagging_merges_the_writes_where_they_were_tagged(spark, tmp_path, monkeypatch):
    """The writes stay on the executors, cached, and Spark's MERGE reads them there: the
    driver-held path is never taken; replays and a lost replica leave the table exact."""
    def driver_held(*args, **kwargs):
        raise AssertionError("the batch's writes came to the driver")

    monkeypatch.setattr(DeltaSparkTarget, "commit", driver_held)
    uri = str(tmp_path / "table")
    create(spark, uri, properties=DV)
    batches = random_batches(56, batches=5, per_batch=200)
    cfg = config(tmp_path, uri, tag_on="executors", num_shards=3, **MERGING)
    sink = UpsertSink(cfg)
    for b, events in enumerate(batches):
        if b == 3:
            damage.lose(tmp_path / "index")
        sink(spark.createDataFrame(events, SCHEMA), b)
        assert spark_rows(spark, uri) == expected_rows(batches[: b + 1]), f"after batch {b}"
        assert sink.reports[-1].ops["quarantined"] == sum(e.id is None for e in events)
        if b == 2:
            version = DeltaTable(uri).version()
            sink(spark.createDataFrame(events, SCHEMA), b)  # a replay
            assert sink.reports[-1].mode == "skipped" and DeltaTable(uri).version() == version
    assert [r.mode for r in sink.reports if r.mode != "skipped"] == ["append", "merge", "merge", "merge", "merge"]
    assert deletion_vectors(uri) > 0
    cached = [str(rdd.name()) for rdd in spark.sparkContext._jsc.getPersistentRDDs().values()]
    assert [name for name in cached if not name.startswith("Delta Table State")] == []  # the writes were let go
    sink.close()
    assert sum(r["entries_checked"] for r in verify_replicas(cfg)) > 0


def engines_of_updates(spark, uri: str) -> list[str]:
    """Who committed each write of the table: "spark", "delta-rs" or the sink's own log
    commit ("sink"), in version order."""
    history = spark.sql(f"DESCRIBE HISTORY delta.`{uri}`").where("operation IN ('MERGE', 'WRITE')").orderBy("version")
    engines = {"delta-rs": "delta-rs", log_commit.ENGINE_INFO: "sink"}
    return [next((e for prefix, e in engines.items() if r["engineInfo"].startswith(prefix)), "spark")
            for r in history.collect()]


@pytest.mark.parametrize("properties, engines", [
    ("TBLPROPERTIES ('delta.enableRowTracking' = 'true')", ["spark"] * 3),
    (COLUMN_MAPPING, ["delta-rs", "sink", "sink"]),
], ids=["row tracking: Spark", "column mapping: delta-rs' append, the sink's commits"])
def test_engine_auto_takes_spark_only_where_delta_rs_cannot_write(spark, tmp_path, properties, engines):
    uri = str(tmp_path / "table")
    create(spark, uri, properties=properties)
    batches = random_batches(57, batches=3, per_batch=150, bad_share=0)
    sink = UpsertSink(config(tmp_path, uri, engine="auto"))
    for b, events in enumerate(batches):
        sink(spark.createDataFrame(events, SCHEMA), b)
        assert spark_rows(spark, uri) == expected_rows(batches[: b + 1]), f"after batch {b}"
    assert [r.mode for r in sink.reports] == ["append", *["merge" if "spark" in engines else "rewrite"] * 2]
    assert engines_of_updates(spark, uri) == engines


def test_engine_auto_without_deltas_extension_is_delta_rs_and_refuses_what_it_cannot_write(spark, tmp_path):
    uri = str(tmp_path / "table")
    create(spark, uri, properties="TBLPROPERTIES ('delta.enableRowTracking' = 'true')")
    target = DeltaSparkTarget(uri, ["dt"], spark_writes="unwritable")
    target.attach(ConfSession())  # no error: delta-rs alone
    with pytest.raises(UnsupportedTableError, match=r"uses row tracking .*: delta-rs cannot write it; "
                                                    r"engine = 'delta-spark', or 'auto' in a session with Delta's"):
        target.check_writable()
    target.attach(spark)
    target.check_writable()


def test_a_batch_of_deletes_of_unknown_keys_records_its_transaction_from_the_executors(spark, tmp_path):
    """Nothing to write but the batch's tombstones: the writes left on the executors are none,
    and Spark's empty append still records the batch, as the other paths do."""
    uri = str(tmp_path / "table")
    create(spark, uri, properties=DV)
    sink = UpsertSink(config(tmp_path, uri, tag_on="executors", **MERGING))
    sink(spark.createDataFrame([Event("a", "2025-01-01", 1, "u", "x")], SCHEMA), 0)
    sink(spark.createDataFrame([Event("gone", "2025-01-01", 2, "d", None)], SCHEMA), 1)
    assert (sink.reports[-1].ops["delete_missing"], sink.reports[-1].mode) == (1, "append")
    assert DeltaTable(uri).transaction_version("w") == 1
    assert spark_rows(spark, uri) == expected_rows([[Event("a", "2025-01-01", 1, "u", "x")]])


@pytest.mark.parametrize("tag_on", ["driver", "executors"])
def test_records_breaking_a_check_constraint_go_to_quarantine_naming_it_on_a_feature_rich_table(spark, tmp_path,
                                                                                             tag_on):
    """Deletion vectors, a change data feed, an identity column, a generated column and a CHECK
    constraint, created by Spark SQL and written by delta-spark (through a Connect server too:
    tests/test_job.py): negative amounts break the constraint and go to quarantine with its
    name, the rest is written exactly; with check_constraints = "fail" Delta's error fails the
    batch."""
    uri = str(tmp_path / "table")
    create_feature_rich(spark, uri)
    batches = random_batches(58, batches=3, per_batch=150, bad_share=0)
    sink = UpsertSink(config(tmp_path, uri, tag_on=tag_on))
    for b, events in enumerate(batches):
        rows = [(*e, amount_of(e)) for e in events]
        sink(spark.createDataFrame(rows, SCHEMA + ", amount long").selectExpr("*", "upper(v) AS g"), b)
    written = [[e for e in events if e.op == "d" or amount_of(e) >= 0] for events in batches]
    expected = [{**r, "amount": amount_of(Event(**r))} for r in expected_rows(written)]
    table = spark.read.format("delta").load(uri)
    got = sorted((r.asDict() for r in table.select("id", "dt", "ts", "op", "v", "amount").collect()),
                 key=lambda r: (r["dt"], r["id"]))
    assert got == expected
    assert table.where("g IS DISTINCT FROM upper(v) OR n IS NULL").count() == 0
    quarantined = DeltaTable(f"{uri}_quarantine").to_pyarrow_table(columns=["amount", "_quarantine_reason"])
    negative = sum(e.op != "d" and amount_of(e) < 0 and e.id is not None for events in batches for e in events)
    assert quarantined.num_rows == negative > 0
    assert set(quarantined.column("_quarantine_reason").to_pylist()) == {FEATURE_RICH_REASON}
    sink.close()
    failing = UpsertSink(config(tmp_path, uri, tag_on=tag_on, check_constraints="fail"))
    bad = Event("neg", "2025-01-01", 99, "u", "x")
    with pytest.raises(Exception, match="amount_not_negative"):
        failing(spark.createDataFrame([(*bad, -5)], SCHEMA + ", amount long").selectExpr("*", "upper(v) AS g"), 3)
    failing.close()


def test_a_spark_commit_that_lost_the_sinks_app_transaction_is_refused_not_taken_as_the_batch(spark, tmp_path,
                                                                                               monkeypatch):
    """Another user of the session sets Delta's commit confs while the batch commits (as two
    queries of one Connect session did, each committing with the other's): the commit lands
    without the batch's app transaction, and the sink says so instead of carrying on."""
    from contextlib import contextmanager

    from sink import UnrecordedCommitError
    from sink.lakehouse.engines import delta_spark
    from sink.session.confs import session_confs

    uri = str(tmp_path / "table")
    create(spark, uri, properties=DV)
    sink = UpsertSink(config(tmp_path, uri, **MERGING))
    sink(spark.createDataFrame([Event("a", "2025-01-01", 1, "u", "x")], SCHEMA), 0)

    @contextmanager
    def overwritten(session, confs):
        with session_confs(session, {**confs, delta_spark.TXN_APP_ID: "another-query"}):
            yield

    monkeypatch.setattr(delta_spark, "session_confs", overwritten)
    with pytest.raises(UnrecordedCommitError, match=r"committed batch 1 without the sink's app transaction \(w\)"):
        sink(spark.createDataFrame([Event("a", "2025-01-01", 2, "u", "y")], SCHEMA), 1)
    sink.close()
