"""Scope "global": a key is unique across the table. Moves, key-only deletes, re-sends and
late events end exact against an independent oracle, through restarts, replays, lost
replicas and another writer's commits."""

import dataclasses

import pyarrow as pa
import pytest
from deltalake import DeltaTable, write_deltalake
from prometheus_client import REGISTRY

from sink import ContractMismatchError, SinkConfig, UpsertSink
from sink.index.keyspace_filters import KEY_FILTER_FILE
from tests import damage
from tests.engines import ENGINE_OPTIONS
from tests.oracle import SCHEMA, Event, expected_global_rows, random_global_batches, taken_back, verify_replicas

pytestmark = pytest.mark.spark


def config(tmp_path, **extra):
    return SinkConfig(table_uri=str(tmp_path / "table"), key=["id"], partition_by=["dt"], ordering="ts",
                      delete_when="op = 'd'", scope="global", writer_id=extra.pop("writer_id", "global"),
                      index_dir=str(tmp_path / "index"), metrics_port=0, **extra)


def rows(uri):
    return sorted(DeltaTable(uri).to_pyarrow_table().to_pylist(), key=lambda r: (r["dt"], r["id"]))


def frame(spark, events):
    return spark.createDataFrame(events, SCHEMA)


# Under delta-spark, updates commit through Spark's MERGE, in ON the partitions holding the
# batch's stored keys.
@pytest.mark.parametrize("seed, shards, tag_on, engine", [
    (11, 2, "executors", "deltalake"), (12, 3, "driver", "deltalake"), (13, 2, "executors", "delta-spark")])
@pytest.mark.connect(engine="deltalake")
def test_a_global_stream_matches_the_oracle_through_restarts_replays_and_lost_replicas(spark, tmp_path, seed,
                                                                                        shards, tag_on, engine):
    cfg = config(tmp_path, num_shards=shards, tag_on=tag_on, **ENGINE_OPTIONS[engine])
    batches = random_global_batches(seed, batches=7, per_batch=250)
    sink = UpsertSink(cfg)
    filtered = missed = 0
    for b, events in enumerate(batches):
        if b in (2, 5):
            sink = UpsertSink(cfg)  # a restart
        if b in (3, 5):
            damage.lose(tmp_path / "index")  # the replica is lost
        sink(frame(spark, events), b)
        report = sink.reports[-1]
        assert report.ops["quarantined"] == 0  # key-only deletes are not bad input in global scope
        assert report.filter_misses <= report.misses
        filtered, missed = filtered + report.filter_misses, missed + report.misses
        assert rows(cfg.table_uri) == expected_global_rows(batches[: b + 1]), f"after batch {b}"
        if b == 4:
            version = DeltaTable(cfg.table_uri).version()
            sink(frame(spark, events), b)  # a replay of a committed batch
            assert sink.reports[-1].mode == "skipped" and DeltaTable(cfg.table_uri).version() == version
    ids = [r["id"] for r in rows(cfg.table_uri)]
    assert len(ids) == len(set(ids))
    sink.close()  # as when the job stops: replicas the driver keeps open are flushed once a minute
    assert sum(r["entries_checked"] for r in verify_replicas(cfg)) > 0
    # New keys are answered by the key filter, without RocksDB, but for its rare false positives.
    assert filtered >= 0.95 * missed > 0


def test_the_key_filter_answers_new_keys_and_the_metrics_say_so(spark, tmp_path):
    cfg = config(tmp_path, num_shards=1, writer_id="global-metrics")
    sink = UpsertSink(cfg)
    sink(frame(spark, [Event(k, "2025-01-01", 1, "u", "x") for k in "abc"]), 0)
    sink(frame(spark, [Event("a", "2025-01-01", 2, "u", "y"), Event("d", "2025-01-02", 1, "u", "x")]), 1)

    def value(**labels):
        return REGISTRY.get_sample_value("upsert_sink_index_lookups_total", {"sink": "global-metrics", **labels})

    # a, b, c, then d: new keys of a keyspace whose filter holds none of them; a: a hit.
    assert value(result="miss", tier="filter") == 4
    assert value(result="miss", tier="rocksdb") == 0
    assert value(result="hit", tier="memory") + value(result="hit", tier="rocksdb") == 1
    assert [r.filter_misses for r in sink.reports] == [3, 1]


def test_a_damaged_or_restored_key_filter_file_is_rebuilt_and_the_stream_stays_exact(spark, tmp_path):
    """The replica is taken back from the worker keeping it after every batch (executor
    tagging: closed clean, its filter saved), so each batch reopens it and reads the saved
    filter: one truncated, then one restored from an earlier batch (it lacks keys added since)."""
    cfg = config(tmp_path, num_shards=1, tag_on="executors", hot_cache_entries=0)
    batches = random_global_batches(31, batches=5, per_batch=250, keys=400)
    sink = UpsertSink(cfg)
    for b, events in enumerate(batches):
        if b:
            taken_back(tmp_path / "index")
        saved = next((tmp_path / "index").glob(f"*/shard-0-of-1/{KEY_FILTER_FILE}"), None)
        if b == 2:
            earlier = saved.read_bytes()
        if b == 3:
            saved.write_bytes(saved.read_bytes()[:-64])
        if b == 4:
            saved.write_bytes(earlier)
        sink(frame(spark, events), b)
        assert rows(cfg.table_uri) == expected_global_rows(batches[: b + 1]), f"after batch {b}"
        assert sink.reports[-1].filter_misses > 0
    assert sum(r["entries_checked"] for r in verify_replicas(cfg)) > 0


def test_a_newer_record_moves_its_key_and_a_stale_one_never_does(spark, tmp_path):
    cfg = config(tmp_path, num_shards=1)
    sink = UpsertSink(cfg)
    sink(frame(spark, [Event("a", "2025-01-01", 5, "u", "x"), Event("b", "2025-01-01", 5, "u", "x")]), 0)
    sink(frame(spark, [Event("a", "2025-01-02", 6, "u", "moved"), Event("b", "2025-01-03", 4, "u", "stale")]), 1)
    assert [(r["id"], r["dt"], r["v"]) for r in rows(cfg.table_uri)] == [
        ("b", "2025-01-01", "x"), ("a", "2025-01-02", "moved")]
    report = sink.reports[-1]
    assert (report.ops["update"], report.ops["stale"], report.mode) == (1, 1, "rewrite")
    # The MERGE scanned only the partition the index placed the moved key in.
    assert report.merge_partitions == 1


def test_a_key_only_delete_finds_the_row_and_one_of_an_unknown_key_changes_nothing(spark, tmp_path):
    cfg = config(tmp_path, num_shards=2)
    sink = UpsertSink(cfg)
    sink(frame(spark, [Event("a", "2025-01-01", 5, "u", "x"), Event("b", "2025-01-02", 5, "u", "x")]), 0)
    version = DeltaTable(cfg.table_uri).version()
    sink(frame(spark, [Event("a", None, 6, "d", ""), Event("zz", None, 6, "d", "")]), 1)
    assert [r["id"] for r in rows(cfg.table_uri)] == ["b"]
    assert DeltaTable(cfg.table_uri).version() == version + 1
    assert (sink.reports[-1].ops["delete"], sink.reports[-1].ops["delete_missing"]) == (1, 1)
    # The tombstone keeps an older late update of the deleted key out, in any partition.
    sink(frame(spark, [Event("a", "2025-01-03", 4, "u", "late"), Event("zz", "2025-01-03", 5, "u", "late")]), 2)
    assert [r["id"] for r in rows(cfg.table_uri)] == ["b"]
    assert sink.reports[-1].ops["stale"] == 2


def test_another_writers_delete_and_insert_are_followed_with_and_without_a_change_feed(spark, tmp_path):
    for feed in (False, True):
        base = tmp_path / f"feed-{feed}"
        cfg = config(base, num_shards=1)
        sink = UpsertSink(cfg)
        sink(frame(spark, [Event("a", "2025-01-01", 5, "u", "x"), Event("b", "2025-01-02", 5, "u", "x")]), 0)
        table = DeltaTable(cfg.table_uri)
        if feed:
            table.alter.set_table_properties({"delta.enableChangeDataFeed": "true"})
        table.delete("id = 'a'")
        write_deltalake(cfg.table_uri, pa.table({"id": ["c"], "dt": ["2025-01-04"], "ts": [5], "op": ["u"],
                                                 "v": ["foreign"]}), mode="append")
        # "a" is gone (an insert now), "c" lives in 2025-01-04 (an update there, so a move).
        sink(frame(spark, [Event("a", "2025-01-01", 6, "u", "again"), Event("c", "2025-01-05", 6, "u", "moved")]), 1)
        assert [(r["id"], r["dt"], r["v"]) for r in rows(cfg.table_uri)] == [
            ("a", "2025-01-01", "again"), ("b", "2025-01-02", "x"), ("c", "2025-01-05", "moved")]
        report = sink.reports[-1]
        assert (report.ops["insert"], report.ops["update"]) == (1, 1)
        # Another writer's commit reloads the keyspace, feed or not: what it deleted is in the
        # tombstone table, where a rebuilt replica finds it too.
        assert report.partition_loads["invalidated"] == 1


def test_a_table_written_in_partitioned_scope_refuses_a_global_sink(spark, tmp_path):
    partitioned = SinkConfig(table_uri=str(tmp_path / "table"), key=["id"], partition_by=["dt"], ordering="ts",
                             writer_id="p", index_dir=str(tmp_path / "index"), metrics_port=0)
    UpsertSink(partitioned)(frame(spark, [Event("a", "2025-01-01", 5, "u", "x")]), 0)
    with pytest.raises(ContractMismatchError, match="scope"):
        UpsertSink(config(tmp_path))(frame(spark, [Event("a", "2025-01-02", 6, "u", "y")]), 0)


def test_global_shards_moving_every_batch_catch_up_from_the_changelog(spark, tmp_path):
    """Two index dirs used in turn, as by two executors each running every shard every other
    batch: moves and key-only deletes tagged on one are applied from the changelog on the other."""
    cfg = config(tmp_path, num_shards=2, tag_on="executors")  # the path that writes the changelog
    batches = random_global_batches(21, batches=6, per_batch=250)
    executors = [UpsertSink(dataclasses.replace(cfg, index_dir=str(tmp_path / name)))
                 for name in ("executor-a", "executor-b")]
    for b, events in enumerate(batches):
        sink = executors[b % 2]
        sink(frame(spark, events), b)
        report = sink.reports[-1]
        assert rows(cfg.table_uri) == expected_global_rows(batches[: b + 1]), f"after batch {b}"
        assert report.partition_loads["invalidated"] == 0
        if b >= 2:  # the other executor's batch came from the changelog, nothing reloaded
            assert sum(report.partition_loads.values()) == 0
            assert report.shard_moves == 2 and report.changelog_applied > 0
    for sink in executors:
        verify_replicas(sink.config)
