import shutil

import pytest
import rocksdict

from sink.errors import ReplicaLockedError
from sink.index import registry
from sink.index import replica as replica_module
from sink.index.entry import Entry, pack_located_many
from sink.index.keyspace_filters import KEY_FILTER_FILE, KeyspaceFilters
from sink.index.registry import close_kept_open
from sink.index.replica import ShardReplica
from sink.index.spec import GLOBAL, replica_path, replica_spec
from tests import damage

SPEC = '{"key": ["id"]}'


@pytest.fixture
def path(tmp_path):
    return replica_path(tmp_path, "table-id", 0, 2)


def test_layout_is_table_then_shard(tmp_path):
    assert replica_path(tmp_path, "tid", 3, 8) == tmp_path / "tid" / "shard-3-of-8"


def test_a_loaded_partition_answers_lookups_and_survives_reopen(path):
    with ShardReplica.open(path, SPEC) as r:
        r.set_version(4)
        r.load_partition("dt=1", [b"a", b"b"], [Entry(1), Entry(2, True)], reason="on_demand", now=100.0)
        assert r.lookup("dt=1", [b"a", b"b", b"zz"]) == [Entry(1), Entry(2, True), None]
    with ShardReplica.open(path, SPEC) as r:
        assert r.version == 4
        info = r.partitions()["dt=1"]
        assert (info.loaded_entries, info.reason, info.loaded_at) == (2, "on_demand", 100.0)
        assert r.lookup("dt=1", [b"a"]) == [Entry(1)]


def test_reads_of_a_partition_not_held_count_within_their_window_survive_reopen_and_end_at_its_load(path):
    with ShardReplica.open(path, SPEC) as r:
        assert [r.meta.record_peek("dt=1", now, window_s=100) for now in (1000, 1050, 1100)] == [1, 2, 3]
        assert r.meta.record_peek("dt=2", 1100, window_s=100) == 1  # counted per partition
    with ShardReplica.open(path, SPEC) as r:
        assert r.meta.record_peek("dt=1", 1100, window_s=100) == 4
        assert r.meta.record_peek("dt=1", 1101, window_s=100) == 1  # past the window of the first: counted anew
        r.load_partition("dt=2", [b"a"], [Entry(1)], reason="on_demand")
        r.drop_partition("dt=2")
        assert r.meta.record_peek("dt=2", 1102, window_s=100) == 1  # its load forgot the reads before it
        assert not r.has_partition("dt=1")


def test_live_elsewhere_finds_live_rows_of_other_held_partitions_only(path):
    with ShardReplica.open(path, SPEC) as r:
        r.load_partition("dt=1", [b"a", b"b", b"c"], [Entry(1), Entry(1, True), Entry(1)], reason="on_demand")
        r.load_partition("dt=2", [b"c"], [Entry(2)], reason="on_demand")
        # a: live in dt=1; b: deleted there; c: in its own dt=2 and live in dt=1; d: nowhere.
        assert r.keyspaces.live_elsewhere([b"a", b"b", b"c", b"d"], ["dt=3", "dt=3", "dt=2", "dt=3"]) == {
            b"a": "dt=1", b"c": "dt=1"}
        assert r.lookups == {"memory": 0, "rocksdb": 0, "miss": 0, "filter": 0}  # not a lookup of the batch


def test_large_partitions_load_through_sst_ingest(path):
    keys = [f"k{i:06d}".encode() for i in range(30_000)][::-1]  # unsorted on purpose
    with ShardReplica.open(path, SPEC) as r:
        r.load_partition("p", keys, [Entry(i) for i in range(len(keys))], reason="on_demand")
        assert r.lookup("p", [keys[0], keys[-1]]) == [Entry(0), Entry(len(keys) - 1)]
    assert not list(path.glob("ingest-*.sst"))  # the staging file is moved in or removed


def test_staged_entries_are_invisible_until_promoted(path):
    with ShardReplica.open(path, SPEC) as r:
        r.load_partition("p", [b"a"], [Entry(1)], reason="on_demand")
        r.stage(7, {"p": {b"a": Entry(5), b"new": Entry(6)}, "not-held": {b"x": Entry(1)}})
        assert r.staged_batch == 7
        assert r.lookup("p", [b"a", b"new"]) == [Entry(1), None]
        assert r.promote_staged() == 2
        assert r.lookup("p", [b"a", b"new"]) == [Entry(5), Entry(6)]
        assert r.staged_batch is None
        assert not r.has_partition("not-held")  # never a half partition


def test_restaging_replaces_and_discard_forgets(path):
    with ShardReplica.open(path, SPEC) as r:
        r.load_partition("p", [], [], reason="on_demand")
        r.stage(7, {"p": {b"a": Entry(5)}})
        r.stage(7, {"p": {b"b": Entry(5)}})  # a re-run of the batch starts clean
        assert r.staging.staged() == {"p": {b"b": Entry(5)}}
        r.discard_staged()
        assert r.staging.staged() == {} and r.staged_batch is None
        r.promote_staged()
        assert r.lookup("p", [b"a", b"b"]) == [None, None]


def test_drop_partition_and_drop_all(path):
    with ShardReplica.open(path, SPEC) as r:
        r.load_partition("p1", [b"a"], [Entry(1)], reason="on_demand")
        r.load_partition("p2", [b"a"], [Entry(1)], reason="on_demand")
        r.drop_partition("p1")
        assert set(r.partitions()) == {"p2"}
        r.stage(1, {"p2": {b"z": Entry(1)}})
        r.drop_all()
        assert r.partitions() == {} and r.staged_batch is None


def test_another_key_spec_wipes_the_replica(path):
    with ShardReplica.open(path, SPEC) as r:
        r.set_version(3)
        r.load_partition("p", [b"a"], [Entry(1)], reason="on_demand")
    with ShardReplica.open(path, '{"key": ["other"]}') as r:
        assert r.version is None and r.partitions() == {}


def test_a_replica_left_open_by_a_dead_process_is_wiped(path):
    r = ShardReplica.open(path, SPEC)
    r.set_version(3)
    r.load_partition("p", [b"a"], [Entry(1)], reason="on_demand")
    r._close_db()  # what a killed process leaves: no clean close, dirty flag still set
    with ShardReplica.open(path, SPEC) as again:
        assert again.version is None and again.partitions() == {}


def test_a_replica_killed_while_it_created_a_column_family_is_wiped_on_open_and_says_why(path):
    with ShardReplica.open(path, SPEC) as r:
        options = {f.name: f.read_bytes() for f in path.glob("OPTIONS-*")}
    r = ShardReplica.open(path, SPEC)
    r.load_partition("p", [b"a"], [Entry(1)], reason="on_demand")
    r._close_db()
    for f in path.glob("OPTIONS-*"):  # killed after the MANIFEST named the family, before the OPTIONS file did
        f.unlink()
    for name, data in options.items():
        (path / name).write_bytes(data)
    with ShardReplica.open(path, SPEC) as again:
        assert again.repaired.startswith("Invalid argument: Column families not opened: p:p")
        assert (again.version, again.partitions()) == (None, {})


def test_touch_updates_last_access(path):
    with ShardReplica.open(path, SPEC) as r:
        r.load_partition("p", [], [], reason="on_demand", now=1.0)
        r.touch(["p", "absent"], now=50.0)
        assert r.partitions()["p"].last_access == 50.0


def test_acquire_keeps_a_replica_open_until_its_directory_goes(path):

    first = registry.acquire(path, SPEC)
    first.load_partition("p", [b"a"], [Entry(1)], reason="on_demand")
    assert registry.acquire(path, SPEC) is first
    first.flush()
    with ShardReplica.open_read_only(path) as reader:  # what python -m sink verify sees beside it
        assert reader.lookup("p", [b"a"]) == [Entry(1)]

    shutil.rmtree(path)
    again = registry.acquire(path, SPEC)
    assert again is not first and again.partitions() == {}
    again.load_partition("q", [b"b"], [Entry(2)], reason="on_demand")
    close_kept_open()
    with ShardReplica.open(path, SPEC) as reopened:  # closed clean: nothing is wiped
        assert reopened.lookup("q", [b"b"]) == [Entry(2)]


def test_an_open_whose_directory_was_replaced_writes_nothing_into_the_new_replica(path):
    """A worker holds a replica with unflushed writes; its directory is removed and another
    open makes a new replica there before the worker lets go. The worker's close flushes its
    memtables: into the directory it opened, never into the new replica (it used to write its
    table files and a CURRENT naming its MANIFEST there, and the new replica then listed its
    column families)."""
    old = ShardReplica.open(path, SPEC)
    old.load_partition("p", [b"a"], [Entry(1)], reason="on_demand")
    old.put_entries("p", {b"b": Entry(2)})  # in the memtable only (the WAL is off)
    shutil.rmtree(path)
    with ShardReplica.open(path, SPEC) as new:
        assert new.partitions() == {}
        new.load_partition("q", [b"c"], [Entry(3)], reason="on_demand")
    files = sorted(p.name for p in path.iterdir())
    assert old.replaced()
    old.abandon()  # what the worker does on finding it replaced
    assert sorted(p.name for p in path.iterdir()) == files
    with ShardReplica.open(path, SPEC) as reopened:  # closed clean: nothing is wiped
        assert reopened.repaired is None
        assert list(reopened.partitions()) == ["q"] and reopened.lookup("q", [b"c"]) == [Entry(3)]


def test_one_process_opens_a_replica_read_write_once_at_a_time(path):
    with ShardReplica.open(path, SPEC):
        with pytest.raises(ReplicaLockedError, match="locked by this process"):
            ShardReplica.open(path, SPEC, lock_timeout_s=0.1)
    with ShardReplica.open(path, SPEC, lock_timeout_s=0.1) as again:  # let go at its close
        assert again.repaired is None


def test_a_replica_with_a_truncated_file_is_wiped_on_open_and_says_why(path):
    with ShardReplica.open(path, SPEC) as r:
        r.set_version(4)
        r.load_partition("p", [f"k{i}".encode() for i in range(3000)], [Entry(i) for i in range(3000)], "on_demand")
    damage.truncate(path)
    with ShardReplica.open(path, SPEC) as r:
        assert r.repaired.startswith("Corruption: Sst file size mismatch")
        assert (r.version, r.partitions()) == (None, {})  # empty: the caller bootstraps it
    with ShardReplica.open(path, SPEC) as r:
        assert r.repaired is None


def test_at_exit_a_kept_replica_whose_directory_was_removed_is_let_go_quietly(path, caplog):
    registry.acquire(path, SPEC).load_partition("p", [b"a"], [Entry(1)], reason="on_demand")
    shutil.rmtree(path.parent)  # a benchmark or test removed its data dir before the process ended
    close_kept_open()  # no exception: nothing is left to save
    assert not path.exists() and caplog.records == []


# --- the global keyspace's key filter --------------------------------------------------------

GLOBAL_SPEC = replica_spec(["id"], ["dt"], "ts", "global")


def _located(n: int, prefix: str = "k") -> tuple[list[bytes], list[bytes]]:
    keys = [f"{prefix}{i}".encode() for i in range(n)]
    return keys, pack_located_many(list(range(n)), [False] * n, ["dt=1"] * n)


def test_the_key_filter_answers_new_keys_and_never_hides_a_held_one(path):
    held, raws = _located(5000)
    with ShardReplica.open(path, GLOBAL_SPEC) as r:
        r.load_packed(GLOBAL, held, raws, reason="bootstrap")
        later, later_raws = _located(300, "later")
        r.keyspaces.put_packed(GLOBAL, later, later_raws)  # as a promoted batch writes them
        new = [f"new{i}".encode() for i in range(5000)]
        answers = r.lookup_packed(GLOBAL, held + later + new)
        assert answers == raws + later_raws + [None] * 5000
        assert r.lookups["rocksdb"] == 5300
        assert r.lookups["filter"] + r.lookups["miss"] == 5000
        assert r.lookups["filter"] > 4900  # the filter's false positives go on to RocksDB


def test_the_key_filter_is_saved_at_close_and_reused_without_a_scan(path, monkeypatch):
    held, raws = _located(2000)
    with ShardReplica.open(path, GLOBAL_SPEC) as r:
        r.load_packed(GLOBAL, held, raws, reason="bootstrap")
    with ShardReplica.open(path, GLOBAL_SPEC) as r:
        r.set_version(3)  # an open that never asks the filter keeps the saved one valid
    monkeypatch.setattr(KeyspaceFilters, "scanned", lambda self, pid: pytest.fail("scanned"))
    with ShardReplica.open(path, GLOBAL_SPEC) as r:
        assert r.lookup_packed(GLOBAL, held[:10] + [b"new"]) == raws[:10] + [None]
        assert r.keyspaces.key_filter_bytes() <= 2 * 2000


@pytest.mark.parametrize("damage", ["truncate", "stale"])
def test_a_damaged_or_stale_key_filter_is_rebuilt_from_the_keyspace(path, damage):
    held, raws = _located(2000)
    with ShardReplica.open(path, GLOBAL_SPEC) as r:
        r.load_packed(GLOBAL, held, raws, reason="bootstrap")
    saved = path / KEY_FILTER_FILE
    if damage == "truncate":
        saved.write_bytes(saved.read_bytes()[:-64])
    else:  # a filter from before keys were added without it (only a bug could do this: it must not be trusted)
        old = saved.read_bytes()
        with ShardReplica.open(path, GLOBAL_SPEC) as r:
            r.keyspaces.put_packed(GLOBAL, *_located(500, "added"))
        saved.write_bytes(old)
    with ShardReplica.open(path, GLOBAL_SPEC) as r:
        added, added_raws = _located(500, "added")
        expected = raws + (added_raws if damage == "stale" else [None] * 500)
        assert r.lookup_packed(GLOBAL, held + added) == expected


def test_a_reader_beside_the_writer_does_not_trust_the_saved_key_filter(path):
    held, raws = _located(1000)
    with ShardReplica.open(path, GLOBAL_SPEC) as r:
        r.load_packed(GLOBAL, held, raws, reason="bootstrap")
    writer = ShardReplica.open(path, GLOBAL_SPEC)
    try:
        added, added_raws = _located(10, "added")
        writer.keyspaces.put_packed(GLOBAL, added, added_raws)
        writer.flush()  # as tagging on the driver does after each batch, for `sink verify`
        with ShardReplica.open_read_only(path) as reader:
            assert reader.lookup_packed(GLOBAL, added) == added_raws
    finally:
        writer.close()


def test_the_key_filter_is_rebuilt_larger_as_keys_double(path):
    held, raws = _located(1000)
    with ShardReplica.open(path, GLOBAL_SPEC) as r:
        r.load_packed(GLOBAL, held, raws, reason="bootstrap")
        small = r.keyspaces.key_filter_bytes()
        more, more_raws = _located(20_000, "more")
        for i in range(0, 20_000, 2000):
            r.keyspaces.put_packed(GLOBAL, more[i:i + 2000], more_raws[i:i + 2000])
        assert r.keyspaces.key_filter_bytes() > small
        assert r.keyspaces.key_filter_bytes() <= 2 * 21_000
        assert r.lookup_packed(GLOBAL, held + more) == raws + more_raws


def test_dropping_the_keyspace_drops_its_key_filter(path):
    held, raws = _located(1000)
    with ShardReplica.open(path, GLOBAL_SPEC) as r:
        r.load_packed(GLOBAL, held, raws, reason="bootstrap")
    other, other_raws = _located(10, "other")
    with ShardReplica.open(path, GLOBAL_SPEC) as r:
        r.drop_all()
        r.load_packed(GLOBAL, other, other_raws, reason="bootstrap")
        assert r.lookup_packed(GLOBAL, held[:5] + other) == [None] * 5 + other_raws
    with ShardReplica.open(path, GLOBAL_SPEC) as r:  # the saved filter is the new keyspace's
        assert r.lookup_packed(GLOBAL, held[:5] + other) == [None] * 5 + other_raws
        assert r.lookups["filter"] >= 4


def test_a_keyspace_loaded_in_chunks_holds_every_chunk_and_its_filter_every_key(path):
    # A chunk past the SST threshold (ingested as a file) between two written in a batch.
    chunks = [_located(500, "a"), _located(25_000, "b"), _located(700, "c")]
    with ShardReplica.open(path, GLOBAL_SPEC) as r:
        assert r.load_chunks(GLOBAL, iter(chunks), reason="bootstrap") == 26_200
        assert r.partitions()[GLOBAL].loaded_entries == 26_200
        held = [k for keys, _ in chunks for k in keys]
        assert r.lookup_packed(GLOBAL, held) == [raw for _, raws in chunks for raw in raws]
        assert r.lookups["filter"] == 0  # no held key is ever answered "absent" by the filter


def test_a_chunk_said_ascending_is_written_as_it_comes_and_one_out_of_order_is_refused(path):
    keys_, raws = _located(25_000, "b")
    order = sorted(range(len(keys_)), key=keys_.__getitem__)
    ascending = ([keys_[i] for i in order], [raws[i] for i in order])
    with ShardReplica.open(path, GLOBAL_SPEC) as r:
        assert r.load_chunks(GLOBAL, iter([ascending]), reason="bootstrap", ascending=True) == 25_000
        assert r.lookup_packed(GLOBAL, keys_) == raws
        swapped = ([ascending[0][1], ascending[0][0], *ascending[0][2:]], ascending[1])
        with pytest.raises(Exception, match="ascending order"):  # rocksdict raises a bare Exception
            r.load_chunks(GLOBAL, iter([swapped]), reason="bootstrap", ascending=True)


def test_a_chunked_load_that_fails_midway_leaves_no_keyspace_and_a_retry_loads_it_whole(path):
    first, second = _located(300, "a"), _located(300, "b")

    def failing():
        yield first
        raise OSError("scan interrupted")

    with ShardReplica.open(path, GLOBAL_SPEC) as r:
        with pytest.raises(OSError, match="scan interrupted"):
            r.load_chunks(GLOBAL, failing(), reason="bootstrap")
        assert not r.has_partition(GLOBAL)
        assert r.load_chunks(GLOBAL, iter([first, second]), reason="bootstrap") == 600
        assert r.lookup_packed(GLOBAL, first[0] + second[0]) == first[1] + second[1]


def test_every_partition_has_a_key_filter_that_answers_new_keys_and_never_hides_a_held_one(path, monkeypatch):
    """Partitioned scope: a filter per partition, built at its load, kept in step with the
    entries written since (a promoted batch), saved at close and reused without a scan."""
    loaded = {pid: [f"{pid}-{i}".encode() for i in range(3000)] for pid in ("dt=1", "dt=2")}
    added = [f"added-{i}".encode() for i in range(400)]
    new = [f"new-{i}".encode() for i in range(3000)]
    with ShardReplica.open(path, SPEC) as r:
        for pid, keys in loaded.items():
            r.load_partition(pid, keys, [Entry(1)] * len(keys), reason="bootstrap")
        r.put_entries("dt=1", {k: Entry(2) for k in added})
    monkeypatch.setattr(KeyspaceFilters, "scanned", lambda self, pid: pytest.fail("scanned"))
    for _ in range(2):  # the second open reads the filters the first one saved again
        with ShardReplica.open(path, SPEC) as r:
            expected = [Entry(1)] * 3000 + [Entry(2)] * 400 + [None] * 3000
            assert r.lookup("dt=1", loaded["dt=1"] + added + new) == expected
            assert r.lookups["rocksdb"] == 3400 and r.lookups["filter"] > 2950  # false positives go on to RocksDB
            assert r.lookup("dt=2", added + loaded["dt=2"][:10]) == [None] * 400 + [Entry(1)] * 10
            assert r.keyspaces.live_partitions([loaded["dt=2"][0], added[0], new[0]]) == [["dt=2"], ["dt=1"], []]
            assert r.keyspaces.key_filter_bytes() <= 2 * (6400 + 2 * 64 * 8)


def test_a_partitions_filter_lost_or_from_another_close_is_rebuilt_by_a_scan(path):
    keys = [f"k{i}".encode() for i in range(2000)]
    with ShardReplica.open(path, SPEC) as r:
        r.load_partition("dt=1", keys, [Entry(1)] * 2000, reason="bootstrap")
    stale = (path / KEY_FILTER_FILE).read_bytes()
    with ShardReplica.open(path, SPEC) as r:
        r.put_entries("dt=1", {b"later": Entry(2)})
    (path / KEY_FILTER_FILE).write_bytes(stale)  # saved under an older close's token: not trusted
    with ShardReplica.open(path, SPEC) as r:
        assert r.lookup("dt=1", [b"later", keys[0], b"new"]) == [Entry(2), Entry(1), None]
    (path / KEY_FILTER_FILE).unlink()
    with ShardReplica.open(path, SPEC) as r:
        assert r.lookup("dt=1", [b"later", keys[-1]]) == [Entry(2), Entry(1)]


def test_a_dropped_and_reloaded_partition_gets_the_filter_of_its_new_keys(path):
    with ShardReplica.open(path, SPEC) as r:
        r.load_partition("dt=1", [b"old"], [Entry(1)], reason="bootstrap")
        r.drop_partition("dt=1", invalidated=True)
        r.load_partition("dt=1", [b"new"], [Entry(2)], reason="invalidated")
        assert r.lookup("dt=1", [b"old", b"new"]) == [None, Entry(2)]
    with ShardReplica.open(path, SPEC) as r:
        assert r.lookup("dt=1", [b"old", b"new"]) == [None, Entry(2)]


@pytest.mark.parametrize("seed", range(4))
def test_key_filters_never_hide_a_key_through_random_loads_writes_drops_and_reopens(path, seed):
    """Against a dict of what each partition holds: every lookup after loads, writes,
    drops, clean reopens and a lost or cut filter file answers exactly that."""
    import random

    rng = random.Random(seed)
    held: dict[str, dict[bytes, Entry]] = {}
    names = [f"dt={d}" for d in range(4)]
    universe = [f"k{i}".encode() for i in range(3000)]
    r = ShardReplica.open(path, SPEC)
    try:
        for step in range(60):
            pid = rng.choice(names)
            action = rng.random()
            if action < 0.2 or pid not in held:
                keys = rng.sample(universe, rng.randrange(0, 1500))
                held[pid] = {k: Entry(step) for k in keys}
                r.load_partition(pid, keys, list(held[pid].values()), reason="on_demand")
            elif action < 0.6:
                written = {k: Entry(step) for k in rng.sample(universe, rng.randrange(1, 800))}
                r.put_entries(pid, written)  # grows the filter past its doubling now and then
                held[pid].update(written)
            elif action < 0.7:
                r.drop_partition(pid)
                del held[pid]
            else:
                r.close()
                saved = path / KEY_FILTER_FILE
                if action > 0.9:
                    saved.write_bytes(saved.read_bytes()[: rng.randrange(len(saved.read_bytes()))])
                r = ShardReplica.open(path, SPEC)
            for name, entries in held.items():
                assert r.lookup(name, universe) == [entries.get(k) for k in universe], (seed, step, name)
    finally:
        r.close()


def test_a_read_only_open_that_finds_a_table_file_compacted_away_opens_again(path, monkeypatch):
    """The writer's compaction can delete a file between the MANIFEST read and its open."""
    held, raws = _located(100)
    with ShardReplica.open(path, GLOBAL_SPEC) as r:
        r.load_packed(GLOBAL, held, raws, reason="bootstrap")
    opens = []

    def compacting(*args, **kwargs):
        opens.append(1)
        if len(opens) < 3:
            raise Exception(f"Corruption: Can't access /000020.sst: IO error: No such file or directory: while stat "
                            f"a file for size: {path}/000020.sst: No such file or directory")
        return rocksdict.Rdict(*args, **kwargs)

    monkeypatch.setattr(replica_module, "Rdict", compacting)
    with ShardReplica.open_read_only(path) as reader:
        assert reader.lookup_packed(GLOBAL, held) == raws
    assert len(opens) == 3


def test_a_read_only_open_gives_up_on_other_errors_at_once(path, monkeypatch):
    def broken(*args, **kwargs):
        raise Exception("Corruption: bad block contents")

    monkeypatch.setattr(replica_module, "Rdict", broken)
    with pytest.raises(Exception, match="bad block contents"):
        ShardReplica.open_read_only(path)
