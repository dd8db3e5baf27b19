"""Tagging without Spark: records/s per core through `tag` on a warm replica."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

from sink.index.entry import pack_many
from sink.index.replica import ShardReplica
from sink.tagging.classify import tag

PID = "dt=2025-03-01"


def _batch(keys: list[bytes], ordering: int) -> tuple[pa.Array, ...]:
    n = len(keys)
    return (pa.array(keys, pa.binary()), pa.array([PID] * n), pa.array(np.full(n, ordering, np.int64)),
            pa.array(np.zeros(n, bool)), pa.array(np.arange(n)))


def _rate(fn, batch, n: int, repeats: int = 3) -> float:
    best = min(_timed(fn, batch) for _ in range(repeats))
    return n / best


def _timed(fn, batch) -> float:
    started = time.perf_counter()
    fn(*batch)
    return time.perf_counter() - started


def run(index_keys: int, batch_rows: int, hot_cache_entries: int, log=print) -> dict:
    rng = np.random.default_rng(7)
    keys = [f"user-{i:012d}".encode() for i in range(index_keys)]
    raws = pack_many(np.arange(index_keys), np.zeros(index_keys, bool))
    hits = [keys[i] for i in rng.choice(index_keys, batch_rows, replace=False)]
    misses = [f"new-{i:012d}".encode() for i in range(batch_rows)]
    results = {"index_keys": index_keys, "batch_rows": batch_rows, "hot_cache_entries": hot_cache_entries}
    with tempfile.TemporaryDirectory() as tmp:
        with ShardReplica.open(Path(tmp) / "r", "bench", hot_cache_entries=hot_cache_entries) as replica:
            replica.load_packed(PID, keys, raws, reason="bootstrap")

            def with_replica(*batch):
                return tag(*batch, lookup=replica.lookup_packed)

            replica.lookup_packed(PID, hits)  # warm the memory tier with the batch's keys
            results["memory_tier_bytes_per_entry"] = round(replica.tier.memory_bytes() / len(replica.tier))
            before = dict(replica.lookups)
            results["warm_hits_per_s"] = round(_rate(with_replica, _batch(hits, index_keys + 1), batch_rows))
            memory = replica.lookups["memory"] - before["memory"]
            looked = sum(replica.lookups.values()) - sum(before.values())
            results["warm_memory_hit_share"] = round(memory / looked, 3)
            results["misses_per_s"] = round(_rate(with_replica, _batch(misses, 1), batch_rows))
            replica.tier.clear()
            replica.tier.capacity = 0
            results["cold_hits_per_s"] = round(_rate(with_replica, _batch(hits, index_keys + 1), batch_rows))
        with ShardReplica.open(Path(tmp) / "resident", "bench", resident_keys=index_keys) as replica:
            replica.load_packed(PID, keys, raws, reason="bootstrap")

            def with_resident(*batch):
                return tag(*batch, lookup=replica.lookup_packed)

            replica.lookup_packed(PID, hits)  # reaches RocksDB for more than a 64th of the keys: asks to hold it
            replica.keyspaces.hold_wanted()  # as the next catch-up does
            results["resident_bytes_per_key"] = round(replica.tier.resident_bytes() / index_keys, 1)
            results["resident_hits_per_s"] = round(_rate(with_resident, _batch(hits, index_keys + 1), batch_rows))
    index = dict(zip(keys, raws))

    def with_dict(*batch):
        return tag(*batch, lookup=lambda pid, ks: [index.get(k) for k in ks])

    results["dict_hits_per_s"] = round(_rate(with_dict, _batch(hits, index_keys + 1), batch_rows))
    results["dict_misses_per_s"] = round(_rate(with_dict, _batch(misses, 1), batch_rows))
    log(f"tagging: warm {results['warm_hits_per_s']:,}/s ({results['warm_memory_hit_share']:.0%} memory), "
        f"cold hits {results['cold_hits_per_s']:,}/s, misses {results['misses_per_s']:,}/s, "
        f"dict {results['dict_hits_per_s']:,}/s; memory tier {results['memory_tier_bytes_per_entry']} B/entry; "
        f"resident {results['resident_hits_per_s']:,}/s, {results['resident_bytes_per_key']} B/key")
    return results
