import dataclasses

import pytest
from deltalake import DeltaTable
from prometheus_client import REGISTRY

from sink import SchemaError, SinkConfig, UpsertSink, WriterIdReusedError
from sink.keys import shard_of
from tests import damage
from tests.engines import ENGINE_OPTIONS, UPDATES_COMMIT
from tests.oracle import SCHEMA, Event, expected_rows, random_batches, verify_replicas

pytestmark = pytest.mark.spark


def table_rows(uri):
    rows = DeltaTable(uri).to_pyarrow_table().to_pylist()
    return sorted(rows, key=lambda r: (r["dt"], r["id"]))


def config(tmp_path, **extra):
    return SinkConfig(
        table_uri=str(tmp_path / "table"), key=["id"], partition_by=["dt"], ordering="ts",
        delete_when="op = 'd'", checkpoint_dir=str(tmp_path / "cp"), index_dir=str(tmp_path / "index"),
        metrics_port=0, **extra,
    )


def frame(spark, events):
    return spark.createDataFrame(events, SCHEMA)


# peek_max_keys: 0 loads every partition a batch names; 16 reads some for their few keys
# instead (the stream names 150 keys over 4 old partitions), then loads them. Under
# delta-spark, updates commit through Spark's MERGE (commit_mode = "merge"): from the
# driver's records, or from the writes the executors tagged.
@pytest.mark.parametrize("seed, shards, tag_on, peek_max_keys, engine", [
    (1, 2, "executors", 0, "deltalake"), (2, 3, "executors", 0, "deltalake"), (3, 2, "driver", 0, "deltalake"),
    (4, 3, "executors", 16, "deltalake"), (5, 2, "driver", 16, "deltalake"), (6, 2, "driver", 16, "delta-spark"),
    (7, 3, "executors", 0, "delta-spark")])
@pytest.mark.connect(engine="deltalake")
def test_random_stream_matches_the_oracle_through_restarts_replays_and_lost_replicas(spark, tmp_path, seed, shards,
                                                                                     tag_on, peek_max_keys, engine):
    updates = UPDATES_COMMIT[engine]
    cfg = config(tmp_path, num_shards=shards, tag_on=tag_on, peek_max_keys=peek_max_keys, **ENGINE_OPTIONS[engine])
    batches = random_batches(seed, batches=7, per_batch=300)
    sink = UpsertSink(cfg)
    for b, events in enumerate(batches):
        if b in (2, 5):
            sink = UpsertSink(cfg)  # a query restart: a new sink object, same replica on disk
        if b in (3, 5):
            damage.lose(tmp_path / "index")  # the replica is lost: costs time, never correctness
        sink(frame(spark, events), b)
        report = sink.reports[-1]
        assert report.mode in ("append", updates)
        assert report.records_in == len(events)
        assert report.ops["quarantined"] == sum(e.id is None for e in events)
        assert table_rows(cfg.table_uri) == expected_rows(batches[: b + 1]), f"after batch {b}"
        if b == 4:
            # The same batch id handed again: already committed, nothing written or counted.
            version = DeltaTable(cfg.table_uri).version()
            sink(frame(spark, events), b)
            assert sink.reports[-1].mode == "skipped"
            assert sink.reports[-1].records_in == 0
            assert DeltaTable(cfg.table_uri).version() == version
            assert table_rows(cfg.table_uri) == expected_rows(batches[: b + 1])
    modes = {r.mode for r in sink.reports}
    assert updates in modes
    assert (sum(r.partition_peeks for r in sink.reports) > 0) == (peek_max_keys > 0)
    sink.close()  # as when the job stops: replicas the driver keeps open are flushed once a minute
    assert sum(r["entries_checked"] for r in verify_replicas(cfg)) > 0


def test_replay_after_a_lost_checkpoint_commit_is_skipped_by_a_new_sink(spark, tmp_path):
    cfg = config(tmp_path)
    events = [Event("a", "2025-01-01", 1, "u", "x"), Event("b", "2025-01-01", 1, "d", "y")]
    UpsertSink(cfg)(frame(spark, events), 0)
    restarted = UpsertSink(cfg)
    restarted(frame(spark, events), 0)  # Spark replays batch 0 after a crash before its checkpoint
    assert restarted.reports[-1].mode == "skipped"
    assert table_rows(cfg.table_uri) == expected_rows([events])


def test_a_batch_older_than_the_committed_one_means_a_reused_writer_id(spark, tmp_path):
    cfg = config(tmp_path)
    sink = UpsertSink(cfg)
    for b in range(3):
        sink(frame(spark, [Event(f"k{b}", "2025-01-01", b, "u", "x")]), b)
    with pytest.raises(WriterIdReusedError, match="new checkpoint location needs a new writer_id"):
        UpsertSink(cfg)(frame(spark, [Event("z", "2025-01-01", 9, "u", "x")]), 0)


def test_bad_records_go_to_quarantine_with_their_reason_and_good_ones_commit(spark, tmp_path):
    cfg = config(tmp_path)
    events = [
        Event("good", "2025-01-01", 1, "u", "ok"),
        Event(None, "2025-01-01", 1, "u", "no key"),
        Event("p", None, 1, "u", "no partition"),
        Event("o", "2025-01-01", None, "u", "no ordering"),
    ]
    sink = UpsertSink(cfg)
    sink(frame(spark, events), 0)
    assert table_rows(cfg.table_uri) == [events[0]._asdict()]
    quarantine = sorted(DeltaTable(cfg.resolved_quarantine_uri).to_pyarrow_table().to_pylist(),
                        key=lambda r: r["v"])
    assert [(r["v"], r["_quarantine_reason"], r["_quarantine_batch_id"]) for r in quarantine] == [
        ("no key", "null key column id", 0),
        ("no ordering", "null ordering column ts", 0),
        ("no partition", "null partition column dt", 0),
    ]
    assert sink.reports[-1].ops["quarantined"] == 3
    sink(frame(spark, events), 0)  # a replayed batch does not quarantine twice
    assert DeltaTable(cfg.resolved_quarantine_uri).to_pyarrow_table().num_rows == 3


def test_a_config_naming_a_missing_column_fails_before_anything_is_written(spark, tmp_path):
    cfg = SinkConfig(table_uri=str(tmp_path / "t"), key=["id"], ordering="event_time",
                     writer_id="w", metrics_port=0)
    with pytest.raises(SchemaError, match="ordering column 'event_time' is not in the stream"):
        UpsertSink(cfg)(frame(spark, [Event("a", "d", 1, "u", "x")]), 0)
    assert not DeltaTable.is_deltatable(cfg.table_uri)


@pytest.mark.parametrize(("column", "error"), [
    ("v", r"freshness_column 'v' has type string; accepted types: \['long', 'timestamp', 'timestamp_ntz'\]"),
    ("ts_ms", r"freshness_column 'ts_ms' is not in the stream \(its columns: \['dt', 'id', 'op', 'ts', 'v'\]\)"),
])
def test_a_freshness_column_the_stream_lacks_or_of_another_type_is_named(spark, tmp_path, column, error):
    cfg = dataclasses.replace(config(tmp_path, writer_id="w"), freshness_column=column)
    with pytest.raises(SchemaError, match=error):
        UpsertSink(cfg)(frame(spark, [Event("a", "d", 1, "u", "x")]), 0)
    assert not DeltaTable.is_deltatable(cfg.table_uri)


def test_a_bad_delete_expression_is_named(spark, tmp_path):
    cfg = config(tmp_path, writer_id="w")
    cfg.delete_when = "operation = 'd'"
    with pytest.raises(SchemaError, match="delete_when = \"operation = 'd'\" does not apply"):
        UpsertSink(cfg).validate(frame(spark, []))


@pytest.mark.parametrize("peek_max_keys", [0, 4])
def test_metrics_count_exactly_what_the_batch_did(spark, tmp_path, peek_max_keys):
    cfg = config(tmp_path, writer_id=f"metrics-test-{peek_max_keys}", num_shards=2, peek_max_keys=peek_max_keys)
    events = [
        Event("a", "2025-01-01", 1, "u", "1"),
        Event("a", "2025-01-01", 2, "u", "2"),  # same key again: an update
        Event("b", "2025-01-02", 1, "u", "1"),
        Event("c", "2025-01-02", 1, "d", "1"),  # delete of a key never seen
        Event(None, "2025-01-02", 1, "u", "bad"),
    ]
    sink = UpsertSink(cfg)
    sink(frame(spark, events), 0)
    sink(frame(spark, [Event("a", "2025-01-01", 0, "u", "old"), Event("b", "2025-01-02", 5, "u", "new")]), 1)

    def value(name, **labels):
        return REGISTRY.get_sample_value(name, {"sink": f"metrics-test-{peek_max_keys}", **labels})

    # What reached the table: a and b inserted (a once, its first record superseded), b
    # updated in batch 1; c's delete found nothing to delete; a's batch-1 record is stale.
    assert value("upsert_sink_records_total", op="insert") == 2
    assert value("upsert_sink_records_total", op="update") == 1
    assert value("upsert_sink_records_total", op="delete") == 0
    assert value("upsert_sink_records_total", op="delete_missing") == 1
    assert value("upsert_sink_records_total", op="superseded") == 1
    assert value("upsert_sink_records_total", op="stale") == 1
    assert value("upsert_sink_records_total", op="quarantined") == 1
    # Distinct keys looked up: a, b, c miss in batch 0; a, b hit in batch 1. Each shard holds
    # (or reads) the partitions its keys name; batch 1 names only partitions batch 0 did.
    named = [{(shard_of(k.encode(), 2), d) for k, d in batch}
             for batch in ([("a", "1"), ("b", "2"), ("c", "2")], [("a", "1"), ("b", "2")])]
    assert value("upsert_sink_index_lookups_total", result="miss", tier="rocksdb") == 0
    if peek_max_keys == 0:
        # Loaded, the partitions (empty) answer batch 0 from their key filters, and batch 1 from
        # the memory tier, into which the catch-up of batch 0's commit promoted its keys.
        expected = {("miss", "filter"): 3, ("hit", "memory"): 2, ("hit", "rocksdb"): 0, ("miss", "table"): 0,
                    ("hit", "table"): 0}
        peeks, loads = 0, len(named[0])
    else:
        # A few keys each, the partitions are read for them in batch 0; named again in batch 1,
        # they load, and RocksDB answers.
        expected = {("miss", "filter"): 0, ("hit", "memory"): 0, ("hit", "rocksdb"): 2, ("miss", "table"): 3,
                    ("hit", "table"): 0}
        peeks, loads = len(named[0]), len(named[1])
    for (result, tier), n in expected.items():
        assert value("upsert_sink_index_lookups_total", result=result, tier=tier) == n, (result, tier)
    assert value("upsert_sink_index_partition_peeks_total") == peeks
    assert value("upsert_sink_index_partition_loads_total", reason="on_demand") == loads
    assert value("upsert_sink_commits_total", mode="append") == 1
    assert value("upsert_sink_commits_total", mode="rewrite") == 1
    assert value("upsert_sink_table_version") == DeltaTable(cfg.table_uri).version()


# Driver tagging writes the tombstones of deletes that name their partition beside the tagging.
@pytest.mark.parametrize("tag_on, tagged_in", [("executors", {"tag", "tombstones"}), ("driver", {"collect", "tag"})])
def test_the_batch_log_line_says_where_the_time_went(spark, tmp_path, tag_on, tagged_in):
    sink = UpsertSink(config(tmp_path, writer_id=f"phases-{tag_on}", tag_on=tag_on))
    sink(frame(spark, [Event("a", "2025-01-01", 1, "u", "1")]), 0)
    sink(frame(spark, [Event("a", "2025-01-01", 2, "d", "2"), Event("b", "2025-01-01", 2, "u", "2")]), 1)
    report = sink.reports[-1]
    ran = {phase for phase, seconds in report.phases.items() if seconds > 0}
    assert {"checks", "prepare", "split", "commit", "metrics"} | tagged_in <= ran
    assert ("collect" in ran) == ("tombstones" not in ran) == (tag_on == "driver")
    tombstones = DeltaTable(sink.config.resolved_tombstone_uri).to_pyarrow_table().to_pylist()
    assert [(r["id"], r["_tombstone_batch_id"]) for r in tombstones] == [("a", 1)]
    assert ("changelog" in ran) == (tag_on == "executors")  # replicas that never move need none
    # The phases account for the batch: what is not in one is bookkeeping between them.
    untimed = report.total_seconds - (sum(report.phases.values()) - report.phases["metrics"])
    assert 0 <= untimed < 0.1 * report.total_seconds
    assert f"commit:{report.phases['commit']:.3f}" in report.summary()
    # The tagging tasks' steps account for their time, and the work every batch does is in them.
    assert sum(report.tag_steps.values()) == pytest.approx(report.shard_seconds, rel=1e-9)
    assert all(report.tag_steps[step] > 0 for step in ("open", "catch_up", "inputs", "lookup", "classify", "stage",
                                                       "upkeep", "close", "output"))
    assert report.tag_steps["place"] == 0  # no delete without a partition
    slowest = max(report.tag_steps, key=report.tag_steps.get)
    assert f"{slowest}:{report.tag_steps[slowest]:.3f}" in report.summary()


def test_tombstones_keep_one_row_per_key_and_batch(spark, tmp_path):
    cfg = config(tmp_path, writer_id="tombstone-rows")
    events = [Event("a", "2025-01-01", 1, "u", "1"), Event("a", "2025-01-01", 2, "d", None),
              Event("a", "2025-01-01", 4, "d", None), Event("a", "2025-01-01", 3, "d", None),
              Event("b", "2025-01-01", 1, "d", None), Event("b", "2025-01-01", 1, "d", None),
              Event("a", "2025-01-02", 5, "d", None)]
    sink = UpsertSink(cfg)
    sink(frame(spark, events), 0)
    sink(frame(spark, [Event("b", "2025-01-01", 2, "d", None)]), 1)
    tombstones = DeltaTable(cfg.resolved_tombstone_uri).to_pyarrow_table().to_pylist()
    assert sorted((r["id"], r["dt"], r["ts"], r["_tombstone_batch_id"]) for r in tombstones) == [
        ("a", "2025-01-01", 4, 0), ("a", "2025-01-02", 5, 0), ("b", "2025-01-01", 1, 0), ("b", "2025-01-01", 2, 1)]
    assert table_rows(cfg.table_uri) == expected_rows([events, [Event("b", "2025-01-01", 2, "d", None)]])


def expected_outcomes(records, stored):
    """Independent count: per key of one batch, records older than the stored entry are
    stale, the newest of the rest (later arrival on a tie) reaches the table, the others are
    superseded; an update that holds exactly the stored row's values is unchanged. `stored`:
    (ordering, deleted, stored values) or None."""
    counts = dict.fromkeys(["insert", "update", "delete", "delete_missing", "unchanged", "stale", "superseded"], 0)
    applied = [(e.ts, pos, e) for pos, e in enumerate(records) if stored is None or e.ts >= stored[0]]
    counts["stale"] = len(records) - len(applied)
    if applied:
        winner = max(applied)[2]
        live = stored is not None and not stored[1]
        if winner.op == "d":
            counts["delete" if live else "delete_missing"] += 1
        elif live and (winner.ts, (winner.op, winner.v)) == (stored[0], stored[2]):
            counts["unchanged"] += 1
        else:
            counts["update" if live else "insert"] += 1
        counts["superseded"] = len(applied) - 1
        stored = (winner.ts, winner.op == "d", (winner.op, winner.v))
    return counts, stored


def test_many_records_of_one_key_count_one_write_and_leave_at_most_one_tombstone(spark, tmp_path):
    import random

    rng = random.Random(7)
    sink = UpsertSink(config(tmp_path, writer_id="one-key"))
    stored, batches = None, []
    for b, n in enumerate([2000, 1500, 1000]):
        events = [Event("a", "2025-01-01", rng.randrange(1 + 40 * b, 60 + 40 * b), rng.choice("uud"), str(i))
                  for i in range(n)]
        batches.append(events)
        sink(frame(spark, events), b)
        expected, stored = expected_outcomes(events, stored)
        report = sink.reports[-1]
        assert {k: v for k, v in report.ops.items() if k != "quarantined"} == expected, f"batch {b}"
        assert table_rows(sink.config.table_uri) == expected_rows(batches)
    tombstones = DeltaTable(sink.config.resolved_tombstone_uri).to_pyarrow_table().to_pylist()
    per_batch = [sum(r["_tombstone_batch_id"] == b for r in tombstones) for b in range(3)]
    assert per_batch == [int(any(e.op == "d" for e in events)) for events in batches]


def test_close_lets_go_of_the_replicas_driver_tagging_keeps_open(spark, tmp_path):
    from sink.index.registry import kept_open_paths

    sink = UpsertSink(config(tmp_path, writer_id="closing", tag_on="driver", num_shards=2))
    other = UpsertSink(config(tmp_path / "other", writer_id="other", tag_on="driver", num_shards=1))
    sink(frame(spark, [Event("a", "2025-01-01", 1, "u", "1"), Event("b", "2025-01-01", 1, "u", "1")]), 0)
    other(frame(spark, [Event("a", "2025-01-01", 1, "u", "1")]), 0)
    index = tmp_path / "index"

    def held(root):
        return sorted(p for p in kept_open_paths() if p.startswith(str(root)))

    assert len(held(index)) == 2 and len(held(tmp_path / "other")) == 1
    sink.close()
    assert held(index) == [] and len(held(tmp_path / "other")) == 1  # only its own
    sink(frame(spark, [Event("a", "2025-01-01", 2, "u", "2")]), 1)  # reopens them
    assert sink.reports[-1].ops["update"] == 1 and sink.reports[-1].replicas_rebuilt == 0
    other.close()
    sink.close()
