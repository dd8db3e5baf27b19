import random

import pytest

from sink.index import hot_tier
from sink.index.entry import Entry
from sink.index.hot_tier import HotTier
from sink.index.lifecycle import evict
from sink.index.replica import ShardReplica

SPEC = "spec"
PIDS = ["p0", "p1", "p2"]
KEYS = [f"k{i}".encode() for i in range(30)]


def rocksdb_view(replica):
    """What RocksDB holds, read around the memory tier."""
    return {pid: {k: e.pack() for k, e in replica.entries(pid)} for pid in replica.partitions()}


def assert_tier_consistent(replica):
    view = rocksdb_view(replica)
    for pid in view:
        assert replica.lookup_packed(pid, KEYS) == [view[pid].get(k) for k in KEYS], pid
    for (pid, key), raw in replica.tier.items():
        assert view.get(pid, {}).get(key) == raw, (pid, key)


def random_entries(rng):
    keys = rng.sample(KEYS, rng.randint(0, len(KEYS)))
    return keys, [Entry(rng.randint(0, 99), rng.random() < 0.2) for _ in keys]


@pytest.mark.parametrize("seed", range(8))
def test_the_memory_tier_never_answers_what_the_replica_no_longer_holds(tmp_path, seed):
    rng = random.Random(seed)
    path = tmp_path / "r"
    replica = ShardReplica.open(path, SPEC, hot_cache_entries=20)
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
            replica = ShardReplica.open(path, SPEC, hot_cache_entries=20)
        elif action == "other_process":
            # Another worker process takes the shard (with its own memory), changes it, closes it.
            replica.close()
            ours = hot_tier._TIERS.pop(str(path))
            other = ShardReplica.open(path, SPEC, hot_cache_entries=20)
            keys, entries = random_entries(rng)
            other.load_partition(pid, keys, entries, reason="on_demand")
            other.close()
            hot_tier._TIERS[str(path)] = ours
            replica = ShardReplica.open(path, SPEC, hot_cache_entries=20)
        for p in PIDS:
            if replica.has_partition(p):
                replica.lookup_packed(p, rng.sample(KEYS, 10))  # fill the tier
        assert_tier_consistent(replica)
        assert len(replica.tier) <= 20
    replica.close()


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
