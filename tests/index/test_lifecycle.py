import datetime as dt
import multiprocessing
import os
import signal

import pyarrow as pa
import pytest
from deltalake import CommitProperties, DeltaTable, Transaction, write_deltalake

from sink import keys
from sink.delta_log.reading import read_commit
from sink.errors import PartitionLoadError
from sink.index.catchup import catch_up
from sink.index.entry import Entry
from sink.index.lifecycle import ShardSource, bootstrap, evict, load_partitions
from sink.index.loader import OTHER_WRITERS, TOMBSTONE_BATCH, TOMBSTONE_WRITER
from sink.index.replica import ShardReplica

NOW = dt.datetime(2025, 3, 1, 12, tzinfo=dt.UTC)
KEYS_PER_PARTITION = 40


def daily_table(uri, days=60, partition_col="dt", tiering=False):
    """`days` daily partitions ending at NOW, KEYS_PER_PARTITION keys each."""
    ids, parts, times = [], [], []
    for d in range(days):
        day = NOW - dt.timedelta(days=d)
        for k in range(KEYS_PER_PARTITION):
            ids.append(f"k{d}-{k}")
            parts.append(day.date().isoformat() if not tiering else f"region-{d}")
            times.append(day - dt.timedelta(minutes=k))
    data = pa.table({"id": ids, partition_col: parts,
                     "event_time": pa.array(times, pa.timestamp("us", tz="UTC"))})
    write_deltalake(uri, data, partition_by=[partition_col])
    return data


def source(uri, shard=0, num_shards=2, tombstones=None):
    return ShardSource(DeltaTable(uri), tombstones, ("id",), "event_time", shard, num_shards)


def shard_keys(data, pid_col, pid_value, shard, num_shards=2):
    rows = [r for r in data.to_pylist() if r[pid_col] == pid_value]
    return {r["id"].encode() for r in rows if keys.shard_of(r["id"].encode(), num_shards) == shard}


def test_bootstrap_loads_exactly_the_seven_newest_partitions_and_only_this_shards_keys(tmp_path):
    data = daily_table(str(tmp_path / "t"))
    with ShardReplica.open(tmp_path / "r", "spec") as replica:
        report = bootstrap(replica, source(str(tmp_path / "t")), ["dt"], (None, "%Y-%m-%d"), None, 7,
                           NOW.timestamp())
        newest = {f"dt={(NOW.date() - dt.timedelta(days=d)).isoformat()}" for d in range(7)}
        assert set(replica.partitions()) == newest
        assert report.partitions == 7
        assert {p.reason for p in replica.partitions().values()} == {"bootstrap"}
        day0 = NOW.date().isoformat()
        mine = shard_keys(data, "dt", day0, shard=0)
        others = shard_keys(data, "dt", day0, shard=1)
        assert mine and others
        assert all(e is not None for e in replica.lookup(f"dt={day0}", sorted(mine)))
        assert all(e is None for e in replica.lookup(f"dt={day0}", sorted(others)))
        assert report.keys == sum(len(shard_keys(data, "dt", p[3:], 0)) for p in newest)


def test_an_old_partition_loads_on_demand_alone(tmp_path):
    daily_table(str(tmp_path / "t"))
    old = f"dt={(NOW.date() - dt.timedelta(days=40)).isoformat()}"
    with ShardReplica.open(tmp_path / "r", "spec") as replica:
        report = load_partitions(replica, source(str(tmp_path / "t")), [old], "on_demand")
        assert list(replica.partitions()) == [old] and report.partitions == 1


def test_year_month_day_partitions_are_dated(tmp_path):
    uri = str(tmp_path / "t")
    days = [NOW - dt.timedelta(days=d) for d in range(10)]
    write_deltalake(uri, pa.table({
        "id": [f"k{i}" for i in range(10)], "year": [d.year for d in days], "month": [d.month for d in days],
        "day": [d.day for d in days], "event_time": pa.array(days, pa.timestamp("us", tz="UTC")),
    }), partition_by=["year", "month", "day"])
    with ShardReplica.open(tmp_path / "r", "spec") as replica:
        bootstrap(replica, source(uri, num_shards=1), ["year", "month", "day"], (None, "%Y-%m-%d"), None, 3,
                  NOW.timestamp())
        assert sorted(replica.partitions()) == sorted(
            f"year={d.year}/month={d.month}/day={d.day}" for d in days[:3])


def test_partitions_without_dates_use_the_tiering_column_or_load_nothing(tmp_path):
    daily_table(str(tmp_path / "t"), partition_col="region", tiering=True)
    src = source(str(tmp_path / "t"))
    with ShardReplica.open(tmp_path / "r1", "spec") as replica:
        bootstrap(replica, src, ["region"], (None, "%Y-%m-%d"), "event_time", 7, NOW.timestamp())
        # region-d holds events from NOW - d days; the window is (NOW - 7 days, NOW].
        assert sorted(replica.partitions()) == sorted(f"region=region-{d}" for d in range(7))
    with ShardReplica.open(tmp_path / "r2", "spec") as replica:
        report = bootstrap(replica, src, ["region"], (None, "%Y-%m-%d"), None, 7, NOW.timestamp())
        assert replica.partitions() == {} and report.partitions == 0


def test_bootstrap_warns_when_no_partition_value_parses_under_the_date_format(tmp_path, caplog):
    months = pa.table({"id": ["a", "b", "c"], "month": ["2025-01", "2025-02", "2025-03"],
                       "event_time": pa.array([NOW] * 3, pa.timestamp("us", tz="UTC"))})
    write_deltalake(str(tmp_path / "t"), months, partition_by=["month"])
    src = source(str(tmp_path / "t"), num_shards=1)
    with ShardReplica.open(tmp_path / "r1", "spec") as replica, caplog.at_level("WARNING", logger="sink.index"):
        assert bootstrap(replica, src, ["month"], (None, "%Y-%m-%d"), None, 90, NOW.timestamp()).partitions == 0
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1 and "partition_date_format '%Y-%m-%d' on month (e.g. month=2025-01)" in warned[0]
    caplog.clear()
    with ShardReplica.open(tmp_path / "r2", "spec") as replica, caplog.at_level("WARNING", logger="sink.index"):
        assert bootstrap(replica, src, ["month"], (None, "%Y-%m"), None, 90, NOW.timestamp()).partitions == 3
    assert caplog.records == []


def test_ttl_eviction_with_an_injected_clock(tmp_path):
    hour = 3600.0
    with ShardReplica.open(tmp_path / "r", "spec") as replica:
        for pid in ("a", "b", "c", "d"):
            replica.load_partition(pid, [b"k"], [Entry(1)], reason="on_demand", now=0.0)
        replica.touch(["b"], now=12 * hour)
        replica.touch(["d"], now=30 * hour)
        evicted = evict(replica, now=35 * hour, ttl_hours=24, max_bytes=None, keep={"c"})
        assert sorted(evicted) == ["a"]  # b and d were used in the last day, c is needed now
        assert sorted(replica.partitions()) == ["b", "c", "d"]
        assert evict(replica, now=100 * hour, ttl_hours=24, max_bytes=None, keep={"c"}) == ["b", "d"]


def test_byte_budget_drops_least_recently_used_first(tmp_path):
    with ShardReplica.open(tmp_path / "r", "spec") as replica:
        for i, pid in enumerate(("old", "mid", "new")):
            keys_ = [f"{pid}{n:05d}".encode() for n in range(30_000)]
            replica.load_partition(pid, keys_, [Entry(n) for n in range(30_000)], reason="on_demand",
                                   now=float(i))
        sizes = replica.keyspaces.partition_sizes()
        budget = sizes["new"][1] + sizes["mid"][1]
        assert evict(replica, now=3.0, ttl_hours=24, max_bytes=budget, keep=set()) == ["old"]
        assert evict(replica, now=3.0, ttl_hours=24, max_bytes=1, keep={"mid"}) == ["new"]
        assert list(replica.partitions()) == ["mid"]


def test_a_partition_that_will_not_load_fails_with_its_name(tmp_path):
    uri = str(tmp_path / "t")
    daily_table(uri, days=2)
    day = NOW.date().isoformat()
    for f in DeltaTable(uri).file_uris(file_pruning_predicate=[("dt", "=", day)]):
        os.remove(f)
    with ShardReplica.open(tmp_path / "r", "spec") as replica:
        with pytest.raises(PartitionLoadError, match=f"loading partition dt={day} .* failed 3 times"):
            load_partitions(replica, source(uri), [f"dt={day}"], "on_demand")
        assert replica.partitions() == {}


class _DiesHalfway(list):
    """Entries that kill their process when the load is half done."""

    def _check(self, i):
        if i == len(self) // 2:
            os.kill(os.getpid(), signal.SIGKILL)

    def __getitem__(self, i):
        self._check(i)
        return super().__getitem__(i)

    def __iter__(self):
        for i in range(len(self)):
            self._check(i)
            yield super().__getitem__(i)


def _load_then_die(path, n):
    with ShardReplica.open(path, "spec") as replica:
        replica.set_version(3)
        replica.load_partition("complete", [b"a"], [Entry(1)], reason="on_demand")
    replica = ShardReplica.open(path, "spec")
    keys_ = [f"k{i:06d}".encode() for i in range(n)]
    replica.load_partition("half", keys_, _DiesHalfway(Entry(i) for i in range(n)), reason="on_demand")


@pytest.mark.parametrize("n", [1_000, 30_000])  # write batch and SST ingest paths
def test_a_process_killed_mid_load_leaves_no_partial_partition(tmp_path, n):
    ctx = multiprocessing.get_context("spawn")
    child = ctx.Process(target=_load_then_die, args=(tmp_path / "r", n))
    child.start()
    child.join(120)
    assert child.exitcode == -signal.SIGKILL
    with ShardReplica.open(tmp_path / "r", "spec") as replica:
        assert "half" not in replica.partitions()
        assert not replica.has_partition("half")


def test_a_truncated_log_forces_a_rebuild(tmp_path):
    uri = str(tmp_path / "t")
    row = pa.table({"id": ["a"], "dt": ["d1"], "event_time": pa.array([NOW], pa.timestamp("us", tz="UTC"))})
    write_deltalake(uri, row, partition_by=["dt"])
    with ShardReplica.open(tmp_path / "r", "spec") as replica:
        catch_up(replica, 0, lambda v: read_commit(uri, v, ["dt"]), "w", 0)
        replica.load_partition("dt=d1", [b"a"], [Entry(1)], reason="on_demand")
        for _ in range(3):
            write_deltalake(uri, row, mode="append")
        table = DeltaTable(uri)
        table.create_checkpoint()
        os.remove(f"{uri}/_delta_log/{1:020d}.json")  # log cleanup after the checkpoint
        report = catch_up(replica, table.version(), lambda v: read_commit(uri, v, ["dt"]), "w", 0)
        assert report.rebuilt == "log entry 1 is gone"
        assert replica.partitions() == {} and replica.version == 3


def test_delete_learned_by_a_partition_reload_carries_the_delete_records_ordering(tmp_path):
    """The table no longer holds a deleted key: the tombstone table's delete record dates it."""
    uri, tomb_uri = str(tmp_path / "t"), str(tmp_path / "tombstones")
    at = [NOW - dt.timedelta(minutes=m) for m in (30, 20, 10)]
    day = NOW.date().isoformat()
    write_deltalake(uri, pa.table({"id": ["live", "back"], "dt": [day, day],
                                   "event_time": pa.array([at[2], at[2]], pa.timestamp("us", tz="UTC"))}),
                    partition_by=["dt"])
    # "gone" was deleted at at[1]; "back" was deleted at at[0], then re-inserted at at[2].
    write_deltalake(tomb_uri, pa.table({"id": ["gone", "back"], "dt": [day, day],
                                        "event_time": pa.array([at[1], at[0]], pa.timestamp("us", tz="UTC"))}),
                    partition_by=["dt"])
    micros = [int(t.timestamp() * 1_000_000) for t in at]
    with ShardReplica.open(tmp_path / "r", "spec") as replica:
        load_partitions(replica, source(uri, shard=0, num_shards=1, tombstones=DeltaTable(tomb_uri)),
                        [f"dt={day}"], "on_demand")
        assert replica.lookup(f"dt={day}", [b"gone", b"back", b"live"]) == [
            Entry(micros[1], True), Entry(micros[2], False), Entry(micros[2], False)]


def test_a_reload_counts_a_tombstone_only_once_the_table_holds_its_batch(tmp_path):
    """Tombstones are written before their batch's commit: a batch that has not landed (or
    never will) deletes nothing yet. Another writer's delete counts from its commit's version."""
    uri, tomb_uri = str(tmp_path / "t"), str(tmp_path / "tombstones")
    day = NOW.date().isoformat()
    row = pa.table({"id": ["z"], "dt": [day], "event_time": pa.array([NOW], pa.timestamp("us", tz="UTC"))})
    write_deltalake(uri, row, partition_by=["dt"],
                    commit_properties=CommitProperties(app_transactions=[Transaction("w", 2)]))
    later = pa.array([NOW] * 5, pa.timestamp("us", tz="UTC"))
    write_deltalake(tomb_uri, pa.table({
        "id": ["a", "b", "c", "d", "e"], "dt": [day] * 5, "event_time": later,
        TOMBSTONE_WRITER: ["w", "w", "other", OTHER_WRITERS, OTHER_WRITERS],
        TOMBSTONE_BATCH: pa.array([2, 3, 0, 0, 1], pa.int64())}), partition_by=["dt"])
    with ShardReplica.open(tmp_path / "r", "spec") as replica:
        load_partitions(replica, source(uri, shard=0, num_shards=1, tombstones=DeltaTable(tomb_uri)),
                        [f"dt={day}"], "on_demand")
        found = replica.lookup(f"dt={day}", [b"a", b"b", b"c", b"d", b"e"])
    # a: batch 2 of w is in the table; b: batch 3 is not yet; c: writer "other" never committed;
    # d: another writer's delete at version 0, which the table (at 0) holds; e: at version 1, not yet.
    assert [e is not None and e.deleted for e in found] == [True, False, False, True, False]


def test_a_row_of_the_table_stands_over_any_tombstone(tmp_path):
    """A RESTORE or another writer can bring back a row older than a delete the sink
    remembers: the index follows the table, so a newer delete of that key still applies."""
    uri, tomb_uri = str(tmp_path / "t"), str(tmp_path / "tombstones")
    day = NOW.date().isoformat()
    old = pa.array([NOW - dt.timedelta(minutes=30)], pa.timestamp("us", tz="UTC"))
    write_deltalake(uri, pa.table({"id": ["a"], "dt": [day], "event_time": old}), partition_by=["dt"],
                    commit_properties=CommitProperties(app_transactions=[Transaction("w", 2)]))
    write_deltalake(tomb_uri, pa.table({
        "id": ["a"], "dt": [day], "event_time": pa.array([NOW], pa.timestamp("us", tz="UTC")),
        TOMBSTONE_WRITER: ["w"], TOMBSTONE_BATCH: pa.array([1], pa.int64())}), partition_by=["dt"])
    with ShardReplica.open(tmp_path / "r", "spec") as replica:
        load_partitions(replica, source(uri, shard=0, num_shards=1, tombstones=DeltaTable(tomb_uri)),
                        [f"dt={day}"], "on_demand")
        [found] = replica.lookup(f"dt={day}", [b"a"])
    assert not found.deleted
