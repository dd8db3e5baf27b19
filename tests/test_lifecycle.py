"""The replica lifecycle through the sink: bootstrap, warm restarts, foreign commits."""

import datetime as dt
import os

import pyarrow as pa
import pytest
from deltalake import DeltaTable, write_deltalake

from sink import SinkConfig, UpsertSink
from sink.tagging.task_context import default_index_root
from tests.oracle import verify_replicas

pytestmark = pytest.mark.spark

NOW = dt.datetime(2025, 3, 1, 12, tzinfo=dt.UTC)
SCHEMA = "id string, dt string, event_time timestamp, op string, v string"
ARROW = pa.schema([("id", pa.string()), ("dt", pa.string()), ("event_time", pa.timestamp("us", tz="UTC")),
                   ("op", pa.string()), ("v", pa.string())])


def day(d):
    return (NOW.date() - dt.timedelta(days=d)).isoformat()


def at(d, minutes=0):
    return NOW - dt.timedelta(days=d) + dt.timedelta(minutes=minutes)


def seed_table(uri, days=60, per_day=20, cdf=False):
    rows = [(f"k{d}-{k}", day(d), at(d), "u", "seed") for d in range(days) for k in range(per_day)]
    write_deltalake(uri, pa.Table.from_pylist([dict(zip(ARROW.names, r)) for r in rows], schema=ARROW),
                    partition_by=["dt"],
                    configuration={"delta.enableChangeDataFeed": "true"} if cdf else None)


def rows_of(uri):
    return {(r["dt"], r["id"]): (r["event_time"], r["v"]) for r in DeltaTable(uri).to_pyarrow_table().to_pylist()}


@pytest.fixture
def cfg(tmp_path):
    return SinkConfig(table_uri=str(tmp_path / "t"), key=["id"], partition_by=["dt"], ordering="event_time",
                      delete_when="op = 'd'", writer_id="lifecycle", index_dir=str(tmp_path / "index"),
                      num_shards=1, metrics_port=0, bootstrap_days=7)


def sink_for(cfg):
    return UpsertSink(cfg, clock=lambda: NOW.timestamp())


def batch(spark, *rows):
    return spark.createDataFrame(list(rows), SCHEMA)


def test_fresh_start_bootstraps_the_hot_window_and_loads_an_old_partition_on_demand(spark, cfg):
    cfg.peek_max_keys = 0  # loads always (reads of a few keys: the next tests)
    seed_table(cfg.table_uri)
    sink = sink_for(cfg)
    sink(batch(spark, ("k40-1", day(40), at(40, 5), "u", "late update"), ("new", day(40), at(40), "u", "n")), 0)
    report = sink.reports[-1]
    assert report.partition_loads == {"bootstrap": 7, "on_demand": 1, "invalidated": 0}
    assert report.ops["update"] == 1 and report.ops["insert"] == 1
    assert report.hits == 1 and report.misses == 1
    table = rows_of(cfg.table_uri)
    assert table[(day(40), "k40-1")] == (at(40, 5), "late update")
    assert len(table) == 60 * 20 + 1

    # A restart on the unchanged table: the replica is warm, nothing loads; one log entry
    # (the batch's own commit) is read.
    restarted = sink_for(cfg)
    restarted(batch(spark, ("k40-2", day(40), at(40, 5), "u", "x"), ("k0-1", day(0), at(0, 5), "u", "y")), 1)
    report = restarted.reports[-1]
    assert report.partition_loads == {"bootstrap": 0, "on_demand": 0, "invalidated": 0}
    assert report.commits_read == 1 and report.hits == 2
    verify_replicas(cfg)


def test_a_late_record_for_an_old_partition_reads_its_key_and_the_partition_named_again_loads(spark, cfg):
    seed_table(cfg.table_uri)
    cfg.partition_ttl_hours = 1
    clock = [NOW.timestamp()]
    sink = UpsertSink(cfg, clock=lambda: clock[0])
    batches = [  # (seconds since the batch before, records)
        (0, [("k40-1", day(40), at(40, 5), "u", "late"), ("new", day(40), at(40), "u", "n")]),  # update, insert
        (7200, [("k40-1", day(40), at(40, 2), "u", "older")]),  # past the TTL: read again; stale against batch 0
        (7200, [("new", day(40), at(40, 9), "d", None)]),  # read again: deletes batch 0's insert
        (61, [("new", day(40), at(40, 8), "u", "too late"), ("k40-2", day(40), at(40, 1), "u", "x")]),  # loads
        (61, [("k40-3", day(40), at(40, 1), "u", "y")]),  # held
    ]
    for b, (seconds, rows) in enumerate(batches):
        clock[0] += seconds  # at least SIZES_EVERY_S: partitions_held is fresh
        sink(batch(spark, *rows), b)
    reports = sink.reports
    assert [r.partition_peeks for r in reports] == [1, 1, 1, 0, 0]
    assert [r.partition_loads["on_demand"] for r in reports] == [0, 0, 0, 1, 0]
    # The hot window, evicted an hour after its last use; then day 40.
    assert [r.partitions_held for r in reports] == [7, 0, 0, 1, 1]
    assert [(r.table_hits, r.table_misses) for r in reports] == [(1, 1), (1, 0), (1, 0), (0, 0), (0, 0)]
    assert [(r.hits, r.misses) for r in reports] == [(1, 1), (1, 0), (1, 0), (2, 0), (1, 0)]
    assert [{o: n for o, n in r.ops.items() if n} for r in reports] == [
        {"update": 1, "insert": 1}, {"stale": 1}, {"delete": 1}, {"stale": 1, "update": 1}, {"update": 1}]
    table = rows_of(cfg.table_uri)
    assert (day(40), "new") not in table
    assert [table[(day(40), f"k40-{k}")] for k in (1, 2, 3)] == [(at(40, 5), "late"), (at(40, 1), "x"),
                                                                 (at(40, 1), "y")]
    assert len(table) == 60 * 20
    sink.close()
    verify_replicas(cfg)


def test_a_partition_named_many_keys_of_loads_and_few_keys_of_reads_them(spark, cfg):
    seed_table(cfg.table_uri)
    cfg.peek_max_keys = 2
    sink = sink_for(cfg)
    # Three keys of day 41 (more than peek_max_keys) load it; two of day 42 are read.
    sink(batch(spark, *[(f"k41-{k}", day(41), at(41, 5), "u", "late") for k in range(3)],
               *[(f"k42-{k}", day(42), at(42, 5), "u", "late") for k in range(2)]), 0)
    report = sink.reports[-1]
    assert (report.partition_loads["on_demand"], report.partition_peeks) == (1, 1)
    assert report.ops["update"] == 5
    table = rows_of(cfg.table_uri)
    assert all(table[(day(d), f"k{d}-{k}")] == (at(d, 5), "late") for d, n in ((41, 3), (42, 2)) for k in range(n))
    sink.close()
    verify_replicas(cfg)


def foreign_update(uri, keys_by_day, minutes, value):
    """Another deltalake writer updates these keys (newer event time)."""
    rows = [dict(zip(ARROW.names, (k, day(d), at(d, minutes), "u", value))) for d, k in keys_by_day]
    (DeltaTable(uri).merge(pa.Table.from_pylist(rows, schema=ARROW),
                           "t.id = s.id AND t.dt = s.dt", source_alias="s", target_alias="t")
     .when_matched_update_all().execute())


def test_another_writers_commit_to_a_partition_only_read_is_seen_by_the_next_read(spark, cfg):
    """The replica holds nothing of a partition it only read a few keys of, so no catch-up
    covers it: the next read must find the other writer's rows in the table itself."""
    seed_table(cfg.table_uri)
    cfg.partition_ttl_hours = 1
    clock = [NOW.timestamp()]
    sink = UpsertSink(cfg, clock=lambda: clock[0])
    sink(batch(spark, ("k40-1", day(40), at(40, 5), "u", "ours")), 0)
    foreign_update(cfg.table_uri, [(40, "k40-1"), (40, "k40-2")], 30, "foreign")
    clock[0] += 7200  # past the TTL: read again, not loaded
    sink(batch(spark, ("k40-1", day(40), at(40, 20), "u", "older than foreign"),
               ("k40-2", day(40), at(40, 40), "u", "newer than foreign")), 1)
    report = sink.reports[-1]
    assert [r.partition_peeks for r in sink.reports] == [1, 1]
    assert sum(r.partition_loads["on_demand"] for r in sink.reports) == 0
    assert report.ops["stale"] == 1 and report.ops["update"] == 1
    table = rows_of(cfg.table_uri)
    assert table[(day(40), "k40-1")] == (at(40, 30), "foreign")
    assert table[(day(40), "k40-2")] == (at(40, 40), "newer than foreign")
    assert len(table) == 60 * 20
    sink.close()
    verify_replicas(cfg)


@pytest.mark.parametrize("cdf", [False, True])
def test_a_foreign_commit_is_caught_up_exactly(spark, cfg, cdf):
    seed_table(cfg.table_uri, days=10, cdf=cdf)
    sink = sink_for(cfg)
    sink(batch(spark, ("k1-0", day(1), at(1, 1), "u", "ours")), 0)
    assert sink.reports[-1].partition_loads["bootstrap"] == 7
    foreign_update(cfg.table_uri, [(2, "k2-0"), (3, "k3-0")], 30, "foreign")
    # Updates older than the foreign ones must be stale; newer ones win.
    sink(batch(spark, ("k2-0", day(2), at(2, 10), "u", "older"), ("k3-0", day(3), at(3, 40), "u", "newer"),
               ("k1-0", day(1), at(1, 2), "u", "ours again")), 1)
    report = sink.reports[-1]
    assert report.commits_read == 2  # our batch 0, then the foreign merge
    # Exactly the two partitions the foreign merge touched are dropped and reload, change data
    # feed or not: what a reload reads is what a rebuilt replica would.
    assert (report.invalidated, report.partition_loads["invalidated"]) == (2, 2)
    assert report.partition_loads["on_demand"] == 0
    assert report.ops == {"insert": 0, "update": 2, "delete": 0, "delete_missing": 0, "unchanged": 0, "stale": 1,
                          "superseded": 0, "quarantined": 0}
    table = rows_of(cfg.table_uri)
    assert table[(day(2), "k2-0")] == (at(2, 30), "foreign")
    assert table[(day(3), "k3-0")] == (at(3, 40), "newer")
    assert table[(day(1), "k1-0")] == (at(1, 2), "ours again")
    verify_replicas(cfg)


def test_partitions_idle_past_the_ttl_are_evicted(spark, cfg):
    seed_table(cfg.table_uri, days=10)
    cfg.partition_ttl_hours = 24
    clock = [NOW.timestamp()]
    sink = UpsertSink(cfg, clock=lambda: clock[0])
    sink(batch(spark, ("k0-0", day(0), at(0, 1), "u", "a")), 0)
    assert sink.reports[-1].partitions_held == 7
    clock[0] += 25 * 3600  # a day later, only one partition is written to
    sink(batch(spark, ("k0-0", day(0), at(0, 2), "u", "b")), 1)
    assert sink.reports[-1].evicted == 6
    assert sink.reports[-1].partitions_held == 1


@pytest.mark.parametrize("env, root", [
    # YARN: the container's LOCAL_DIRS.
    ({"CONTAINER_ID": "container_1", "LOCAL_DIRS": "/yarn/a/app_1,/yarn/b/app_1", "SPARK_LOCAL_DIRS": "/x"},
     "/yarn/a/app_1"),
    # Standalone: the worker's per-executor dirs (path-separated), before what PySpark hands workers.
    ({"SPARK_EXECUTOR_DIRS": os.pathsep.join(["/w/app-1/0", "/w2/app-1/0"]), "SPARK_LOCAL_DIRS": "/w/app-1/0/bm"},
     "/w/app-1/0"),
    # Kubernetes (and any PySpark worker): SPARK_LOCAL_DIRS.
    ({"SPARK_LOCAL_DIRS": "/disk1/spark,/disk2/spark"}, "/disk1/spark"),
    # LOCAL_DIRS outside a YARN container is not Spark's.
    ({"LOCAL_DIRS": "/not/yarn"}, "/data/local"),
])
def test_default_index_dir_follows_sparks_local_dir_conventions(env, root):
    assert default_index_root("/data/local", env) == os.path.join(root, "upsert-sink-index")


def test_default_index_dir_without_spark_dirs_is_never_bare_tmp():
    assert default_index_root(None, {}).endswith("/upsert-sink-index")
    assert default_index_root(None, {}) != "/tmp"
