"""A replica's keyspaces and their lookups: one column family per table partition held (or
the one global keyspace), loaded whole and visible only once complete, read through the
keyspace's key filter, then the memory tier, then one RocksDB multi-get."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from rocksdict import Rdict, SstFileWriter, WriteBatch

from sink.index import rocks
from sink.index.entry import Entry, size
from sink.index.hot_tier import HotTier
from sink.index.key_filter import KeyFilter, hashes
from sink.index.keyspace_filters import KeyspaceFilters
from sink.index.metadata import PartitionInfo, ReplicaMeta
from sink.index.resident import Resident
from sink.index.spec import GLOBAL

PARTITION_CF_PREFIX = "p:"
# Lookups that reach RocksDB in one call below which a keyspace is never made resident.
RESIDENT_MIN_LOOKUPS = 256
# Above this many entries a partition load goes through an SST file and ingest.
_SST_THRESHOLD = 20_000
# Entries per RocksDB write of a promotion. A write holds the GIL throughout, and the driver
# promotes while its main thread collects the next batch, which needs the GIL back after
# every read of Spark's stream: smaller writes let it in sooner (an events batch at 1M rows,
# one process alternating: collect 0.164 -> 0.149 s).
WRITE_CHUNK = 4096
# Where a lookup's keys were answered: in memory, by RocksDB, not found by RocksDB, or not
# found by the keyspace's key filter (counted per distinct key).
REPLICA_LOOKUPS = ("memory", "rocksdb", "miss", "filter")


class Keyspaces:
    """The keyspaces of one open replica (`files`: the directory its RocksDB reads)."""

    def __init__(self, db: Rdict, files: Path, meta: ReplicaMeta, read_only: bool, block_cache_bytes: int,
                 name: object):
        self._db = db
        self._files = files
        self._meta = meta
        self._block_cache_bytes = block_cache_bytes
        self._lock = threading.Lock()
        self.tier = HotTier(0)
        self.filters = KeyspaceFilters(files, meta, read_only, self._scanned_filter, name)
        # Column family handles, opened once per open replica: letting go of one whose memtable
        # holds writes flushes that memtable (~1.5 ms each, measured), which every lookup of a
        # partition the last batch wrote to would pay.
        self._cfs: dict[str, Rdict] = {}
        self.lookups = dict.fromkeys(REPLICA_LOOKUPS, 0)  # of this open

    def cf(self, name: str) -> Rdict:
        cf = self._cfs.get(name)
        if cf is None:
            cf = self._cfs[name] = self._db.get_column_family(name)
        return cf

    def cf_names(self) -> list[str]:
        return Rdict.list_cf(str(self._files), rocks.options())

    def flush(self) -> None:
        """Every partition's memtable to disk (the WAL is off)."""
        for name in self.cf_names():
            if name != "default":
                self.cf(name).flush()

    def let_go(self) -> None:
        self._cfs.clear()  # open handles would keep RocksDB (and its lock) alive

    # --- loads and drops -----------------------------------------------------------------------

    def load_chunks(
        self, pid: str, chunks: Iterable[tuple[Sequence[bytes], Sequence[bytes]]], reason: str,
        now: float | None = None, *, ascending: bool = False,
    ) -> int:
        """Replace partition `pid` with the entries of every (keys, raws) chunk, written one
        chunk at a time (chunks hold distinct keys; with `ascending`, each chunk's keys come in
        ascending byte order and are not sorted again); visible only once complete. Returns the
        number of entries."""
        now = time.time() if now is None else now
        with self._lock:
            self.drop_partition(pid)
            cf_name = PARTITION_CF_PREFIX + pid
            cf = self._cfs[cf_name] = self._db.create_column_family(cf_name, rocks.options(self._block_cache_bytes))
            loaded, key_hashes = 0, [np.zeros(0, np.uint64)]
            try:
                for keys, raws in chunks:
                    if len(keys) >= _SST_THRESHOLD:
                        self._ingest(cf, keys, raws, ascending)
                    elif len(keys):
                        batch = WriteBatch(raw_mode=True)
                        batch.set_default_column_family(self._db.get_column_family_handle(cf_name))
                        for k, raw in zip(keys, raws):
                            batch.put(k, raw)
                        self._db.write(batch)
                    loaded += len(keys)
                    key_hashes.append(hashes(keys))
            finally:
                del cf  # the handle stays in self._cfs
            self.filters.set(pid, KeyFilter.build(np.concatenate(key_hashes)))
            self._meta.record_load(pid, PartitionInfo(loaded_entries=loaded, loaded_at=now, last_access=now,
                                                      reason=reason))
        return loaded

    def _ingest(self, cf: Rdict, keys: Sequence[bytes], raws: Sequence[bytes], ascending: bool) -> None:
        """Write the entries as one SST file, in key order (the writer refuses any other), and
        ingest it."""
        if not ascending:
            order = pc.sort_indices(pa.array(keys, pa.binary())).to_numpy().tolist()
            keys, raws = [keys[i] for i in order], [raws[i] for i in order]
        sst = self._files / f"ingest-{os.getpid()}-{threading.get_ident()}.sst"
        writer = SstFileWriter(rocks.options(self._block_cache_bytes))
        writer.open(str(sst))
        for key, raw in zip(keys, raws):
            writer[key] = raw
        writer.finish()
        try:
            cf.ingest_external_file([str(sst)])
        finally:
            sst.unlink(missing_ok=True)

    def drop_partition(self, pid: str, invalidated: bool = False) -> None:
        """Forget partition `pid`; `invalidated`: because a commit changed it (counted when
        it loads again)."""
        self.tier.drop_partition(pid)
        self.filters.forget(pid)
        self._meta.forget_partition(pid, invalidated)
        self._cfs.pop(PARTITION_CF_PREFIX + pid, None)
        if PARTITION_CF_PREFIX + pid in self.cf_names():
            self._db.drop_column_family(PARTITION_CF_PREFIX + pid)

    def drop_all(self) -> None:
        self.tier.clear()
        self.filters.clear()
        for name in self.cf_names():
            if name.startswith(PARTITION_CF_PREFIX):
                self._cfs.pop(name, None)
                self._db.drop_column_family(name)
        self._meta.forget_partitions()

    def held_of(self, pids: Iterable[str]) -> list[str]:
        """The keyspaces holding entries of these table partitions: the held ones among them,
        or in global scope the one keyspace (if held and any partition is named)."""
        if self._meta.located:
            return [GLOBAL] if self._meta.has_partition(GLOBAL) and any(True for _ in pids) else []
        return [pid for pid in pids if self._meta.has_partition(pid)]

    # --- sizes -----------------------------------------------------------------------------------

    def partition_sizes(self) -> dict[str, tuple[int, int]]:
        """Per held partition: (entries, bytes on disk and in memory), RocksDB's estimates."""
        out = {}
        for pid in self._meta.partitions():
            cf = self.cf(PARTITION_CF_PREFIX + pid)
            entries = cf.property_int_value("rocksdb.estimate-num-keys") or 0
            size_ = (cf.property_int_value("rocksdb.total-sst-files-size") or 0) + (
                cf.property_int_value("rocksdb.cur-size-all-mem-tables") or 0)
            out[pid] = (entries, size_)
        return out

    def reader_memory_bytes(self) -> int:
        """Memory RocksDB holds outside the block cache for this replica's files: their bloom
        filters and index blocks."""
        return sum(self.cf(name).property_int_value("rocksdb.estimate-table-readers-mem") or 0
                   for name in self.cf_names())

    def key_filter_bytes(self) -> int:
        """Memory of the held keyspaces' key filters."""
        return self.filters.nbytes(self._meta.partitions())

    # --- lookups ---------------------------------------------------------------------------------

    def lookup_packed(self, pid: str, keys: Sequence[bytes]) -> list[bytes | None]:
        """Committed packed entries of `keys` in a held partition: the keyspace's key filter
        first, then the memory tier, then one RocksDB multi-get for the rest (staged entries
        are not visible)."""
        if not len(keys):
            return []
        key_hashes = hashes(keys)
        maybe = np.flatnonzero(self.filters.of(pid).may_contain(key_hashes))
        self.lookups["filter"] += len(keys) - len(maybe)
        return _spread(len(keys), maybe, self._lookup_tiers(pid, _taken(keys, maybe), key_hashes[maybe]))

    def _lookup_tiers(self, pid: str, keys: Sequence[bytes], key_hashes: np.ndarray) -> list[bytes | None]:
        if not len(keys):
            return []
        written = self.tier.written.pop(pid, 0)
        resident = self.tier.resident.get(pid)
        if resident is not None and written > 2 * max(len(keys), RESIDENT_MIN_LOOKUPS):
            self.tier.let_go(pid)  # written more than read: its folds cost more than its lookups save
            resident = None
        if resident is not None:
            raws = resident.get_many(keys, key_hashes)
            found = sum(r is not None for r in raws)
            self.lookups["memory"] += found
            self.lookups["miss"] += len(keys) - found
            return raws
        raws = self.tier.get_many(pid, keys)
        todo = [i for i, r in enumerate(raws) if r is None]
        self.lookups["memory"] += len(keys) - len(todo)
        if todo:
            # In key order RocksDB finds the next key in the blocks it just read: a multi-get of
            # 50k keys of a 5M-key partition took 0.24 s sorted, 0.33-0.40 s as they came.
            todo.sort(key=keys.__getitem__)
            fetched = self.cf(PARTITION_CF_PREFIX + pid).get([keys[i] for i in todo])
            found_keys, found_raws = [], []
            for i, raw in zip(todo, fetched):
                if raw is not None:
                    raws[i] = raw
                    found_keys.append(keys[i])
                    found_raws.append(raw)
            self.lookups["rocksdb"] += len(found_keys)
            self.lookups["miss"] += len(todo) - len(found_keys)
            self.tier.remember_many(pid, found_keys, found_raws)
            self._maybe_hold_whole(pid, len(todo), written)
        return raws

    def _maybe_hold_whole(self, pid: str, reached_rocksdb: int, written: int) -> None:
        """Ask for keyspace `pid` to be held resident once one lookup sent a 64th of its keys to
        RocksDB (a scan of it costs about what a ninth as many RocksDB lookups do) and at least
        half as many as were written to it since its last lookup (an entry written costs a
        resident keyspace, in its share of the folds, about half what a RocksDB lookup costs),
        if the budget has room. `hold_wanted` builds it; `_lookup_tiers` lets it go again once
        written more than that."""
        estimate = self.filters.of(pid).keys
        if reached_rocksdb >= max(RESIDENT_MIN_LOOKUPS, estimate // 64, written / 2) and self.tier.room_for(estimate):
            self.tier.wanted.add(pid)

    def hold_wanted(self) -> None:
        """Hold whole the keyspaces lookups asked for, where they still fit. Called once the
        replica has caught up, before a batch's lookups: with driver tagging while the batch is
        collected, so the scans (~0.05 s for 80k entries) are not tagging's to wait for."""
        for pid in sorted(self.tier.wanted):
            self.tier.wanted.discard(pid)
            if not self._meta.has_partition(pid) or pid in self.tier.resident:
                continue
            keys, raws = [], []
            for key, raw in self._raw_items(pid):
                keys.append(key)
                raws.append(raw)
            if self.tier.room_for(len(keys)):
                self.tier.hold(pid, Resident.of(keys, raws))

    def live_elsewhere(self, keys: Sequence[bytes], own_pids: Sequence[str]) -> dict[bytes, str]:
        """Of `keys` (each paired with its own partition), those a held partition other than
        their own holds as live rows: key -> that partition (the first in partition order)."""
        found: dict[bytes, str] = {}
        for key, own, live in zip(keys, own_pids, self.live_partitions(keys)):
            other = next((pid for pid in live if pid != own), None)
            if other is not None and key not in found:
                found[key] = other
        return found

    def live_partitions(self, keys: Sequence[bytes]) -> list[list[str]]:
        """For each key, the held partitions that hold it as a live row, in partition order
        (per held partition: its key filter, then one RocksDB multi-get of the keys it may hold)."""
        found: list[list[str]] = [[] for _ in keys]
        if not len(keys):
            return found
        n = size(self._meta.width)
        key_hashes = hashes(keys)
        for pid in self._meta.partitions():
            maybe, raws = self._may_hold(pid, keys, key_hashes)
            for i, raw in zip(maybe.tolist(), raws):
                if raw is not None and not Entry.unpack(raw[:n]).deleted:
                    found[i].append(pid)
        return found

    def peek(self, pid: str, keys: Sequence[bytes], key_hashes: np.ndarray | None = None) -> list[bytes | None]:
        """Committed packed entries of `keys` in a held partition, from its key filter and
        RocksDB alone: the lookup counters and the memory tier are left alone. `key_hashes`:
        the keys' `hashes`, when the caller has them."""
        if not len(keys):
            return []
        return _spread(len(keys), *self._may_hold(pid, keys, key_hashes))

    def _may_hold(self, pid: str, keys: Sequence[bytes], key_hashes: np.ndarray | None = None
                  ) -> tuple[np.ndarray, list[bytes | None]]:
        """The positions of `keys` the keyspace's key filter may hold, and their committed
        packed entries from RocksDB (one multi-get)."""
        maybe = np.flatnonzero(self.filters.of(pid).may_contain(hashes(keys) if key_hashes is None else key_hashes))
        taken = _taken(keys, maybe)
        return maybe, self.cf(PARTITION_CF_PREFIX + pid).get(taken) if taken else []

    def is_empty(self, pid: str) -> bool:
        """Whether held partition `pid` has no entry (one iterator seek)."""
        entries = self.cf(PARTITION_CF_PREFIX + pid).iter()
        entries.seek_to_first()
        empty = not entries.valid()
        del entries  # an open iterator keeps RocksDB alive
        return empty

    def lookup(self, pid: str, keys: list[bytes]) -> list[Entry | None]:
        return [None if r is None else Entry.unpack(r) for r in self.lookup_packed(pid, keys)]

    def entries(self, pid: str):
        """Every committed (key, entry) of a held partition, in key order (RocksDB only)."""
        n = size(self._meta.width)
        for key, raw in self._raw_items(pid):
            yield key, Entry.unpack(raw[:n])

    def locations(self) -> dict[bytes, str]:
        """Global scope: every key's partition (RocksDB only)."""
        n = size(self._meta.width)
        return {key: raw[n:].decode() for key, raw in self._raw_items(GLOBAL)}

    def _raw_items(self, pid: str):
        yield from self.cf(PARTITION_CF_PREFIX + pid).items()

    # --- writes --------------------------------------------------------------------------------

    def put_packed(self, pid: str, keys: Sequence[bytes], raws: Sequence[bytes]) -> None:
        """Write committed entries into a held partition (and its key filter and memory tier)."""
        if not len(keys):
            return
        self.filters.of(pid).add(hashes(keys))
        handle = self._db.get_column_family_handle(PARTITION_CF_PREFIX + pid)
        for start in range(0, len(keys), WRITE_CHUNK):
            batch = WriteBatch(raw_mode=True)
            batch.set_default_column_family(handle)
            for key, raw in zip(keys[start:start + WRITE_CHUNK], raws[start:start + WRITE_CHUNK]):
                batch.put(key, raw)
            self._db.write(batch)
        self.tier.put_many(pid, keys, raws)
        self.filters.rescan_if_full(pid)

    def put_entries(self, pid: str, entries: Mapping[bytes, Entry]) -> None:
        self.put_packed(pid, list(entries), [e.pack() for e in entries.values()])

    def _scanned_filter(self, pid: str) -> KeyFilter:
        # A comprehension, not list(): the scan then lets other threads run (see WRITE_CHUNK).
        return KeyFilter.build(hashes([key for key in self.cf(PARTITION_CF_PREFIX + pid).keys()]))


def _taken(keys: Sequence[bytes], where: np.ndarray) -> list[bytes]:
    return list(keys) if len(where) == len(keys) else [keys[i] for i in where.tolist()]


def _spread(n: int, where: np.ndarray, answers: Sequence[bytes | None]) -> list[bytes | None]:
    """`answers` for the positions `where` of n keys, None at the others."""
    if len(where) == n:
        return list(answers)
    out: list[bytes | None] = [None] * n
    for i, raw in zip(where.tolist(), answers):
        out[i] = raw
    return out
