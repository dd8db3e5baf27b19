"""Sampled verification: before a batch is tagged, a share of its keys in partitions the
replica already held are looked up in the replica and read from the tables, as a load of the
partition would hold them (the table and the tombstone table at the batch's version). The two
must agree; a partition where they do not has drifted (a bug, a damaged file, someone's
write to the replica): it is reported and reloaded before the batch is tagged against it.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.compute as pc

from sink.index.entry import Entry

# Partitions of one shard a batch checks: each costs a read of its key and ordering columns
# and of the tombstone table's (events at 1M rows, 33k-row partitions: with 4 the check took
# 0.25 s of a 1.7 s batch, summed over its two shards; with 2, 0.10 s of 1.34 s). Successive
# batches check other partitions (the choice follows the batch id).
MAX_PARTITIONS = 1
EXAMPLES = 3

# A key's state as tagging sees it: None (absent, or deleted longer ago than the TTL), or
# (ordering values, deleted).
State = tuple[tuple[int, ...], bool] | None


@dataclass
class Check:
    keys: int = 0
    mismatches: int = 0
    drifted: list[str] = field(default_factory=list)  # partitions that disagree
    examples: list[str] = field(default_factory=list)


def sample(pids: pa.Array, keys: pa.Array, among: set[str], fraction: float, seed: int) -> dict[str, list[bytes]]:
    """Keys (binary) to check per partition: of at most MAX_PARTITIONS partitions of `among`
    the records name (chosen by `seed`), a `fraction` of each one's distinct keys, at least one.
    Array operations but for the chosen partitions' distinct keys."""
    named = sorted(p for p in pc.unique(pids).drop_null().to_pylist() if p in among)
    rng = random.Random(seed)
    out = {}
    for pid in rng.sample(named, min(MAX_PARTITIONS, len(named))):
        distinct = sorted(pc.unique(pc.filter(keys, pc.equal(pids, pid))).to_pylist())
        out[pid] = rng.sample(distinct, max(1, round(fraction * len(distinct))))
    return out


def state(raw: bytes | None, expire_before: int | None) -> State:
    if raw is None:
        return None
    entry = Entry.unpack(raw)
    if entry.deleted and expire_before is not None and entry.deleted_at < expire_before:
        return None
    return entry.values(), entry.deleted


def describe(s: State) -> str:
    if s is None:
        return "absent"
    values, deleted = s
    ordering = values[0] if len(values) == 1 else values
    return f"{'deleted' if deleted else 'live'} at ordering {ordering}"


def check(wanted: Mapping[str, Sequence[bytes]], held: Callable[[str, Sequence[bytes]], list[bytes | None]],
          table: Callable[[str, pa.Array], Mapping[bytes, bytes]], expire_before: int | None,
          describe_key: Callable[[bytes], str]) -> Check:
    """Compare, per partition, the replica's entries (`held(pid, keys)`) with the tables'
    (`table(pid, keys)`: what a load would hold) of the `wanted` keys."""
    out = Check()
    for pid, keys in wanted.items():
        mine = held(pid, keys)
        theirs = table(pid, pa.array(keys, pa.binary()))
        out.keys += len(keys)
        bad = 0
        for key, raw in zip(keys, mine):
            a, b = state(raw, expire_before), state(theirs.get(key), expire_before)
            if a != b:
                bad += 1
                if len(out.examples) < EXAMPLES:
                    out.examples.append(f"partition {pid}, key {describe_key(key)}: the index says {describe(a)}, "
                                        f"the table {describe(b)}")
        if bad:
            out.mismatches += bad
            out.drifted.append(pid)
    return out
