import random

import pytest

from sink.index import hot_tier
from sink.index import keyspaces as keyspaces_module
from sink.index.entry import Entry
from sink.index.hot_tier import HotTier
from sink.index.lifecycle import evict
from sink.index.replica import ShardReplica

SPEC = "spec"
PIDS = ["p0", "p1", "p2"]
KEYS = [f"k{i}".encode() for i in range(30)]


def rocksdb_view(replica):
    """What RocksDB holds, read around the memory tier."""
    return {pid: {k: e.pack() for k, e in replica.keyspaces.entries(pid)} for pid in replica.partitions()}


def assert_tier_consistent(replica):
    view = rocksdb_view(replica)
    for pid in view:
        assert replica.lookup_packed(pid, KEYS) == [view[pid].get(k) for k in KEYS], pid
    for (pid, key), raw in replica.tier.items():
        assert view.get(pid, {}).get(key) == raw, (pid, key)


def random_entries(rng):
    keys = rng.sample(KEYS, rng.randint(0, len(KEYS)))
    return keys, [Entry(rng.randint(0, 99), rng.random() < 0.2) for _ in keys]


@pytest.mark.parametrize("resident_keys", [0, 40])
@pytest.mark.parametrize("seed", range(8))
def test_the_memory_tier_never_answers_what_the_replica_no_longer_holds(tmp_path, monkeypatch, seed, resident_keys):
    monkeypatch.setattr(keyspaces_module, "RESIDENT_MIN_LOOKUPS", 1)  # a lookup reaching RocksDB makes it resident
    rng = random.Random(seed)
    path = tmp_path / "r"
    options = {"hot_cache_entries": 20, "resident_keys": resident_keys}
    replica = ShardReplica.open(path, SPEC, **options)
    steps_resident = 0
    for step in range(150):
        action = rng.choice(["load", "stage_promote", "stage_discard", "cdf", "drop", "drop_all", "evict",
                             "reopen", "other_process"])
        pid = rng.choice(PIDS)
        if action == "load":
            keys, entries = random_entries(rng)
            replica.load_partition(pid, keys, entries, reason="on_demand", now=float(step))
        elif action in ("stage_promote", "stage_discard"):
            replica.stage(step, {p: dict(zip(*random_entries(rng))) for p in rng.sample(PIDS, 2)})
            if action == "stage_promote":
                replica.promote_staged()
            else:
                replica.discard_staged()
        elif action == "cdf" and replica.has_partition(pid):
            replica.put_entries(pid, dict(zip(*random_entries(rng))))
        elif action == "drop":
            replica.drop_partition(pid)
        elif action == "drop_all":
            replica.drop_all()
        elif action == "evict":
            evict(replica, now=float(step), ttl_hours=0, max_bytes=None, keep={pid})
        elif action == "reopen":
            replica.close()
            replica = ShardReplica.open(path, SPEC, **options)
        elif action == "other_process":
            # Another worker process takes the shard (with its own memory), changes it, closes it.
            replica.close()
            ours = hot_tier._TIERS.pop(str(path))
            other = ShardReplica.open(path, SPEC, **options)
            keys, entries = random_entries(rng)
            other.load_partition(pid, keys, entries, reason="on_demand")
            other.close()
            hot_tier._TIERS[str(path)] = ours
            replica = ShardReplica.open(path, SPEC, **options)
        replica.keyspaces.hold_wanted()  # the keyspaces the last lookups asked for, as a catch-up holds them
        for p in PIDS:
            if replica.has_partition(p):
                replica.lookup_packed(p, rng.sample(KEYS, 10))  # fill the tier
        assert_tier_consistent(replica)
        assert len(replica.tier) <= 20
        assert sum(len(r) for r in replica.tier.resident.values()) <= resident_keys
        steps_resident += bool(replica.tier.resident)
    replica.close()
    assert (steps_resident > 0) == (resident_keys > 0)  # the resident keyspaces were exercised


def test_a_reopened_replica_answers_from_memory(tmp_path):
    path = tmp_path / "r"
    with ShardReplica.open(path, SPEC, hot_cache_entries=100) as r:
        r.load_partition("p", KEYS[:5], [Entry(i) for i in range(5)], reason="on_demand")
        r.lookup_packed("p", KEYS[:5])
    with ShardReplica.open(path, SPEC, hot_cache_entries=100) as r:
        assert r.lookup("p", KEYS[:6]) == [Entry(i) for i in range(5)] + [None]
        assert r.lookups == {"memory": 5, "rocksdb": 0, "miss": 0, "filter": 1}  # the key filter knows KEYS[5]


def test_memory_bytes_counts_every_held_key_and_value_and_nothing_once_they_go():
    tier = HotTier(1000)
    assert tier.memory_bytes() == 0
    keys, raws = [f"user-{i:06d}".encode() for i in range(200)], [Entry(i).pack() for i in range(200)]
    tier.put_many("p", keys[:100], raws[:100])
    half = tier.memory_bytes()
    assert half > sum(len(k) + len(r) for k, r in zip(keys[:100], raws[:100]))  # object headers and slots on top
    tier.put_many("q", keys[100:], raws[100:])
    assert 1.9 * half <= tier.memory_bytes() <= 2.1 * half  # as many entries again, of the same sizes
    tier.drop_partition("q")
    assert tier.memory_bytes() == half
    tier.clear()
    assert tier.memory_bytes() == 0


def test_recently_used_entries_survive_and_the_rest_go():
    tier = HotTier(4)
    tier.put_many("p", [b"a", b"b", b"c"], [b"1", b"2", b"3"])  # over half the capacity: they age
    assert tier.get_many("p", [b"a"]) == [b"1"]  # used again: young again
    tier.put_many("q", [b"x"], [b"8"])
    tier.put_many("q", [b"y"], [b"9"])  # the young generation ages; b and c were not used since
    assert tier.get_many("p", [b"a", b"b", b"c"]) == [b"1", None, None]
    assert tier.get_many("q", [b"x", b"y"]) == [b"8", b"9"]
    assert len(tier) <= 4


def test_a_keyspace_looked_up_heavily_is_held_whole_and_one_over_the_budget_is_not(tmp_path, monkeypatch):
    monkeypatch.setattr(keyspaces_module, "RESIDENT_MIN_LOOKUPS", 10)
    keys = [f"user-{i:05d}".encode() for i in range(1000)]
    with ShardReplica.open(tmp_path / "r", SPEC, resident_keys=1500) as r:
        r.load_partition("small", keys[:700], [Entry(i) for i in range(700)], reason="on_demand")
        r.load_partition("big", keys, [Entry(i) for i in range(1000)], reason="on_demand")
        r.lookup_packed("small", keys[:5])  # 5 lookups reach RocksDB: fewer than the threshold
        r.keyspaces.hold_wanted()
        assert r.tier.resident == {}
        r.lookup_packed("small", keys[:20])  # 20: more than a 64th of its 700 keys, and more than 10
        assert r.tier.resident == {} and r.tier.wanted == {"small"}  # held from the next catch-up on
        r.keyspaces.hold_wanted()
        assert list(r.tier.resident) == ["small"]
        r.lookup_packed("big", keys[:100])  # 1000 more keys do not fit a budget of 1500 beside 700
        r.keyspaces.hold_wanted()
        assert list(r.tier.resident) == ["small"]
        r.lookups.update(dict.fromkeys(r.lookups, 0))
        assert r.lookup("small", [keys[3], keys[699], keys[700]]) == [Entry(3), Entry(699), None]
        # The key filter knows keys[700] is not there.
        assert r.lookups == {"memory": 2, "rocksdb": 0, "miss": 0, "filter": 1}
        r.put_entries("small", {keys[3]: Entry(7, True, 5), keys[800]: Entry(8)})  # a promotion or change feed
        assert r.lookup("small", [keys[3], keys[800]]) == [Entry(7, True, 5), Entry(8)]
        assert r.tier.resident["small"].overlay  # written since it was held: in the overlay


def test_a_resident_keyspace_grown_past_the_budget_is_let_go_and_answers_from_rocksdb(tmp_path, monkeypatch):
    monkeypatch.setattr(keyspaces_module, "RESIDENT_MIN_LOOKUPS", 1)
    keys = [f"user-{i:05d}".encode() for i in range(300)]
    with ShardReplica.open(tmp_path / "r", SPEC, resident_keys=250) as r:
        r.load_partition("p", keys[:200], [Entry(i) for i in range(200)], reason="on_demand")
        r.lookup_packed("p", keys[:10])
        r.keyspaces.hold_wanted()
        assert list(r.tier.resident) == ["p"]
        r.put_entries("p", {k: Entry(1000 + i) for i, k in enumerate(keys[200:])})  # 300 keys now
        assert r.tier.resident == {}
        r.lookups.update(dict.fromkeys(r.lookups, 0))
        assert r.lookup("p", [keys[0], keys[299]]) == [Entry(0), Entry(1099)]
        assert r.lookups == {"memory": 0, "rocksdb": 2, "miss": 0, "filter": 0}


def test_a_keyspace_written_more_than_twice_as_much_as_read_is_let_go_and_not_held_again(tmp_path, monkeypatch):
    monkeypatch.setattr(keyspaces_module, "RESIDENT_MIN_LOOKUPS", 10)
    keys = [f"user-{i:05d}".encode() for i in range(1000)]
    with ShardReplica.open(tmp_path / "r", SPEC, resident_keys=10_000) as r:
        r.load_partition("p", keys, [Entry(i) for i in range(1000)], reason="on_demand")
        r.lookup_packed("p", keys[:100])
        r.keyspaces.hold_wanted()
        assert list(r.tier.resident) == ["p"]
        r.put_entries("p", {k: Entry(5000 + i) for i, k in enumerate(keys[500:801])})  # 301 written > 2 x 100 read
        assert r.lookup("p", [keys[0], keys[800]]) == [Entry(0), Entry(5300)]  # answered by RocksDB
        assert r.tier.resident == {}
        r.put_entries("p", {k: Entry(6000 + i) for i, k in enumerate(keys[:201])})
        assert r.lookup("p", keys[300:400])[0] == Entry(300)  # 100 reached RocksDB: under half of 201 written
        r.keyspaces.hold_wanted()
        assert r.tier.resident == {}
        assert r.lookup("p", keys[:100])[0] == Entry(6000)  # nothing written since: held again
        r.keyspaces.hold_wanted()
        assert list(r.tier.resident) == ["p"]


def test_only_writes_count_as_written_not_entries_remembered_after_a_read():
    tier = HotTier(100)
    tier.remember_many("p", [b"a", b"b"], [b"1", b"2"])  # read from RocksDB
    assert tier.get_many("p", [b"a"]) == [b"1"]
    tier.put_many("p", [b"c"], [b"3"])  # a promotion, change feed or changelog entry
    assert tier.written == {"p": 1}
    assert tier.get_many("p", [b"a", b"b", b"c"]) == [b"1", b"2", b"3"]


def test_entries_a_lookup_reads_from_rocksdb_do_not_count_against_holding_the_keyspace(tmp_path, monkeypatch):
    monkeypatch.setattr(keyspaces_module, "RESIDENT_MIN_LOOKUPS", 10)
    keys = [f"user-{i:05d}".encode() for i in range(1000)]
    with ShardReplica.open(tmp_path / "r", SPEC, hot_cache_entries=1000, resident_keys=10_000) as r:
        r.load_partition("p", keys, [Entry(i) for i in range(1000)], reason="on_demand")
        r.lookup_packed("p", keys[:14])  # 14 reach RocksDB: under a 64th of 1000
        r.keyspaces.hold_wanted()
        assert r.tier.resident == {}
        r.put_entries("p", {k: Entry(2000 + i) for i, k in enumerate(keys[500:520])})  # 20 written
        r.lookup_packed("p", keys[100:116])  # 16 reach RocksDB: at least half of the 20 written
        r.keyspaces.hold_wanted()
        assert list(r.tier.resident) == ["p"]


def test_a_key_written_again_after_it_aged_answers_its_newest_entry_in_both_generations():
    tier = HotTier(4)
    tier.put_many("p", [b"a", b"b", b"c"], [b"1", b"2", b"3"])  # over half the capacity: they age
    tier.put_many("p", [b"a"], [b"9"])  # young again, its aged copy still in the old generation
    assert tier.get_many("p", [b"a", b"b", b"c"]) == [b"9", b"2", b"3"]
    assert dict(tier.items()) == {("p", b"a"): b"9", ("p", b"b"): b"2", ("p", b"c"): b"3"}
    assert len(tier) <= 4


def test_trimming_in_small_steps_keeps_the_newest_entries_and_the_capacity():
    tier = HotTier(1000)
    keys = [f"k{i:05d}".encode() for i in range(3000)]
    for start in range(0, len(keys), 7):  # many writes of a few entries each into one big keyspace
        tier.put_many("p", keys[start:start + 7], keys[start:start + 7])
        assert len(tier) <= 1000
    answered = dict(tier.items())
    assert all(answered[("p", k)] == k for k in keys[-500:])  # the young generation at least
    assert all(raw == key for (_, key), raw in answered.items())
    assert set(k for _, k in answered) <= set(keys[-1000:])  # the oldest went first


def test_a_keyspace_asked_for_is_held_as_it_is_when_the_replica_has_caught_up(tmp_path, monkeypatch):
    monkeypatch.setattr(keyspaces_module, "RESIDENT_MIN_LOOKUPS", 10)
    keys = [f"user-{i:05d}".encode() for i in range(1000)]
    with ShardReplica.open(tmp_path / "r", SPEC, resident_keys=10_000) as r:
        r.load_partition("p", keys[:500], [Entry(i) for i in range(500)], reason="on_demand")
        r.load_partition("q", keys[:500], [Entry(i) for i in range(500)], reason="on_demand")
        r.lookup_packed("p", keys[:50])
        r.lookup_packed("q", keys[:50])
        assert r.tier.wanted == {"p", "q"} and r.tier.resident == {}  # the lookups only ask
        r.put_entries("p", {keys[0]: Entry(9, True, 3), keys[600]: Entry(7)})  # the promotion of their batch
        r.drop_partition("q")  # evicted meanwhile
        r.keyspaces.hold_wanted()
        assert list(r.tier.resident) == ["p"] and r.tier.wanted == set()
        r.lookups.update(dict.fromkeys(r.lookups, 0))
        assert r.lookup("p", [keys[0], keys[600], keys[1]]) == [Entry(9, True, 3), Entry(7), Entry(1)]
        assert r.lookups["memory"] == 3  # from the columns, which hold the promoted entries


def test_keyspaces_are_held_whole_by_the_driver_and_by_python_workers_only_when_set():
    """Unset, the budget is the driver's (it keeps its replicas) and none in Spark's Python
    workers (a shard's tasks move between them); a set budget holds everywhere, 0 included."""
    assert hot_tier.resident_keys(None, driver=True) == hot_tier.DRIVER_RESIDENT_KEYS > 0
    assert hot_tier.resident_keys(None, driver=False) == 0
    assert hot_tier.resident_keys(500, driver=False) == 500
    assert hot_tier.resident_keys(0, driver=True) == 0
