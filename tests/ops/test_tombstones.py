import time

import pyarrow as pa
import pytest
from deltalake import DeltaTable, write_deltalake

from sink import SinkConfig, UpsertSink
from sink import columns as C
from sink.batch.driver_tagger import deletes_before_tagging
from sink.cli import main
from sink.errors import ConfigError
from sink.index.loader import TOMBSTONE_BATCH, TOMBSTONE_DELETED_AT, TOMBSTONE_WRITER
from sink.ops import tombstones
from sink.ops.tombstones import compact, latest_per_key

SCHEMA = "id INT, v STRING, seq INT, op STRING"
HOUR = 3600
# Deletes in these tests happen about two hours before the real clock: the CLI compacts at time.time().
T0 = time.time() - 2 * HOUR


class Clock:
    def __init__(self, t: float):
        self.t = t

    def __call__(self) -> float:
        return self.t


def config(tmp_path, index="index", **extra):
    options = {"tombstone_ttl_hours": 1, **extra}
    return SinkConfig(table_uri=str(tmp_path / "t"), key=["id"], ordering="seq", delete_when="op = 'd'",
                      except_columns=["op"], writer_id="w", index_dir=str(tmp_path / index), num_shards=2,
                      metrics_port=0, **options)


def rows_of(uri):
    return sorted((r["id"], r["v"], r["seq"]) for r in DeltaTable(uri).to_pyarrow_table().to_pylist())


def write(spark, sink, batch_id, records):
    sink(spark.createDataFrame(records, SCHEMA), batch_id)
    return sink.reports[-1]


@pytest.mark.parametrize("scope", ["partitioned", "global"])
@pytest.mark.parametrize("fresh_replica", [False, True], ids=["held-replica", "fresh-replica"])
def test_a_late_update_after_the_tombstone_ttl_writes_the_key_again(spark, tmp_path, scope, fresh_replica):
    clock = Clock(T0)
    sink = UpsertSink(config(tmp_path, scope=scope), clock=clock)
    write(spark, sink, 0, [(1, "a", 1, "u"), (2, "b", 1, "u"), (3, "c", 1, "u")])
    write(spark, sink, 1, [(1, None, 5, "d"), (2, None, 5, "d")])
    clock.t = T0 + 0.5 * HOUR
    report = write(spark, sink, 2, [(1, "late", 3, "u")])
    assert report.ops["stale"] == 1 and rows_of(sink.config.table_uri) == [(3, "c", 1)]
    clock.t = T0 + 1.9 * HOUR
    write(spark, sink, 3, [(3, None, 5, "d")])
    clock.t = T0 + 2 * HOUR
    if fresh_replica:  # loads from the table and the tombstone table: the same answer as the held entries
        sink = UpsertSink(config(tmp_path, index="other-index", scope=scope), clock=clock)
    report = write(spark, sink, 4, [(1, "late", 3, "u"), (2, "late", 4, "u"), (3, "late", 3, "u")])
    # Keys 1 and 2 were deleted two hours ago (TTL 1 h): their late updates come back; key 3's delete holds.
    assert (report.ops["insert"], report.ops["stale"]) == (2, 1)
    assert rows_of(sink.config.table_uri) == [(1, "late", 3), (2, "late", 4)]


def test_without_a_ttl_a_delete_holds_forever(spark, tmp_path):
    clock = Clock(T0)
    sink = UpsertSink(config(tmp_path, tombstone_ttl_hours=None), clock=clock)
    write(spark, sink, 0, [(1, "a", 1, "u")])
    write(spark, sink, 1, [(1, None, 5, "d")])
    clock.t = T0 + 10_000 * HOUR
    assert write(spark, sink, 2, [(1, "late", 3, "u")]).ops["stale"] == 1
    assert rows_of(sink.config.table_uri) == []


def tombstone_rows(cfg):
    table = DeltaTable(cfg.resolved_tombstone_uri).to_pyarrow_table()
    return sorted((r["id"], r["seq"], r[TOMBSTONE_BATCH]) for r in table.to_pylist())


def test_compaction_keeps_the_newest_unexpired_row_per_key_and_rows_of_uncommitted_batches(spark, tmp_path, capsys):
    # Two hours before the CLI's clock at this test's start: the module's T0 was taken when the
    # suite was collected, tens of minutes earlier.
    T0 = time.time() - 2 * HOUR  # noqa: N806
    clock = Clock(T0)
    cfg = config(tmp_path)
    sink = UpsertSink(cfg, clock=clock)
    write(spark, sink, 0, [(1, "a", 1, "u"), (2, "b", 1, "u"), (3, "c", 1, "u")])
    write(spark, sink, 1, [(1, None, 5, "d")])  # expired two hours later
    clock.t = T0 + 1.5 * HOUR
    write(spark, sink, 2, [(2, None, 5, "d")])  # superseded by batch 3's
    clock.t = T0 + 1.6 * HOUR
    write(spark, sink, 3, [(2, None, 6, "d")])
    # A batch that wrote its tombstones and crashed before its commit: kept whatever its age.
    write_deltalake(cfg.resolved_tombstone_uri, pa.table({
        "id": pa.array([3], pa.int32()), "seq": pa.array([7], pa.int32()), TOMBSTONE_WRITER: ["w"],
        TOMBSTONE_BATCH: [4], TOMBSTONE_DELETED_AT: pa.array([int(T0) * 10**6], pa.timestamp("us", tz="UTC"))}),
        mode="append")
    assert tombstone_rows(cfg) == [(1, 5, 1), (2, 5, 2), (2, 6, 3), (3, 7, 4)]

    conf = tmp_path / "sink.toml"
    conf.write_text('[sink]\ntable_uri = "t"\nkey = ["id"]\nordering = "seq"\ndelete_when = "op = \'d\'"\n'
                    'writer_id = "w"\nindex_dir = "index"\nnum_shards = 2\ntombstone_ttl_hours = 1\n')
    assert main(["compact-tombstones", "--config", str(conf)]) == 0
    assert "4 rows -> 2 (1 superseded by a newer delete of their key, 1 expired under tombstone_ttl_hours = 1; " \
           "1 of batches not committed yet kept)" in capsys.readouterr().out
    assert tombstone_rows(cfg) == [(2, 6, 3), (3, 7, 4)]
    # The app transactions survive the rewrite: a replayed batch does not append its tombstones again.
    assert DeltaTable(cfg.resolved_tombstone_uri).transaction_version("w") == 3
    assert compact(cfg, time.time()).version is None  # nothing left to drop

    # A replica loaded after the compaction answers as one that held the entries.
    clock.t = T0 + 2 * HOUR
    fresh = UpsertSink(config(tmp_path, index="other-index"), clock=clock)
    report = write(spark, fresh, 4, [(1, "late", 3, "u"), (2, "late", 4, "u")])
    assert (report.ops["insert"], report.ops["stale"]) == (1, 1)
    assert rows_of(cfg.table_uri) == [(1, "late", 3), (3, "c", 1)]


def test_compaction_without_a_ttl_only_drops_superseded_rows(spark, tmp_path):
    cfg = config(tmp_path, tombstone_ttl_hours=None)
    sink = UpsertSink(cfg, clock=Clock(T0))
    write(spark, sink, 0, [(1, None, 5, "d")])
    write(spark, sink, 1, [(1, None, 6, "d"), (2, None, 1, "d")])
    done = compact(cfg, time.time() + 10_000 * HOUR)
    assert (done.rows_before, done.rows_after, done.superseded, done.expired) == (3, 2, 1, 0)
    assert tombstone_rows(cfg) == [(1, 6, 1), (2, 1, 1)]


def test_compacting_a_table_without_tombstones_says_so(tmp_path, capsys):
    write_deltalake(str(tmp_path / "t"), pa.table({"id": pa.array([1], pa.int32()), "seq": pa.array([1], pa.int32())}))
    conf = tmp_path / "sink.toml"
    conf.write_text('[sink]\ntable_uri = "t"\nkey = ["id"]\nordering = "seq"\nwriter_id = "w"\n')
    assert main(["compact-tombstones", "--config", str(conf)]) == 0
    assert "no tombstone table at" in capsys.readouterr().out


def test_latest_per_key_keeps_the_highest_ordering_first_on_ties_in_input_order():
    rows = pa.table({"id": ["a", "b", "a", "a", "b"], "dt": ["x", "x", "x", "y", "x"], "ts": [1, 5, 3, 2, 5],
                     "n": [0, 1, 2, 3, 4]})
    assert latest_per_key(rows, ["id", "dt"], "ts").column("n").to_pylist() == [1, 2, 3]
    assert latest_per_key(rows, ["id"], "ts").column("n").to_pylist() == [1, 2]


def test_latest_per_key_keeps_the_highest_ordering_then_the_latest_delete_then_input_order():
    rows = pa.table({"id": [1, 1, 2, 1], "seq": [5, 7, 3, 7], TOMBSTONE_DELETED_AT: [10, 20, 10, 30],
                     "n": [0, 1, 2, 3]})
    assert latest_per_key(rows, ["id"], "seq").column("n").to_pylist() == [2, 3]
    assert latest_per_key(rows.drop_columns([TOMBSTONE_DELETED_AT]), ["id"], "seq").column("n").to_pylist() == [1, 2]


@pytest.mark.parametrize("hours", [0, 0.0001, -1, float("nan"), "1", True, 1_000_001])
def test_tombstone_ttl_must_be_at_least_one_second_of_hours(tmp_path, hours):
    with pytest.raises(ConfigError, match=r"tombstone_ttl_hours must be a number of hours from 1/3600 \(one second\) "
                                          rf"to 1000000, fractions allowed \(0.5 = 30 minutes\), got {hours!r}"):
        config(tmp_path, tombstone_ttl_hours=hours)


def test_a_fractional_ttl_counts_in_seconds(tmp_path):
    assert config(tmp_path, tombstone_ttl_hours=1 / 3600).tombstone_ttl_seconds == 1
    assert config(tmp_path, tombstone_ttl_hours=0.5).tombstone_ttl_seconds == 1800
    assert config(tmp_path, tombstone_ttl_hours=None).tombstone_ttl_seconds is None
    (tmp_path / "sink.toml").write_text('[sink]\ntable_uri = "t"\nkey = ["id"]\nordering = "seq"\nwriter_id = "w"\n'
                                        "tombstone_ttl_hours = 0.25\n")
    assert SinkConfig.from_file(tmp_path / "sink.toml").tombstone_ttl_seconds == 900


@pytest.mark.parametrize("scope", ["partitioned", "global"])
@pytest.mark.connect
def test_a_one_second_ttl_lets_a_late_update_back_two_seconds_after_its_delete(spark, tmp_path, scope):
    """The published ClickHouse cleanup example expires a delete after one second."""
    clock = Clock(T0)
    sink = UpsertSink(config(tmp_path, scope=scope, tombstone_ttl_hours=1 / 3600), clock=clock)
    write(spark, sink, 0, [(1, "a", 1, "u"), (2, "b", 1, "u")])
    write(spark, sink, 1, [(1, None, 5, "d"), (2, None, 5, "d")])
    clock.t = T0 + 0.5  # the delete's second: it still holds
    assert write(spark, sink, 2, [(1, "late", 3, "u")]).ops["stale"] == 1
    clock.t = T0 + 2  # two seconds on: it has expired
    assert write(spark, sink, 3, [(2, "late", 4, "u")]).ops["insert"] == 1
    assert rows_of(sink.config.table_uri) == [(2, "late", 4)]


def test_a_batch_appending_during_a_compaction_keeps_its_rows(spark, tmp_path, monkeypatch):
    cfg = config(tmp_path, tombstone_ttl_hours=None)
    sink = UpsertSink(cfg, clock=Clock(T0))
    write(spark, sink, 0, [(1, None, 5, "d")])
    write(spark, sink, 1, [(1, None, 6, "d")])
    read = tombstones.committed

    def append_meanwhile(table, rows):
        write(spark, sink, 2, [(2, None, 1, "d")])  # lands after compaction read the tombstone table
        return read(table, rows)

    monkeypatch.setattr(tombstones, "committed", append_meanwhile)
    assert compact(cfg, time.time()).rows_after == 1
    assert tombstone_rows(cfg) == [(1, 6, 1), (2, 1, 2)]


def test_a_ttl_set_at_a_restart_expires_deletes_written_without_one(spark, tmp_path):
    clock = Clock(T0)
    sink = UpsertSink(config(tmp_path, tombstone_ttl_hours=None), clock=clock)
    write(spark, sink, 0, [(1, "a", 1, "u"), (2, "b", 1, "u")])
    write(spark, sink, 1, [(1, None, 5, "d")])
    clock.t = T0 + 1.5 * HOUR
    write(spark, sink, 2, [(2, None, 5, "d")])
    sink.close()
    clock.t = T0 + 2 * HOUR
    restarted = UpsertSink(config(tmp_path, tombstone_ttl_hours=1), clock=clock)  # same replicas, now a TTL
    report = write(spark, restarted, 3, [(1, "late", 3, "u"), (2, "late", 3, "u")])
    assert (report.ops["insert"], report.ops["stale"]) == (1, 1)
    assert rows_of(restarted.config.table_uri) == [(1, "late", 3)]


def collected(dts: list[str | None], deletes: list[bool], reasons: list[str | None]) -> pa.Table:
    return pa.table({"id": list(range(len(dts))), "dt": pa.array(dts, pa.string()), "seq": [1] * len(dts),
                     C.REASON: pa.array(reasons, pa.string()), C.DELETE: deletes})


@pytest.mark.parametrize("scope", ["partitioned", "global"])
def test_the_deletes_known_before_tagging_are_the_valid_ones(tmp_path, scope):
    cfg = config(tmp_path, partition_by=["dt"], scope=scope)
    records = collected(["d1", "d1", "d2", None], [True, False, True, True], [None, None, "bad", "bad"])
    assert deletes_before_tagging(records, cfg).column("id").to_pylist() == [0]  # a quarantined one is not


def test_a_delete_naming_no_partition_waits_for_the_index_in_partitioned_scope_only(tmp_path):
    records = collected(["d1", None, "d2"], [True, True, False], [None, None, None])
    assert deletes_before_tagging(records, config(tmp_path, partition_by=["dt"])) is None  # placed while tagging
    known = deletes_before_tagging(records, config(tmp_path, partition_by=["dt"], scope="global"))
    assert known.column("id").to_pylist() == [0, 1]  # global scope: the key says where, the row stays as sent
