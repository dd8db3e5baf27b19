"""scd_type = 2 through the sink: history tables from the published examples, any batching."""

import random
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pytest
from deltalake import DeltaTable, write_deltalake
from prometheus_client import REGISTRY

from sink import SinkConfig, UnsupportedTableError, UpsertSink, cli
from sink.errors import ConfigError, ContractMismatchError, SchemaError
from sink.history import END_AT, RUN_EVENTS, START_AT
from sink.lakehouse.commit import versions
from sink.lakehouse.commit.key_hits import matching_files
from tests import history_crash
from tests.engines import ENGINE_OPTIONS, UPDATES_COMMIT
from tests.examples import USER_CHANGES, USER_VERSIONS, USER_VERSIONS_EXCEPT_CITY, VERSIONED_EVENTS, VERSIONED_HISTORY
from tests.oracle import SCHEMA as EVENT_SCHEMA
from tests.oracle import Event, expected_history, random_global_batches, verify_replicas
from tests.scaleout_stream import history_rows, never_committed
from tests.test_history import HANDLER_CASES, oracle

pytestmark = pytest.mark.spark

USERS = "userId INT, name STRING, city STRING, operation STRING, sequenceNum INT"


def users_config(tmp_path, index="index", **extra):
    options = {"scd_type": 2, "index_dir": str(tmp_path / index), **extra}
    return SinkConfig(table_uri=str(tmp_path / "users"), key=["userId"], ordering="sequenceNum",
                      delete_when="operation = 'DELETE'", except_columns=["operation", "sequenceNum"],
                      writer_id="users", num_shards=2, metrics_port=0, **options)


def history(uri, *columns):
    """The table's rows as tuples of `columns`, sorted (nulls first)."""
    table = DeltaTable(uri).to_pyarrow_table()
    return sorted((tuple(r[c] for c in columns) for r in table.to_pylist()),
                  key=lambda row: [(v is not None, v) for v in row])


def run_users(spark, tmp_path, split, restart, **extra):
    sink = UpsertSink(users_config(tmp_path, **extra))
    start = 0
    for b, size in enumerate(split):
        if restart:  # a new sink on a new index: the table and the tombstones are all it has
            sink = UpsertSink(users_config(tmp_path, index=f"index-{b}", **extra))
        sink(spark.createDataFrame(USER_CHANGES[start:start + size], USERS), b)
        start += size
    return sink


SPLITS = {"one-batch": ([8], False), "two-batches": ([4, 4], False), "one-per-batch-restarting": ([1] * 8, True),
          "late-after-restart": ([6, 2], True)}


@pytest.mark.parametrize("engine", ENGINE_OPTIONS)
@pytest.mark.parametrize("tag_on", ["driver", "executors"])
@pytest.mark.parametrize("split", SPLITS)
@pytest.mark.connect(split="late-after-restart", engine="deltalake")
def test_the_published_scd2_users_example(spark, tmp_path, split, tag_on, engine):
    """STORED AS SCD TYPE 2 with COLUMNS * EXCEPT (operation, sequenceNum): the docs' 7 rows,
    tagged in the driver or in Spark tasks (whose writing tasks then rebuild the histories
    and write the files; under delta-spark the driver rebuilds them for Spark's MERGE)."""
    sink = run_users(spark, tmp_path, *SPLITS[split], tag_on=tag_on, **ENGINE_OPTIONS[engine])
    assert (sink.reports[-1].write_seconds > 0) is (tag_on == "executors" and engine == "deltalake")
    uri = str(tmp_path / "users")
    assert history(uri, "userId", "name", "city", START_AT, END_AT) == sorted(USER_VERSIONS, key=repr)
    assert DeltaTable(uri).schema().to_arrow().names == [
        "userId", "name", "city", "__ordering_sequenceNum", START_AT, END_AT, RUN_EVENTS]


@pytest.mark.parametrize("engine", ENGINE_OPTIONS)
@pytest.mark.parametrize("split", SPLITS)
@pytest.mark.connect(split="late-after-restart", engine="deltalake")
def test_the_published_example_tracking_history_except_city(spark, tmp_path, split, engine):
    """TRACK HISTORY ON * EXCEPT (city): the docs' 4 rows."""
    run_users(spark, tmp_path, *SPLITS[split], track_history_except_columns=["city"], **ENGINE_OPTIONS[engine])
    assert history(str(tmp_path / "users"), "userId", "name", "city", START_AT, END_AT) == sorted(
        USER_VERSIONS_EXCEPT_CITY)


@pytest.mark.parametrize("engine", ENGINE_OPTIONS)
@pytest.mark.parametrize("tag_on", ["driver", "executors"])
@pytest.mark.parametrize("restart", [False, True])
@pytest.mark.connect(restart=True, engine="deltalake")
def test_the_published_case_whose_stored_sequence_column_is_tracked_by_default(spark, tmp_path, tag_on, restart,
                                                                                engine):
    """Declarative Pipelines' "SCD2 auxiliary table dropped between runs": target (id,
    version) sequenced by version, which is stored, so tracked: each event opens a version."""
    cfg = dict(table_uri=str(tmp_path / "t"), key=["id"], ordering="version", scd_type=2, writer_id="w",
               num_shards=2, metrics_port=0, tag_on=tag_on, **ENGINE_OPTIONS[engine])
    for b, event in enumerate(VERSIONED_EVENTS):
        index = tmp_path / (f"index-{b}" if restart else "index")
        UpsertSink(SinkConfig(index_dir=str(index), **cfg))(spark.createDataFrame([event], "id INT, version INT"), b)
    assert history(cfg["table_uri"], "id", "version", START_AT, END_AT) == VERSIONED_HISTORY


def test_a_replayed_batch_and_redelivered_events_change_nothing(spark, tmp_path):
    sink = UpsertSink(users_config(tmp_path))
    df = spark.createDataFrame(USER_CHANGES, USERS)
    sink(df, 0)
    version = DeltaTable(str(tmp_path / "users")).version()
    sink(df, 0)  # the replay after a crash before the checkpoint: skipped
    assert sink.reports[-1].mode == "skipped"
    sink(df, 1)  # the same events again, in a new batch: the history already holds them
    report = sink.reports[-1]
    assert (report.mode, report.versions_written, report.versions_replaced) == ("append", 0, 0)
    table = DeltaTable(str(tmp_path / "users"))
    assert table.version() == version + 1  # only the batch's record
    assert history(str(tmp_path / "users"), "userId", "name", "city", START_AT, END_AT) == sorted(USER_VERSIONS)
    assert (report.ops["insert"], report.ops["update"], report.ops["delete"]) == (0, 7, 1)


def test_a_delete_of_an_unknown_key_is_remembered_for_a_later_older_upsert(spark, tmp_path):
    """The delete writes no row; the tombstone table keeps it, and an older upsert arriving
    after a restart ends at it."""
    UpsertSink(users_config(tmp_path))(spark.createDataFrame([(7, None, None, "DELETE", 20)], USERS), 0)
    assert DeltaTable(str(tmp_path / "users")).to_pyarrow_table().num_rows == 0
    sink = UpsertSink(users_config(tmp_path, index="index-2"))
    sink(spark.createDataFrame([(7, "Ana", "Lima", "INSERT", 10)], USERS), 1)
    assert history(str(tmp_path / "users"), "userId", "name", START_AT, END_AT) == [(7, "Ana", 10, 20)]


EVENTS = "id STRING, dt STRING, seq LONG, op STRING, name STRING, score INT"
EVENTS_NO_DT = "id STRING, seq LONG, op STRING, name STRING, score INT"


@pytest.mark.parametrize("seed", range(6))
def test_random_events_in_random_batches_give_the_oracles_history(spark, tmp_path, seed):
    """Partitioned by dt (a key's history is per partition), some batches after a restart,
    tagged in the driver or in Spark tasks, nulls filled (ignore_null_updates) from the third
    seed; otherwise the current rows equal what scd_type = 1 gives from the same batches. The
    last two seeds commit the history through delta-spark's MERGE."""
    rnd = random.Random(seed)
    fill = seed >= 2
    nulls = [None] if fill else []
    events = [{"id": str(rnd.randint(1, 4)), "dt": rnd.choice(["2026-01-01", "2026-01-02"]),
               "seq": rnd.randint(1, 15), "is_delete": rnd.random() < 0.2, "name": rnd.choice(["a", "b", *nulls]),
               "score": rnd.choice([1, 2, *nulls])} for _ in range(40)]
    for e in events:  # one event per key, partition and sequence: type 1 breaks ties by arrival
        e["seq"] = e["seq"] * 100 + events.index(e)
    common = dict(key=["id"], partition_by=["dt"], ordering="seq", delete_when="op = 'd'", except_columns=["op"],
                  writer_id="w", num_shards=2, metrics_port=0)
    spark_merge = ENGINE_OPTIONS["delta-spark"] if seed >= 4 else {}
    scd2 = dict(table_uri=str(tmp_path / "t2"), scd_type=2, track_history_columns=["name"],
                tag_on="executors" if seed % 2 else "driver", ignore_null_updates=fill, **spark_merge, **common)
    scd1 = SinkConfig(table_uri=str(tmp_path / "t1"), index_dir=str(tmp_path / "i1"), **common)
    sinks = [UpsertSink(SinkConfig(index_dir=str(tmp_path / "i2"), **scd2)), UpsertSink(scd1)]
    cuts = sorted({*rnd.sample(range(1, 40), 3), 40})
    for b, (lo, hi) in enumerate(zip([0, *cuts], cuts)):
        if b == 2:
            sinks[0] = UpsertSink(SinkConfig(index_dir=str(tmp_path / "i2-restarted"), **scd2))
        rows = [(e["id"], e["dt"], e["seq"], "d" if e["is_delete"] else "u", e["name"], e["score"])
                for e in events[lo:hi]]
        for sink in sinks:
            sink(spark.createDataFrame(rows, EVENTS), b)
    expected = []
    for dt in ("2026-01-01", "2026-01-02"):
        of_dt = [{**e, "id": e["id"], "name": None if e["is_delete"] else e["name"],
                  "score": None if e["is_delete"] else e["score"]} for e in events if e["dt"] == dt]
        expected += [(dt, *row) for row in oracle(of_dt, ["name"], fill)]
    got = history(str(tmp_path / "t2"), "dt", "id", "name", "score", "seq", START_AT, END_AT)
    assert got == sorted(expected, key=lambda row: [(v is not None, v) for v in row])
    if not fill:
        current = sorted((dt, i, n, s) for dt, i, n, s, _, _, end in got if end is None)
        assert current == history(str(tmp_path / "t1"), "dt", "id", "name", "score")


def test_changing_the_type_or_the_tracked_columns_of_a_table_is_refused(spark, tmp_path):
    df = spark.createDataFrame(USER_CHANGES[:2], USERS)
    UpsertSink(users_config(tmp_path))(df, 0)
    for changed in ({"scd_type": 1}, {"track_history_columns": ["name"]}):
        cfg = SinkConfig(**{**users_config(tmp_path).__dict__, **changed})
        with pytest.raises(ContractMismatchError, match="scd_type|track_history"):
            UpsertSink(cfg)(df, 1)
    type_1 = SinkConfig(**{**users_config(tmp_path).__dict__, "scd_type": 1, "table_uri": str(tmp_path / "t1")})
    UpsertSink(type_1)(df, 0)
    with pytest.raises(ContractMismatchError, match=r"not a history table \(it lacks \['__START_AT'"):
        UpsertSink(SinkConfig(**{**type_1.__dict__, "scd_type": 2}))(df, 1)


def test_a_stream_column_named_like_a_history_column_is_refused(spark, tmp_path):
    df = spark.createDataFrame([(1, "a", "INSERT", 1, 5)], "userId INT, name STRING, operation STRING, "
                                                             "sequenceNum INT, __END_AT INT")
    with pytest.raises(SchemaError, match="__END_AT"):
        UpsertSink(users_config(tmp_path))(df, 0)


def test_tracked_columns_must_be_stored_columns(spark, tmp_path):
    df = spark.createDataFrame(USER_CHANGES[:1], USERS)
    with pytest.raises(SchemaError, match=r"track_history_columns \['operation'\]"):
        UpsertSink(users_config(tmp_path, track_history_columns=["operation"]))(df, 0)


@pytest.mark.parametrize("extra, message", [
    ({"scd_type": 3}, r"scd_type = 3 is not accepted; accepted values: \[1, 2\]"),
    ({"track_history_columns": ["name"], "track_history_except_columns": ["city"]}, "not both"),
    ({"track_history_columns": ["userId"]}, r"key or partition column\(s\) \['userId'\]"),
    ({"track_history_columns": ["city"], "partition_by": ["city"]}, r"key or partition column\(s\) \['city'\]"),
    ({"commit_mode": "merge-on-read"}, r"commit_mode = 'merge-on-read' applies to scd_type = 1: .* accepted with "
                                       r"scd_type = 2: 'auto', 'merge'"),
])
def test_history_config_errors_name_the_key(tmp_path, extra, message):
    with pytest.raises(ConfigError, match=message):
        users_config(tmp_path, **extra)


def test_tracking_lists_apply_to_type_2_only(tmp_path):
    with pytest.raises(ConfigError, match="applies to scd_type = 2 only"):
        SinkConfig(table_uri=str(tmp_path / "t"), key=["id"], ordering="seq", writer_id="w",
                   track_history_columns=["name"])


def test_the_run_events_keep_the_untracked_values_a_late_event_needs(spark, tmp_path):
    """'alice' scored 39, then 41 (untracked); a late 'bob' at 40 splits the version and
    restores 39 before it."""
    cfg = SinkConfig(table_uri=str(tmp_path / "t"), key=["id"], ordering="seq", track_history_columns=["name"],
                     scd_type=2, writer_id="w-runs", num_shards=2, metrics_port=0, index_dir=str(tmp_path / "i"))
    sink = UpsertSink(cfg)
    schema = "id INT, seq LONG, name STRING, score INT"
    sink(spark.createDataFrame([(1, 39, "alice", 39), (1, 41, "alice", 41)], schema), 0)
    table = DeltaTable(cfg.table_uri).to_pyarrow_table()
    assert table.column(RUN_EVENTS).to_pylist() == [[{"seq": 39, "score": 39}]]
    sink(spark.createDataFrame([(1, 40, "bob", 40)], schema), 1)
    assert history(cfg.table_uri, "name", "score", START_AT, END_AT) == [
        ("alice", 39, 39, 40), ("alice", 41, 41, None), ("bob", 40, 40, 41)]
    assert (sink.reports[-1].mode, sink.reports[-1].versions_written, sink.reports[-1].versions_replaced) == (
        "rewrite", 3, 1)
    # The late 'bob' opens two versions (itself and the 'alice' at 41 after it) and splits
    # the open 'alice' from 39, which it closes at 40.
    assert sink.reports[-1].version_changes == {"opened": 2, "closed": 1, "split": 0}
    versions = {c: REGISTRY.get_sample_value("upsert_sink_history_versions_total", {"sink": "w-runs", "change": c})
                for c in ("written", "replaced", "opened", "closed", "split")}
    assert versions == {"written": 1 + 3, "replaced": 1, "opened": 1 + 2, "closed": 1, "split": 0}


def test_verify_contract_and_tombstone_compaction_know_history_tables(spark, tmp_path, capsys):
    """verify: a deleted key keeps its versions, and the index holds it; contract: a rewrite
    cannot turn a history table into a type 1 one; compact-tombstones keeps every delete."""
    sink = run_users(spark, tmp_path, [4, 4], restart=False)
    verify_replicas(sink.config)
    UpsertSink(users_config(tmp_path))(spark.createDataFrame([(9, None, None, "DELETE", 3),
                                                              (9, None, None, "DELETE", 4)], USERS), 2)
    conf = tmp_path / "sink.toml"
    conf.write_text(f'[sink]\ntable_uri = "{tmp_path / "users"}"\nkey = ["userId"]\nordering = "sequenceNum"\n'
                    'except_columns = ["operation", "sequenceNum"]\nwriter_id = "users"\n'
                    f'index_dir = "{tmp_path / "index"}"\nscd_type = 1\n')
    assert cli.main(["contract", "--config", str(conf), "--rewrite"]) == 1
    assert "a rewrite cannot change scd_type" in capsys.readouterr().out
    conf.write_text(conf.read_text().replace("scd_type = 1", "scd_type = 2"))
    # A delete recorded twice (as a redelivery can leave it): compaction keeps it once, and says so.
    stored = DeltaTable(str(tmp_path / "users_tombstones")).to_pyarrow_table()
    write_deltalake(str(tmp_path / "users_tombstones"), stored.filter(pc.equal(stored["userId"], 123)), mode="append")
    capsys.readouterr()
    assert cli.main(["compact-tombstones", "--config", str(conf)]) == 0
    out = capsys.readouterr().out
    assert "(1 repeated deletes of a key at one ordering value, kept once, 0 expired" in out
    assert "superseded" not in out
    tombstones = DeltaTable(str(tmp_path / "users_tombstones")).to_pyarrow_table().to_pylist()
    assert sorted((t["userId"], t["__ordering_sequenceNum"]) for t in tombstones) == [(9, 3), (9, 4), (123, 6)]


def test_a_delete_without_its_partition_goes_to_quarantine(spark, tmp_path):
    """A key's history lives in its partition: a key-only delete cannot be placed (type 1
    locates it through the index)."""
    cfg = SinkConfig(table_uri=str(tmp_path / "t"), key=["id"], partition_by=["dt"], ordering="seq",
                     delete_when="op = 'd'", except_columns=["op"], scd_type=2, writer_id="w-placed", num_shards=2,
                     metrics_port=0, index_dir=str(tmp_path / "i"))
    sink = UpsertSink(cfg)
    schema = "id INT, dt STRING, seq LONG, op STRING, v STRING"
    sink(spark.createDataFrame([(1, "2026-01-01", 1, "u", "a")], schema), 0)
    sink(spark.createDataFrame([(1, None, 2, "d", None)], schema), 1)
    assert sink.reports[-1].ops["quarantined"] == 1
    quarantined = DeltaTable(cfg.resolved_quarantine_uri).to_pyarrow_table().to_pylist()
    assert [q["_quarantine_reason"] for q in quarantined] == ["null partition column dt"]
    assert history(cfg.table_uri, "id", "v", START_AT, END_AT) == [(1, "a", 1, None)]


def test_a_remembered_delete_expires_with_the_tombstone_ttl_whatever_the_index_holds(spark, tmp_path):
    """Past tombstone_ttl_hours a delete that closed nothing is forgotten, as DLT's tombstone
    GC does: an older upsert arriving later opens a current version, through the index that
    saw the delete (its entry has expired) and through a new one (no entry)."""
    now = [1_000_000.0]
    sink = UpsertSink(users_config(tmp_path, tombstone_ttl_hours=1), clock=lambda: now[0])
    sink(spark.createDataFrame([(7, None, None, "DELETE", 20), (8, None, None, "DELETE", 20)], USERS), 0)
    now[0] += 2 * 3600
    sink(spark.createDataFrame([(8, "Bo", "Lima", "INSERT", 10)], USERS), 1)
    fresh = UpsertSink(users_config(tmp_path, index="index-2", tombstone_ttl_hours=1), clock=lambda: now[0])
    fresh(spark.createDataFrame([(7, "Ana", "Lima", "INSERT", 10)], USERS), 2)
    assert history(str(tmp_path / "users"), "userId", "name", START_AT, END_AT) == [
        (7, "Ana", 10, None), (8, "Bo", 10, None)]


@pytest.mark.parametrize("feature", ["change data feed", "CHECK constraints"])
def test_a_history_table_only_a_merge_can_write_commits_through_merge(spark, tmp_path, feature):
    """A change data feed or a CHECK constraint keeps a history table's batches on MERGE
    (matching versions on key, partition and START_AT): the table is the docs' 7 rows, and
    the feed's changes of the MERGE are exactly the rows it removed and added."""
    uri = str(tmp_path / "users")
    sink = UpsertSink(users_config(tmp_path))
    sink(spark.createDataFrame(USER_CHANGES[:4], USERS), 0)
    table = DeltaTable(uri)
    if feature == "change data feed":
        table.alter.set_table_properties({"delta.enableChangeDataFeed": "true"})
    else:
        table.alter.add_constraint({"known_user": "userId > 0"})
    before = DeltaTable(uri).to_pyarrow_table()
    sink(spark.createDataFrame(USER_CHANGES[4:], USERS), 1)
    report = sink.reports[-1]
    assert report.mode == "merge" and report.versions_written > 0
    assert history(uri, "userId", "name", "city", START_AT, END_AT) == sorted(USER_VERSIONS, key=repr)
    if feature == "change data feed":
        def rows(t):
            return sorted(repr(sorted(r.items())) for r in t.to_pylist())
        after = DeltaTable(uri).to_pyarrow_table()
        feed = pa.table(DeltaTable(uri).load_cdf(starting_version=report.table_version).read_all())
        changes = pa.table([feed.column(f.name).cast(f.type) for f in after.schema], schema=after.schema)
        kind = feed.column("_change_type").cast(pa.string())
        added = changes.filter(pc.is_in(kind, pa.array(["insert", "update_postimage"])))
        removed = changes.filter(pc.is_in(kind, pa.array(["delete", "update_preimage"])))
        assert Counter(rows(after)) - Counter(rows(before)) == Counter(rows(added)) - Counter(rows(removed))
        assert Counter(rows(before)) - Counter(rows(after)) == Counter(rows(removed)) - Counter(rows(added))


def test_a_history_table_whose_files_hide_rows_is_refused_before_writing(spark, tmp_path):
    """Deletion vectors: a history table reads its versions from the files, where a deleted
    row would come back."""
    sink = UpsertSink(users_config(tmp_path))
    sink(spark.createDataFrame(USER_CHANGES[:4], USERS), 0)
    DeltaTable(str(tmp_path / "users")).alter.set_table_properties({"delta.enableDeletionVectors": "true"})
    version = DeltaTable(str(tmp_path / "users")).version()
    with pytest.raises(UnsupportedTableError, match="deletion vectors .* reads the versions it rebuilds"):
        sink(spark.createDataFrame(USER_CHANGES[4:], USERS), 1)
    assert DeltaTable(str(tmp_path / "users")).version() == version


@pytest.mark.parametrize("engine", ENGINE_OPTIONS)
@pytest.mark.parametrize("case", HANDLER_CASES)
@pytest.mark.connect(engine="deltalake")
def test_the_declarative_pipelines_handler_cases_through_the_sink_with_a_restart(spark, tmp_path, case, engine):
    """The stored events in one batch, then the case's batch on a new sink and index. The
    cases track `value` alone: seq is stored, and tracked by default."""
    stored, batch, expected = HANDLER_CASES[case]
    options = dict(table_uri=str(tmp_path / "t"), key=["id"], ordering="seq", delete_when="is_delete",
                   scd_type=2, except_columns=["is_delete"], writer_id="w-cases", num_shards=2, metrics_port=0,
                   track_history_columns=["value"], **ENGINE_OPTIONS[engine])
    for b, events in enumerate((stored, batch)):
        if events:
            rows = [(e["id"], e["seq"], e["is_delete"], e["value"]) for e in events]
            sink = UpsertSink(SinkConfig(index_dir=str(tmp_path / f"index-{b}"), **options))
            sink(spark.createDataFrame(rows, "id INT, seq LONG, is_delete BOOLEAN, value STRING"), b)
    assert history(str(tmp_path / "t"), "value", START_AT, END_AT, "seq") == sorted(expected)


def test_a_new_stream_column_joins_the_history_table_as_a_tracked_column(spark, tmp_path):
    """schema_evolution = 'add_columns': stored versions read null in it, so its first value
    opens a version."""
    sink = UpsertSink(users_config(tmp_path))
    sink(spark.createDataFrame(USER_CHANGES[:4], USERS), 0)
    wider = USERS + ", country STRING"
    sink(spark.createDataFrame([(124, "Raul", "Oaxaca", "UPDATE", 3, "MX"), (126, "Lily", "Cancun", "UPDATE", 1, None)],
                               wider), 1)
    uri = str(tmp_path / "users")
    assert DeltaTable(uri).schema().to_arrow().names[-1] == "country"
    assert history(uri, "userId", "country", START_AT, END_AT) == [
        (123, None, 1, None), (124, None, 1, 3), (124, "MX", 3, None), (125, None, 2, None), (126, None, 1, None)]


@pytest.mark.parametrize("tag_on", ["driver", "executors"])
def test_a_new_untracked_column_joins_the_history_table_null_in_closed_versions(spark, tmp_path, tag_on):
    """AUTO CDC adds it: closed versions read null, the current one is updated in place, and
    __RUN_EVENTS keeps its values, so a late event splits a run exactly. The table equals one
    that had the column from the start and got every event in one batch."""
    wider = USERS + ", country STRING"
    later = [(124, "Raul", "Oaxaca", "UPDATE", 3, "MX"), (125, "Mercedes", "Tijuana", "UPDATE", 4, "MX"),
             (126, "Lily", "Tulum", "UPDATE", 5, "MX")]
    late = [(124, "Raul", "Puebla", "UPDATE", 2, "US")]
    tracking = dict(track_history_columns=["name", "city"], tag_on=tag_on)
    sink = UpsertSink(users_config(tmp_path, **tracking))
    sink(spark.createDataFrame(USER_CHANGES[:4], USERS), 0)
    sink(spark.createDataFrame(later, wider), 1)
    uri = str(tmp_path / "users")
    assert history(uri, "userId", "city", "country", START_AT, END_AT) == [
        (123, "Monterrey", None, 1, None), (124, "Oaxaca", "MX", 1, None), (125, "Tijuana", "MX", 2, None),
        (126, "Cancun", None, 2, 5), (126, "Tulum", "MX", 5, None)]
    sink(spark.createDataFrame(late, wider), 2)
    assert history(uri, "userId", "city", "country", START_AT, END_AT) == [
        (123, "Monterrey", None, 1, None), (124, "Oaxaca", None, 1, 2), (124, "Oaxaca", "MX", 3, None),
        (124, "Puebla", "US", 2, 3), (125, "Tijuana", "MX", 2, None), (126, "Cancun", None, 2, 5),
        (126, "Tulum", "MX", 5, None)]
    run_events = pa.schema(DeltaTable(uri).schema().to_arrow()).field(RUN_EVENTS).type.value_type
    assert [run_events.field(i).name for i in range(run_events.num_fields)] == ["__ordering_sequenceNum", "country"]

    whole = tmp_path / "whole"
    UpsertSink(users_config(whole, **tracking))(spark.createDataFrame(
        [(*e, None) for e in USER_CHANGES[:4]] + later + late, wider), 0)
    columns = ("userId", "name", "city", "country", START_AT, END_AT)
    assert history(uri, *columns) == history(str(whole / "users"), *columns)


def test_a_late_event_reads_only_the_files_of_its_partition(spark, tmp_path, monkeypatch):
    """The index locates the key: the rebuild probes the files of the record's partition only."""
    cfg = SinkConfig(table_uri=str(tmp_path / "t"), key=["id"], partition_by=["dt"], ordering="seq",
                     scd_type=2, writer_id="w-located", num_shards=2, metrics_port=0, index_dir=str(tmp_path / "i"))
    sink = UpsertSink(cfg)
    schema = "id INT, dt STRING, seq LONG, v STRING"
    sink(spark.createDataFrame([(i, f"2026-01-0{d}", 10, "a") for i in range(20) for d in (1, 2, 3)], schema), 0)
    probed = []

    def recording(fs, root, files, *rest, **options):
        probed.extend(f.partition_values["dt"] for f in files)
        return matching_files(fs, root, files, *rest, **options)

    monkeypatch.setattr(versions, "matching_files", recording)
    sink(spark.createDataFrame([(7, "2026-01-02", 5, "b")], schema), 1)
    assert set(probed) == {"2026-01-02"}
    assert [r for r in history(cfg.table_uri, "id", "dt", "v", START_AT, END_AT) if r[:2] == (7, "2026-01-02")] == [
        (7, "2026-01-02", "a", 10, None), (7, "2026-01-02", "b", 5, 10)]


def test_the_history_keys_read_from_toml(tmp_path):
    conf = tmp_path / "sink.toml"
    conf.write_text('[sink]\ntable_uri = "t"\nkey = "id"\nordering = "seq"\nwriter_id = "w"\nscd_type = 2\n'
                    'track_history_except_columns = "city"\n')
    cfg = SinkConfig.from_file(conf)
    assert (cfg.scd_type, cfg.track_history_except_columns) == (2, ["city"])
    # The stored ordering column is tracked unless the list leaves it out, as AUTO CDC does.
    assert cfg.tracked_columns(["id", "seq", "name", "city"]) == ["seq", "name"]
    conf.write_text(conf.read_text().replace('"city"', '["city", "seq"]'))
    assert SinkConfig.from_file(conf).tracked_columns(["id", "seq", "name", "city"]) == ["name"]


def test_a_sequence_of_two_columns_is_a_struct_in_the_table_and_late_events_split_by_it(spark, tmp_path):
    """`SEQUENCE BY STRUCT(major, minor)`: __START_AT and __END_AT are structs; a late event
    at (1, 5) splits the version from (1, 2), after a restart."""
    def config(index):
        return SinkConfig(table_uri=str(tmp_path / "t"), key=["id"], ordering=["major", "minor"],
                          delete_when="op = 'd'", except_columns=["op"], scd_type=2, writer_id="w-struct",
                          num_shards=2, metrics_port=0, index_dir=str(tmp_path / index))
    schema = "id INT, major INT, minor INT, op STRING, v STRING"
    UpsertSink(config("i0"))(spark.createDataFrame([(1, 1, 2, "u", "a"), (1, 2, 0, "d", None)], schema), 0)
    UpsertSink(config("i1"))(spark.createDataFrame([(1, 1, 5, "u", "b")], schema), 1)
    assert history(str(tmp_path / "t"), "v", START_AT, END_AT) == [
        ("a", {"major": 1, "minor": 2}, {"major": 1, "minor": 5}),
        ("b", {"major": 1, "minor": 5}, {"major": 2, "minor": 0})]


def test_the_report_counts_versions_opened_closed_and_split(spark, tmp_path):
    cfg = SinkConfig(table_uri=str(tmp_path / "t"), key=["id"], ordering="seq", delete_when="op = 'd'",
                     except_columns=["op"], scd_type=2, writer_id="w-counts", num_shards=2, metrics_port=0,
                     index_dir=str(tmp_path / "i"))
    sink = UpsertSink(cfg)
    schema = "id INT, seq LONG, op STRING, v STRING"
    batches = [
        [(1, 10, "u", "a"), (1, 20, "u", "c")],  # opens a (closed by c) and c
        [(1, 15, "u", "b"), (2, 5, "u", "x")],  # b splits a; a new key opens x
        [(1, 30, "d", None), (1, 12, "d", None)],  # closes c; a late delete splits a again
    ]
    for b, rows in enumerate(batches):
        sink(spark.createDataFrame(rows, schema), b)
    assert [r.version_changes for r in sink.reports] == [
        {"opened": 2, "closed": 0, "split": 0}, {"opened": 2, "closed": 0, "split": 1},
        {"opened": 0, "closed": 1, "split": 1}]
    assert history(cfg.table_uri, "id", "v", START_AT, END_AT) == [
        (1, "a", 10, 12), (1, "b", 15, 20), (1, "c", 20, 30), (2, "x", 5, None)]


def test_ignore_null_updates_fills_from_the_previous_version_and_a_late_event_refills(spark, tmp_path):
    """An update's nulls take the key's values before it, in sequence order: a late event
    between two versions changes what the later one filled (the events keep their nulls)."""
    sink = UpsertSink(users_config(tmp_path, ignore_null_updates=True))
    sink(spark.createDataFrame([(1, "Ana", "Lima", "INSERT", 10), (1, None, "Quito", "UPDATE", 20)], USERS), 0)
    uri = str(tmp_path / "users")
    assert history(uri, "name", "city", START_AT, END_AT) == [("Ana", "Lima", 10, 20), ("Ana", "Quito", 20, None)]
    restarted = UpsertSink(users_config(tmp_path, index="index-2", ignore_null_updates=True))
    restarted(spark.createDataFrame([(1, "Bea", None, "UPDATE", 15)], USERS), 1)
    assert history(uri, "name", "city", START_AT, END_AT) == [
        ("Ana", "Lima", 10, 15), ("Bea", "Lima", 15, 20), ("Bea", "Quito", 20, None)]
    assert sorted(DeltaTable(uri).to_pyarrow_table().column("__FILLED").to_pylist()) == [[], ["city"], ["name"]]
    with pytest.raises(ContractMismatchError, match="ignore_null_updates"):
        UpsertSink(users_config(tmp_path, index="index-3"))(spark.createDataFrame(USER_CHANGES[:1], USERS), 2)


def commits_first(sink, method, other_commit) -> list:
    """Make `other_commit()` run just before `sink`'s next commit (its target's `method`);
    returns the list of that method's calls."""
    commit = getattr(sink._target, method)
    calls = []

    def after_the_other(*args, **kwargs):
        if not calls:
            other_commit()
        calls.append(1)
        return commit(*args, **kwargs)

    setattr(sink._target, method, after_the_other)
    return calls


@pytest.mark.parametrize("tag_on", ["driver", "executors"])
def test_a_second_writer_committing_between_tagging_and_commit_makes_the_batch_rebuild(spark, tmp_path, tag_on):
    """Writer a tags key k as new; writer b commits a version of k before a commits. A blind
    append of a's history would leave k two overlapping current versions: a must tag again
    and rebuild k with b's version, to the oracle's history of all the events."""
    def config(name):
        return SinkConfig(table_uri=str(tmp_path / "t"), key=["id"], ordering="seq", delete_when="op = 'd'",
                          except_columns=["op"], scd_type=2, writer_id=f"w-race-{name}", num_shards=2, metrics_port=0,
                          index_dir=str(tmp_path / f"index-{name}"), tag_on=tag_on, max_commit_retries=1)
    a, b = UpsertSink(config("a")), UpsertSink(config("b"))
    ours = [("k", 5, "u", "ours", 1), ("j", 1, "u", "j", 1)]
    theirs = [("k", 3, "u", "theirs", 2)]
    a(spark.createDataFrame([("seed", 1, "u", "s", 1)], EVENTS_NO_DT), 0)
    # Tagged on executors, the writing tasks wrote the files: the driver commits them.
    calls = commits_first(a, "commit_written" if tag_on == "executors" else "commit_history",
                          lambda: b(spark.createDataFrame(theirs, EVENTS_NO_DT), 0))
    a(spark.createDataFrame(ours, EVENTS_NO_DT), 1)
    events = [{"id": i, "seq": s, "is_delete": op == "d", "name": n, "score": sc}
              for i, s, op, n, sc in [("seed", 1, "u", "s", 1), *ours, *theirs]]
    assert history(str(tmp_path / "t"), "id", "name", "score", "seq", START_AT, END_AT) == sorted(
        oracle(events, ["name", "score"]), key=lambda row: [(v is not None, v) for v in row])
    assert (len(calls), a.reports[-1].retries) == (2, 1)


@pytest.mark.parametrize("tag_on, seed, merge", [("driver", 0, False), ("executors", 1, False), ("driver", 2, True)])
def test_global_scope_keeps_a_moving_keys_versions_in_their_own_partitions(spark, tmp_path, tag_on, seed, merge):
    """scope = 'global': a key's events name any partition (moves), deletes often none, and
    records come again. Each version lives in its own event's partition, the key's history
    spans them, and the table equals the oracle's history after every batch: with a new
    sink and index before every other batch (the index rebuilt from the table and the
    tombstones), tagged in the driver or in Spark tasks, rewriting files or (a change data
    feed from batch 1 on) through MERGE."""
    events = random_global_batches(seed, batches=6, per_batch=60, keys=25, days=3)
    cfg = dict(table_uri=str(tmp_path / "t"), key=["id"], partition_by=["dt"], ordering="ts", delete_when="op = 'd'",
               scope="global", scd_type=2, writer_id="w", num_shards=2, metrics_port=0, tag_on=tag_on)
    sink = None
    for b, batch in enumerate(events):
        if b % 2 == 0:
            sink = UpsertSink(SinkConfig(index_dir=str(tmp_path / f"index-{b}"), **cfg))
        sink(spark.createDataFrame(batch, EVENT_SCHEMA), b)
        assert sink.reports[-1].ops["quarantined"] == 0
        assert sink.reports[-1].mode == ("append" if b == 0 else "merge" if merge else "rewrite")
        assert history_rows(cfg["table_uri"]) == expected_history(events[: b + 1], scope="global"), f"batch {b}"
        if merge and b == 0:
            DeltaTable(cfg["table_uri"]).alter.set_table_properties({"delta.enableChangeDataFeed": "true"})
    partitions_of: dict[str, set] = {}
    for dt, key, *_ in history_rows(cfg["table_uri"]):
        partitions_of.setdefault(key, set()).add(dt)
    assert any(len(dts) > 1 for dts in partitions_of.values()), "no key has versions in several partitions"
    verify_replicas(sink.config)


def test_in_global_scope_a_replica_built_from_the_table_learns_where_another_wrote_an_older_version(
        spark, tmp_path):
    """Two index dirs in turn, as two executors running the one shard: a replica's list of a
    key's partitions can name one that holds no version (an event there lost a tie), while a
    replica built from the table lists only those that do. An older event in that partition
    then adds a version without changing the list of the replica that tags it: the
    changelog must still tell the other replica, whose next late event there splits that
    version."""
    a, b = "2025-01-05", "2025-01-03"
    events = [
        [Event("k", a, 10, "u", "x")],  # dir 0
        [Event("k", b, 10, "u", "x")],  # dir 0: a tie the stored version wins; its list gains b
        [Event("j", a, 1, "u", "x")],  # dir 1: a new replica, built from the table: k in a
        [Event("k", b, 5, "u", "y")],  # dir 0: a version [5, 10) in b, k's entry and list unchanged
        [Event("k", b, 7, "u", "z")],  # dir 1: splits it, which needs the table's rows of k in b
    ]
    cfg = dict(table_uri=str(tmp_path / "t"), key=["id"], partition_by=["dt"], ordering="ts", delete_when="op = 'd'",
               scope="global", scd_type=2, writer_id="w", num_shards=1, metrics_port=0, tag_on="executors")
    sinks = [UpsertSink(SinkConfig(index_dir=str(tmp_path / f"index-{i}"), **cfg)) for i in range(2)]
    for n, batch in enumerate(events):
        sink = sinks[0 if n in (0, 1, 3) else 1]
        sink(spark.createDataFrame(batch, EVENT_SCHEMA), n)
        assert history_rows(cfg["table_uri"]) == expected_history(events[: n + 1], scope="global"), f"batch {n}"
    assert sinks[1].reports[-1].changelog_applied == 1  # batch 3's entry of k


@pytest.mark.parametrize("scope, point, engine", [
    ("partitioned", "written", "deltalake"), ("global", "committed", "deltalake"), ("global", "written", "deltalake"),
    ("partitioned", "committed", "delta-spark"), ("global", "tagged", "delta-spark")])
def test_a_driver_killed_inside_a_history_commit_resumes_to_the_oracles_history(spark, tmp_path, scope, point,
                                                                                 engine):
    """kill -9 of the driver after a history batch's files are written (they are never
    committed), before Spark's MERGE runs, or once its commit landed (the replay is skipped).
    The restarted query hands the batch again, on a replica the killed process left dirty
    (wiped and rebuilt from the table and the tombstones), and the table equals the oracle's
    history after every batch."""
    run = subprocess.run([sys.executable, "-m", "tests.history_crash", "--work", str(tmp_path), "--scope", scope,
                          "--point", point, "--engine", engine], cwd=Path(__file__).resolve().parent.parent,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == -signal.SIGKILL, run.stderr[-3000:]
    batches = history_crash.stream(scope)
    cfg = history_crash.config(tmp_path, scope, engine)
    landed = history_crash.CRASH_BATCH + (point == "committed")
    assert history_rows(cfg.table_uri) == expected_history(batches[:landed], scope=scope)
    orphans = never_committed(cfg.table_uri)["data"]
    assert orphans > 0 if point == "written" else orphans == 0
    sink = UpsertSink(cfg)  # the restarted query
    commits = UPDATES_COMMIT[engine]
    for b in range(history_crash.CRASH_BATCH, len(batches)):
        sink(spark.createDataFrame(batches[b], EVENT_SCHEMA), b)
        assert sink.reports[-1].mode == ("skipped" if b < landed else commits), b
        assert history_rows(cfg.table_uri) == expected_history(batches[: b + 1], scope=scope), f"batch {b}"
    assert never_committed(cfg.table_uri)["data"] == orphans  # the killed attempt's files stay uncommitted
    assert sum(r.replicas_rebuilt for r in sink.reports) > 0  # the dirty replicas were wiped
    sink.close()
    verify_replicas(cfg)


def test_in_global_scope_a_second_writers_move_between_tagging_and_commit_is_rebuilt_from(spark, tmp_path):
    """Writer b moves key k into another partition after writer a tagged its batch: a tags
    again on an index reloaded from the table, whose list for k now names b's partition,
    and k's history spans all three partitions as the oracle's does."""
    def sink(name):
        return UpsertSink(SinkConfig(
            table_uri=str(tmp_path / "t"), key=["id"], partition_by=["dt"], ordering="ts", delete_when="op = 'd'",
            scope="global", scd_type=2, writer_id=f"w-{name}", num_shards=2, metrics_port=0,
            index_dir=str(tmp_path / f"index-{name}"), max_commit_retries=1))
    a, b = sink("a"), sink("b")
    seed = [Event("k", "2025-01-01", 1, "u", "seed"), Event("j", "2025-01-01", 1, "u", "j")]
    ours = [Event("k", "2025-01-01", 5, "u", "ours"), Event("k", "2025-01-03", 2, "u", "late"),
            Event("j", None, 4, "d", "gone")]
    theirs = [Event("k", "2025-01-02", 3, "u", "theirs")]
    a(spark.createDataFrame(seed, EVENT_SCHEMA), 0)
    calls = commits_first(a, "commit_history", lambda: b(spark.createDataFrame(theirs, EVENT_SCHEMA), 0))
    a(spark.createDataFrame(ours, EVENT_SCHEMA), 1)
    assert (len(calls), a.reports[-1].retries) == (2, 1)
    assert history_rows(str(tmp_path / "t")) == expected_history([seed, theirs, ours], scope="global")
    assert {dt for dt, key, *_ in history_rows(str(tmp_path / "t")) if key == "k"} == {
        "2025-01-01", "2025-01-02", "2025-01-03"}


def test_a_new_column_joins_a_history_table_that_fills_nulls(spark, tmp_path):
    """ignore_null_updates keeps every value of a run's earlier events in __RUN_EVENTS: a new
    column, tracked, widens it too. The table equals one fed every event in one batch."""
    wider = USERS + ", country STRING"
    later = [(124, "Raul", None, "UPDATE", 3, "MX"), (125, None, "Mexicali", "UPDATE", 5, None)]
    options = dict(ignore_null_updates=True)
    sink = UpsertSink(users_config(tmp_path, **options))
    sink(spark.createDataFrame(USER_CHANGES[:4], USERS), 0)
    sink(spark.createDataFrame(later, wider), 1)
    whole = tmp_path / "whole"
    UpsertSink(users_config(whole, **options))(spark.createDataFrame(
        [(*e, None) for e in USER_CHANGES[:4]] + later, wider), 0)
    columns = ("userId", "name", "city", "country", START_AT, END_AT)
    assert history(str(tmp_path / "users"), *columns) == history(str(whole / "users"), *columns)
    assert (124, "Raul", "Oaxaca", "MX", 3, None) in history(str(tmp_path / "users"), *columns)
