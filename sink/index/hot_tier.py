"""The memory tier in front of a shard's RocksDB: whole keyspaces held resident
(`sink.index.resident`, up to a budget of keys) and recently used committed entries of the
others.

It holds only what the replica's committed view holds: every write path of the replica
(load, promotion, change feed, drop) updates or drops it, and a tier is only reused by
a process when the replica carries the token the process wrote when it last closed it
(anything else touched the replica in between: the tier is cleared).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from itertools import islice

from sink.index.resident import Resident


class HotTier:
    """Least-recently-used eviction approximated by two generations, so that a hit costs one
    dict lookup: entries are written to the young generation; a hit in the old generation
    copies the entry to the young one; when the young generation holds half the capacity it
    becomes the old one and the previous old generation is dropped. An entry used at least
    once per generation stays; at most `capacity` entries are held.

    A key may sit in both generations (written or used again since it aged): the young copy
    is the newer one and the only one answered, the old copy goes with its generation. Not
    removing it on each write keeps a write one dict update; it only counts against the
    capacity until then."""

    def __init__(self, capacity: int, resident_keys: int = 0):
        self.capacity = capacity
        self.resident_keys = resident_keys
        self.resident: dict[str, Resident] = {}  # keyspaces held whole: their lookups stop here
        self.wanted: set[str] = set()  # keyspaces to hold whole at the replica's next catch-up
        self.written: dict[str, int] = {}  # entries written per keyspace since its last lookup
        self._young: dict[str, dict[bytes, bytes]] = {}
        self._old: dict[str, dict[bytes, bytes]] = {}
        self._young_size = 0
        self._old_size = 0
        self.token: bytes | None = None  # the replica's token this tier is valid for

    def __len__(self) -> int:
        return self._young_size + self._old_size

    def items(self):
        """The ((pid, key), entry) pairs the tier answers with."""
        for pid, entries in self._young.items():
            for key, raw in entries.items():
                yield (pid, key), raw
        for pid, entries in self._old.items():
            young = self._young.get(pid, {})
            for key, raw in entries.items():
                if key not in young:
                    yield (pid, key), raw

    def memory_bytes(self) -> int:
        """What the held entries take in this process: their key and value objects and the
        dicts holding them (`capacity` times its per-entry figure bounds it); resident
        keyspaces are `resident_bytes`."""
        total = 0
        for generation in (self._old, self._young):
            for entries in generation.values():
                total += sys.getsizeof(entries) + sum(sys.getsizeof(k) + sys.getsizeof(v) for k, v in entries.items())
        return total

    def get_many(self, pid: str, keys: Sequence[bytes]) -> list[bytes | None]:
        young = self._young.get(pid, {})
        out = [young.get(k) for k in keys] if young else [None] * len(keys)
        old = self._old.get(pid)
        if old:
            moved_keys, moved = [], []
            for i, k in enumerate(keys):
                if out[i] is None:
                    raw = old.get(k)
                    if raw is not None:
                        out[i] = raw
                        moved_keys.append(k)
                        moved.append(raw)
            if moved_keys:
                self.remember_many(pid, moved_keys, moved)
        return out

    def resident_bytes(self) -> int:
        return sum(r.nbytes for r in self.resident.values())

    def room_for(self, entries: int) -> bool:
        """Whether a keyspace of this many entries fits the resident budget."""
        return sum(len(r) for r in self.resident.values()) + entries <= self.resident_keys

    def hold(self, pid: str, resident: Resident) -> None:
        """Hold keyspace `pid` whole (its entries as of now): its recently used entries go."""
        self.drop_partition(pid)
        self.resident[pid] = resident

    def let_go(self, pid: str) -> None:
        """Stop holding keyspace `pid` whole: RocksDB answers it again."""
        self.resident.pop(pid, None)

    def put_many(self, pid: str, keys: Sequence[bytes], raws: Sequence[bytes]) -> None:
        """Entries written to keyspace `pid` (counted in `written`)."""
        self.written[pid] = self.written.get(pid, 0) + len(keys)
        resident = self.resident.get(pid)
        if resident is None:
            self.remember_many(pid, keys, raws)
            return
        resident.put_many(keys, raws)
        if not self.room_for(0):  # the keyspace grew past the budget
            self.let_go(pid)

    def remember_many(self, pid: str, keys: Sequence[bytes], raws: Sequence[bytes]) -> None:
        """Entries just read from RocksDB, kept as recently used (not writes: not counted)."""
        if self.capacity <= 0 or not len(keys):
            return
        young = self._young.setdefault(pid, {})
        before = len(young)
        young.update(zip(keys, raws))
        self._young_size += len(young) - before
        if self._young_size > max(self.capacity // 2, 1):
            self._old, self._old_size = self._young, self._young_size
            self._young, self._young_size = {}, 0
        self._trim()

    def _trim(self) -> None:
        """Drop the oldest entries of the old generation (whole keyspaces' dicts where they
        can go whole) until at most `capacity` are held. The first entries of a dict are
        taken in one pass: finding a dict's first entry again after each removal is
        quadratic in CPython, and so is copying a large dict to drop a few."""
        excess = len(self) - self.capacity
        while excess > 0:
            if not self._old_size:
                self._old, self._old_size = self._young, self._young_size
                self._young, self._young_size = {}, 0
            pid, entries = next(iter(self._old.items()))
            if len(entries) <= excess:
                del self._old[pid]
                dropped = len(entries)
            else:
                for key in list(islice(entries, excess)):
                    del entries[key]
                dropped = excess
            self._old_size -= dropped
            excess -= dropped

    def drop_partition(self, pid: str) -> None:
        self.resident.pop(pid, None)
        self.wanted.discard(pid)
        self.written.pop(pid, None)
        self._young_size -= len(self._young.pop(pid, {}))
        self._old_size -= len(self._old.pop(pid, {}))

    def clear(self) -> None:
        self.resident, self.written, self.wanted = {}, {}, set()
        self._young, self._old = {}, {}
        self._young_size = self._old_size = 0


# Keyspaces held whole per shard replica where the driver tags, unless `resident_keys` is set.
DRIVER_RESIDENT_KEYS = 1_000_000


def resident_keys(configured: int | None, *, driver: bool) -> int:
    """A replica use's budget of keyspaces held whole: the configured one; unset,
    DRIVER_RESIDENT_KEYS in the driver, which keeps its replicas open batch after batch, and
    none in Spark's Python workers. There a shard's tasks move between workers (about every
    other batch of the 10M-row bench), each move empties the tier, and refilling it, a scan
    of every keyspace the lookups asked for, took the next task 0.8-1.2 s, while its lookups
    took no longer without it (docs/performance.md)."""
    if configured is not None:
        return configured
    return DRIVER_RESIDENT_KEYS if driver else 0


# One tier per replica directory per process (a Python worker runs one task at a time).
_TIERS: dict[str, HotTier] = {}


def tier_for(path: str, capacity: int, resident_keys: int, token: bytes | None) -> HotTier:
    """This process's tier for a replica, emptied unless it is valid for `token`."""
    tier = _TIERS.get(path)
    if tier is None or (tier.capacity, tier.resident_keys) != (capacity, resident_keys):
        tier = _TIERS[path] = HotTier(capacity, resident_keys)
    if token is None or tier.token != token:
        tier.clear()
    return tier
