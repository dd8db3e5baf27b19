"""One shard's replica: a RocksDB directory with one column family per table partition.

In global scope (keys unique across the table) it has one keyspace instead, the column
family of `GLOBAL`, holding every key of the shard with the partition it lives in; it is
loaded (and invalidated) as a whole.

The `default` column family holds metadata: format, key spec, the Delta version the
replica reflects, the batch staged on top of it, and per-partition load records.
Entries a batch will change are staged apart (one Arrow blob under the batch id) until
the commit carrying that batch is seen in the Delta log; then they are promoted. The
memory tier answers before RocksDB: keyspaces looked up heavily are held whole in memory
(resident, up to a budget of keys per replica), and an in-process LRU keeps recently used
entries of the others.

Every keyspace (each partition's column family, or the global one) has a membership filter
of its keys (`sink.index.key_filter`) in memory, all saved in one file beside RocksDB at a
clean close under the close's token: a lookup asks it first, so the many new keys of a batch
skip RocksDB.

WAL is off (the replica is rebuildable from the table). A `dirty` flag, persisted
on open and cleared after a full flush on close, tells a replica left by a killed
process: it is wiped, since memtable contents were lost with it.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import shutil
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from rocksdict import (
    AccessType,
    BlockBasedOptions,
    Cache,
    DataBlockIndexType,
    Options,
    Rdict,
    SstFileWriter,
    WriteBatch,
    WriteOptions,
)

from sink.errors import ReplicaLockedError
from sink.index import holder
from sink.index.entry import (
    Entry,
    change_orderings,
    changes_schema,
    entries_of_changes,
    pack_array,
    pack_located_many,
    size,
    unpack_located_many,
)
from sink.index.hot_tier import HotTier, tier_for
from sink.index.key_filter import KeyFilter, hashes, read_saved, saved_bytes
from sink.index.resident import Resident
from sink.ordering import columns_of

log = logging.getLogger(__name__)

FORMAT_VERSION = "2"  # 2: deleted entries carry their delete's time
PARTITION_CF_PREFIX = "p:"
_META_FORMAT = b"format"
_META_SPEC = b"spec"
_META_VERSION = b"version"
_META_STAGED_BATCH = b"staged_batch"
_META_STAGED_DATA = b"staged_data"
_META_STAGED_READ = b"staged_read_version"  # the table version the staged batch was tagged against
_META_DIRTY = b"dirty"
_META_TOKEN = b"token"  # new at every clean close: tells a process its memory tier is current
_META_PART = b"part:"
_META_INVALIDATED = b"invalidated:"  # dropped by catch-up; its next load counts as caused by that
_META_PEEKED = b"peeked:"  # a partition not held, read for a batch's keys: how often since when
# The keyspaces' key filters, saved at a clean close (each valid under the token it names).
KEY_FILTER_FILE = "keys.filter"
# Written by an open that waits for the replica's lock: the worker keeping it open lets go.
RELEASE_FILE = "RELEASE"
# Lookups that reach RocksDB in one call below which a keyspace is never made resident.
RESIDENT_MIN_LOOKUPS = 256
# Above this many entries a partition load goes through an SST file and ingest.
_SST_THRESHOLD = 20_000
# Entries per RocksDB write of a promotion. A write holds the GIL throughout, and the driver
# promotes while its main thread collects the next batch, which needs the GIL back after
# every read of Spark's stream: smaller writes let it in sooner (an events batch at 1M rows,
# one process alternating: collect 0.164 -> 0.149 s).
WRITE_CHUNK = 4096


def changes_table(changes: Mapping[str, Mapping[bytes, Entry]], width: int = 1) -> pa.Table:
    """Staged changes as the Arrow table `stage` takes, from pid -> key -> entry."""
    schema = changes_schema(width)
    rows = [(pid, key, *e.values(), e.deleted, e.deleted_at) for pid, entries in changes.items()
            for key, e in entries.items()]
    return pa.Table.from_arrays([pa.array(c, t.type) for c, t in zip(zip(*rows), schema)]
                                if rows else [pa.array([], f.type) for f in schema], schema=schema)


def is_corruption(error: BaseException) -> bool:
    """RocksDB found the replica's files damaged (truncated SST, checksum mismatch, bad MANIFEST)."""
    return "Corruption" in str(error)


def wipe_damaged(path: Path, error: BaseException) -> str:
    """Delete a damaged replica (it rebuilds from the table); returns the reason, logged."""
    reason = str(error).splitlines()[0]
    log.warning("replica %s is damaged (%s): wiped, it rebuilds from the table", path, reason)
    kept = _KEPT_OPEN.pop(str(path), None)
    if kept is not None:
        kept._abandon()
    shutil.rmtree(path, ignore_errors=True)
    return reason


# The keyspace of a global-scope replica, in the place of a partition id.
GLOBAL = "*global"


def replica_spec(key_cols, partition_cols, ordering: str | Sequence[str], scope: str = "partitioned") -> str:
    """What a replica's entries mean; a replica of another spec is rebuilt."""
    columns = columns_of(ordering)
    spec = {"key": list(key_cols), "partition_by": list(partition_cols),
            "ordering": columns[0] if len(columns) == 1 else columns}
    if scope != "partitioned":  # partitioned replicas keep the spec they had before scopes
        spec["scope"] = scope
    return json.dumps(spec)


def ordering_width(spec: str | None) -> int:
    """Ordering columns of a spec's entries (1 for no spec yet)."""
    try:
        ordering = json.loads(spec).get("ordering")
    except (TypeError, ValueError, AttributeError):
        return 1
    return len(ordering) if isinstance(ordering, list) else 1


def is_global(spec: str | None) -> bool:
    try:
        return json.loads(spec).get("scope") == "global"
    except (TypeError, ValueError, AttributeError):  # no spec yet, or not one replica_spec wrote
        return False


def replica_path(index_root: str | os.PathLike[str], table_id: str, shard: int, num_shards: int) -> Path:
    return Path(index_root) / table_id / f"shard-{shard}-of-{num_shards}"


DEFAULT_BLOCK_CACHE_BYTES = 64 << 20
# Table files a replica keeps open (RocksDB's table cache); past it the least recently used close.
MAX_OPEN_FILES = 4096
READ_ONLY_OPEN_ATTEMPTS = 5
# One block cache per size, shared by every replica of the process (it must outlive them).
_BLOCK_CACHES: dict[int, Cache] = {}


def _options(block_cache_bytes: int = DEFAULT_BLOCK_CACHE_BYTES) -> Options:
    opts = Options(raw_mode=True)
    opts.create_if_missing(True)
    # Table files open on first read, not all at open: a tagging task on an executor opens its
    # replica for one batch and reads few of its ~60 column families' files (measured: the
    # open went from 0.085 to 0.043 s per shard, events at 1M rows).
    opts.set_max_open_files(MAX_OPEN_FILES)
    table = BlockBasedOptions()
    # Most lookups in event streams miss: a bloom filter answers those without I/O.
    table.set_bloom_filter(10, False)
    # Point lookups only: a hash index inside data blocks saves the binary search.
    table.set_data_block_index_type(DataBlockIndexType.binary_and_hash())
    if block_cache_bytes not in _BLOCK_CACHES:
        _BLOCK_CACHES[block_cache_bytes] = Cache(block_cache_bytes)
    table.set_block_cache(_BLOCK_CACHES[block_cache_bytes])
    opts.set_block_based_table_factory(table)
    return opts


@dataclass(frozen=True)
class PartitionInfo:
    loaded_entries: int
    loaded_at: float
    last_access: float
    reason: str


class ShardReplica:
    """An open shard replica. Use `ShardReplica.open(...)` as a context manager."""

    def __init__(self, path: Path, db: Rdict, read_only: bool = False, tier: HotTier | None = None,
                 block_cache_bytes: int = DEFAULT_BLOCK_CACHE_BYTES, pinned: PinnedDir | None = None):
        self.path = path
        # Where this open's files are: the directory it opened, even once `path` names another.
        self._pinned = pinned
        self._files = Path(pinned.db_path) if pinned is not None else path
        self._block_cache_bytes = block_cache_bytes
        self._db = db
        self._lock = threading.Lock()
        # Held by each use of a replica kept open, so that a checkpoint another thread makes
        # for a reader (sink.index.holder) never sees half a batch's writes.
        self.in_use = threading.Lock()
        self.read_only = read_only
        self.tier = tier or HotTier(0)
        self.repaired: str | None = None  # why the replica was found damaged and wiped on open
        self._located: bool | None = None
        self._width: int | None = None
        self._key_filters: dict[str, KeyFilter] = {}  # per keyspace, loaded or built on first use
        self._saved_filters: dict[str, bytes] | None = None  # the saved file's filters, read on first use
        # Column family handles, opened once per open replica: letting go of one whose memtable
        # holds writes flushes that memtable (~1.5 ms each, measured), which every lookup of a
        # partition the last batch wrote to would pay.
        self._cfs: dict[str, Rdict] = {}
        self._identity = _identity(self._files)
        self.flushed_at = time.monotonic()
        # Lookup counts of this open: distinct keys found in memory, in RocksDB, not found by
        # RocksDB, or not found by the keyspace's key filter.
        self.lookups = {"memory": 0, "rocksdb": 0, "miss": 0, "filter": 0}
        if not read_only:
            write_opts = WriteOptions()
            write_opts.disable_wal = True
            self._db.set_write_options(write_opts)

    @classmethod
    def open_read_only(cls, path: str | os.PathLike[str]) -> ShardReplica:
        """A read-only view, usable beside the process that holds the replica open. The open
        reads the MANIFEST, then the files it lists: the writer's compaction may delete one in
        between (RocksDB then reports a missing .sst), and a new open reads the new MANIFEST."""
        def one() -> ShardReplica:
            # Every table file opened at open: one the writer deletes afterwards stays readable.
            options = _options()
            options.set_max_open_files(-1)
            return cls(Path(path), Rdict(str(path), options, access_type=AccessType.read_only()), read_only=True)

        for _ in range(READ_ONLY_OPEN_ATTEMPTS - 1):
            try:
                return one()
            except Exception as e:
                if not _compacted_away(e):
                    raise
        return one()

    @property
    def spec(self) -> str | None:
        raw = self._db.get(_META_SPEC)
        return None if raw is None else raw.decode()

    @property
    def located(self) -> bool:
        """Global scope: one keyspace whose entries carry the key's partition."""
        if self._located is None:
            self._located = is_global(self.spec)
        return self._located

    @property
    def width(self) -> int:
        """Ordering columns per entry."""
        if self._width is None:
            self._width = ordering_width(self.spec)
        return self._width

    @property
    def clean(self) -> bool:
        """False while a process has it open, or after one died with it open."""
        return self._db.get(_META_DIRTY) != b"1"

    # --- lifecycle ---------------------------------------------------------------------------

    @classmethod
    def open(cls, path: str | os.PathLike[str], spec: str, lock_timeout_s: float = 60.0,
             hot_cache_entries: int = 0, block_cache_bytes: int = DEFAULT_BLOCK_CACHE_BYTES,
             resident_keys: int = 0) -> ShardReplica:
        """Open (or create) the replica at `path` for the given key spec.

        A replica of another format or key spec, one a killed process left dirty, or one
        whose files are damaged is wiped: it costs a reload, never correctness.
        """
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        repaired = None
        try:
            replica = cls._open_for(path, spec, lock_timeout_s, block_cache_bytes)
        except Exception as e:  # rocksdict raises a bare Exception
            if not is_corruption(e):
                raise
            repaired = wipe_damaged(path, e)
            replica = cls._open_for(path, spec, lock_timeout_s, block_cache_bytes)
        replica.tier = tier_for(str(path), hot_cache_entries, resident_keys, replica._db.get(_META_TOKEN))
        replica.mark_dirty()
        holder.record(path, time.time())
        replica.repaired = repaired
        return replica

    @classmethod
    def _open_for(cls, path: Path, spec: str, lock_timeout_s: float, block_cache_bytes: int) -> ShardReplica:
        """Open read-write; a replica not usable for `spec` is replaced by an empty one."""
        path.mkdir(parents=True, exist_ok=True)
        replica = cls._locked_open(path, lock_timeout_s, block_cache_bytes)
        try:
            usable = replica._usable(spec)
        except Exception:
            replica._close_db()  # frees RocksDB's lock on the path before the caller wipes it
            raise
        if not usable:
            replica._close_db()
            shutil.rmtree(path)
            path.mkdir(parents=True)
            replica = cls._locked_open(path, lock_timeout_s, block_cache_bytes)
            replica._db[_META_FORMAT] = FORMAT_VERSION.encode()
            replica._db[_META_SPEC] = spec.encode()
        return replica

    @classmethod
    def _locked_open(cls, path: Path, lock_timeout_s: float, block_cache_bytes: int) -> ShardReplica:
        db, pinned = _open_locked(path, lock_timeout_s, block_cache_bytes)
        return cls(path, db, block_cache_bytes=block_cache_bytes, pinned=pinned)

    def _usable(self, spec: str) -> bool:
        db = self._db
        return (
            db.get(_META_FORMAT) == FORMAT_VERSION.encode()
            and db.get(_META_SPEC) == spec.encode()
            and db.get(_META_DIRTY) != b"1"
        )

    def flush(self) -> None:
        """Write every column family's memtable to disk (the WAL is off)."""
        for name in self._cf_names():
            if name != "default":
                self._cf(name).flush()
        self._db.flush()
        self.flushed_at = time.monotonic()

    def _cf(self, name: str) -> Rdict:
        cf = self._cfs.get(name)
        if cf is None:
            cf = self._cfs[name] = self._db.get_column_family(name)
        return cf

    def close(self) -> None:
        """Flush every column family, then mark the replica clean (unless a checkpoint since
        its last write did)."""
        if not self.read_only and not self.clean:
            self.checkpoint()
        if not self.read_only and not self.replaced():
            holder.forget(self.path)
        self._close_db()

    def checkpoint(self) -> None:
        """What a close saves, the handle kept open: every column family flushed, the key
        filters saved, the replica marked clean. The next write needs `mark_dirty` first."""
        self.flush()
        token = os.urandom(8)
        self._save_key_filters(token)
        self._db[_META_TOKEN] = token
        self._db[_META_DIRTY] = b"0"
        self._db.flush()
        self.tier.token = token

    def mark_dirty(self) -> None:
        """Mark the replica in use (the WAL is off: a process that dies now leaves it dirty)."""
        self._db[_META_DIRTY] = b"1"
        self._db.flush()

    # --- kept open by one process --------------------------------------------------------

    @classmethod
    def acquire(cls, path: str | os.PathLike[str], spec: str, **options) -> ShardReplica:
        """The replica at `path`, kept open for this process across calls (tagging on the
        driver, or in a reused worker: sink.index.worker_replicas). Reopened when its
        directory was removed. A use holds `in_use`: `kept` does both."""
        key = str(path)
        replica = _KEPT_OPEN.get(key)
        if replica is not None and replica.replaced():
            replica._abandon()
            replica = None
        if replica is None:
            if not _KEPT_OPEN:
                atexit.register(close_kept_open)
                holder.answer_requests(lambda: list(_KEPT_OPEN.values()))
            replica = _KEPT_OPEN[key] = cls.open(path, spec, **options)
        elif replica.spec != spec:
            with replica.in_use:
                replica.close()
            replica = _KEPT_OPEN[key] = cls.open(path, spec, **options)
        else:
            replica.repaired = None  # a repair at its open was reported by the use that opened it
        replica.lookups = dict.fromkeys(replica.lookups, 0)
        return replica

    @classmethod
    @contextmanager
    def kept(cls, path: str | os.PathLike[str], spec: str, **options) -> Iterator[ShardReplica]:
        """One use of the replica `acquire` keeps open, holding its `in_use` lock."""
        replica = cls.acquire(path, spec, **options)
        with replica.in_use:
            if replica.clean:  # checkpointed since its last use: in use again
                replica.mark_dirty()
            yield replica

    def replaced(self) -> bool:
        """Whether its directory no longer holds this open database: removed, or another one
        made in its place (a replica lost and rebuilt by another process)."""
        return _identity(self.path) != self._identity

    def _abandon(self) -> None:
        """Let go of a replica whose directory was removed or replaced, or that cannot be closed
        cleanly: nothing of it can be saved. The handle is closed all the same (RocksDB's lock
        on the path is per process)."""
        _KEPT_OPEN.pop(str(self.path), None)
        self.tier.clear()
        try:
            self._close_db()
        except Exception:  # writing into a removed directory fails; the handle goes all the same
            pass

    def _close_db(self) -> None:
        self._cfs.clear()  # open handles would keep RocksDB (and its lock) alive
        try:
            self._db.close()
        finally:
            if self._pinned is not None:
                self._pinned.release()

    def __enter__(self) -> ShardReplica:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc is None:
            self.close()
            return
        try:  # the error in flight is the one to report, not a second one from closing
            self.close()
        except Exception:
            self._abandon()

    # --- version and staging metadata ----------------------------------------------------------

    @property
    def version(self) -> int | None:
        raw = self._db.get(_META_VERSION)
        return None if raw is None else int(raw)

    def set_version(self, version: int) -> None:
        self._db[_META_VERSION] = str(version).encode()

    @property
    def staged_batch(self) -> int | None:
        raw = self._db.get(_META_STAGED_BATCH)
        return None if raw is None else int(raw)

    @property
    def staged_read_version(self) -> int | None:
        raw = self._db.get(_META_STAGED_READ)
        return None if raw is None else int(raw)

    # --- partitions --------------------------------------------------------------------------

    def partitions(self) -> dict[str, PartitionInfo]:
        """The partitions held, complete ones only."""
        out = {}
        for key, raw in self._db.items(from_key=_META_PART):
            if not key.startswith(_META_PART):
                break
            rec = json.loads(raw)
            out[key[len(_META_PART):].decode()] = PartitionInfo(**rec)
        return out

    def has_partition(self, pid: str) -> bool:
        return self._db.get(_META_PART + pid.encode()) is not None

    def was_invalidated(self, pid: str) -> bool:
        """Dropped by catch-up (a commit changed it) and not loaded since."""
        return self._db.get(_META_INVALIDATED + pid.encode()) is not None

    def record_peek(self, pid: str, now: float, window_s: float) -> int:
        """Note that partition `pid`, not held, is read for a batch's keys at `now`; returns how
        many such reads (this one included) it had within `window_s` of the first. Its load
        forgets them."""
        meta_key = _META_PEEKED + pid.encode()
        raw = self._db.get(meta_key)
        rec = json.loads(raw) if raw is not None else None
        if rec is None or now - rec["since"] > window_s:
            rec = {"since": now, "count": 0}
        rec["count"] += 1
        self._db[meta_key] = json.dumps(rec).encode()
        return rec["count"]

    def load_partition(
        self, pid: str, keys: list[bytes], entries: list[Entry], reason: str, now: float | None = None
    ) -> None:
        self.load_packed(pid, keys, [e.pack() for e in entries], reason, now)

    def load_packed(
        self, pid: str, keys: Sequence[bytes], raws: Sequence[bytes], reason: str, now: float | None = None
    ) -> None:
        """Replace partition `pid` with exactly these entries; visible only once complete."""
        self.load_chunks(pid, [(keys, raws)], reason, now)

    def load_chunks(
        self, pid: str, chunks: Iterable[tuple[Sequence[bytes], Sequence[bytes]]], reason: str,
        now: float | None = None,
    ) -> int:
        """Replace partition `pid` with the entries of every (keys, raws) chunk, written one
        chunk at a time (chunks hold distinct keys); visible only once complete. Returns the
        number of entries."""
        now = time.time() if now is None else now
        with self._lock:
            self.drop_partition(pid)
            cf_name = PARTITION_CF_PREFIX + pid
            cf = self._cfs[cf_name] = self._db.create_column_family(cf_name, _options(self._block_cache_bytes))
            loaded, key_hashes = 0, [np.zeros(0, np.uint64)]
            try:
                for keys, raws in chunks:
                    if len(keys) >= _SST_THRESHOLD:
                        self._ingest_sorted(cf, keys, raws)
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
            self._key_filters[pid] = KeyFilter.build(np.concatenate(key_hashes))
            info = PartitionInfo(loaded_entries=loaded, loaded_at=now, last_access=now, reason=reason)
            self._db[_META_PART + pid.encode()] = json.dumps(info.__dict__).encode()
            self._delete_meta(_META_INVALIDATED + pid.encode())
            self._delete_meta(_META_PEEKED + pid.encode())
        return loaded

    def _ingest_sorted(self, cf: Rdict, keys: Sequence[bytes], raws: Sequence[bytes]) -> None:
        order = pc.sort_indices(pa.array(keys, pa.binary())).to_numpy()
        sst = self._files / f"ingest-{os.getpid()}-{threading.get_ident()}.sst"
        writer = SstFileWriter(_options(self._block_cache_bytes))
        writer.open(str(sst))
        for i in order.tolist():
            writer[keys[i]] = raws[i]
        writer.finish()
        try:
            cf.ingest_external_file([str(sst)])
        finally:
            sst.unlink(missing_ok=True)

    def drop_partition(self, pid: str, invalidated: bool = False) -> None:
        """Forget partition `pid`; `invalidated`: because a commit changed it (counted when
        it loads again)."""
        self.tier.drop_partition(pid)
        self._forget_key_filter(pid)
        self._delete_meta(_META_PART + pid.encode())
        if invalidated:
            self._db[_META_INVALIDATED + pid.encode()] = b"1"
        self._cfs.pop(PARTITION_CF_PREFIX + pid, None)
        if PARTITION_CF_PREFIX + pid in self._cf_names():
            self._db.drop_column_family(PARTITION_CF_PREFIX + pid)

    def drop_all(self) -> None:
        """Forget every partition and staged entry (the replica then reloads on demand)."""
        self.tier.clear()
        self._key_filters.clear()
        self._saved_filters = {}
        for name in self._cf_names():
            if name.startswith(PARTITION_CF_PREFIX):
                self._cfs.pop(name, None)
                self._db.drop_column_family(name)
        for prefix in (_META_PART, _META_INVALIDATED, _META_PEEKED):
            for key in [k for k, _ in self._db.items(from_key=prefix) if k.startswith(prefix)]:
                del self._db[key]
        self.discard_staged()

    def _delete_meta(self, key: bytes) -> None:
        if self._db.get(key) is not None:
            del self._db[key]

    def partition_sizes(self) -> dict[str, tuple[int, int]]:
        """Per held partition: (entries, bytes on disk and in memory), RocksDB's estimates."""
        out = {}
        for pid in self.partitions():
            cf = self._cf(PARTITION_CF_PREFIX + pid)
            entries = cf.property_int_value("rocksdb.estimate-num-keys") or 0
            size = (cf.property_int_value("rocksdb.total-sst-files-size") or 0) + (
                cf.property_int_value("rocksdb.cur-size-all-mem-tables") or 0)
            out[pid] = (entries, size)
        return out

    def reader_memory_bytes(self) -> int:
        """Memory RocksDB holds outside the block cache for this replica's files: their bloom
        filters and index blocks."""
        total = 0
        for name in self._cf_names():
            total += self._cf(name).property_int_value("rocksdb.estimate-table-readers-mem") or 0
        return total

    def touch(self, pids: Iterable[str], now: float | None = None) -> None:
        now = time.time() if now is None else now
        for pid in pids:
            meta_key = _META_PART + pid.encode()
            raw = self._db.get(meta_key)
            if raw is not None:
                rec = json.loads(raw)
                rec["last_access"] = now
                self._db[meta_key] = json.dumps(rec).encode()

    def _cf_names(self) -> list[str]:
        return Rdict.list_cf(str(self._files), _options())

    # --- lookups -----------------------------------------------------------------------------

    def lookup_packed(self, pid: str, keys: Sequence[bytes]) -> list[bytes | None]:
        """Committed packed entries of `keys` in a held partition: the keyspace's key filter
        first, then the memory tier, then one RocksDB multi-get for the rest (staged entries
        are not visible)."""
        if not len(keys):
            return []
        key_hashes = hashes(keys)
        maybe = np.flatnonzero(self._key_filter(pid).may_contain(key_hashes))
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
            fetched = self._cf(PARTITION_CF_PREFIX + pid).get([keys[i] for i in todo])
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
        estimate = self._key_filter(pid).keys
        if reached_rocksdb >= max(RESIDENT_MIN_LOOKUPS, estimate // 64, written / 2) and self.tier.room_for(estimate):
            self.tier.wanted.add(pid)

    def hold_wanted(self) -> None:
        """Hold whole the keyspaces lookups asked for, where they still fit. Called once the
        replica has caught up, before a batch's lookups: with driver tagging while the batch is
        collected, so the scans (~0.05 s for 80k entries) are not tagging's to wait for."""
        for pid in sorted(self.tier.wanted):
            self.tier.wanted.discard(pid)
            if not self.has_partition(pid) or pid in self.tier.resident:
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
        n = size(self.width)
        key_hashes = hashes(keys)
        for pid in self.partitions():
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
        maybe = np.flatnonzero(self._key_filter(pid).may_contain(hashes(keys) if key_hashes is None else key_hashes))
        taken = _taken(keys, maybe)
        return maybe, self._cf(PARTITION_CF_PREFIX + pid).get(taken) if taken else []

    def is_empty(self, pid: str) -> bool:
        """Whether held partition `pid` has no entry (one iterator seek)."""
        entries = self._cf(PARTITION_CF_PREFIX + pid).iter()
        entries.seek_to_first()
        empty = not entries.valid()
        del entries  # an open iterator keeps RocksDB alive
        return empty

    def lookup(self, pid: str, keys: list[bytes]) -> list[Entry | None]:
        return [None if r is None else Entry.unpack(r) for r in self.lookup_packed(pid, keys)]

    def entries(self, pid: str):
        """Every committed (key, entry) of a held partition, in key order (RocksDB only)."""
        n = size(self.width)
        for key, raw in self._raw_items(pid):
            yield key, Entry.unpack(raw[:n])

    def locations(self) -> dict[bytes, str]:
        """Global scope: every key's partition (RocksDB only)."""
        n = size(self.width)
        return {key: raw[n:].decode() for key, raw in self._raw_items(GLOBAL)}

    def _raw_items(self, pid: str):
        yield from self._cf(PARTITION_CF_PREFIX + pid).items()

    def put_packed(self, pid: str, keys: Sequence[bytes], raws: Sequence[bytes]) -> None:
        """Write committed entries into a held partition (and its key filter and memory tier)."""
        if not len(keys):
            return
        self._key_filter(pid).add(hashes(keys))
        handle = self._db.get_column_family_handle(PARTITION_CF_PREFIX + pid)
        for start in range(0, len(keys), WRITE_CHUNK):
            batch = WriteBatch(raw_mode=True)
            batch.set_default_column_family(handle)
            for key, raw in zip(keys[start:start + WRITE_CHUNK], raws[start:start + WRITE_CHUNK]):
                batch.put(key, raw)
            self._db.write(batch)
        self.tier.put_many(pid, keys, raws)
        if self._key_filters[pid].full:
            self._key_filters[pid] = self._scanned_key_filter(pid)

    # --- the keyspaces' key filters ------------------------------------------------------------

    def _key_filter(self, pid: str) -> KeyFilter:
        """The filter of every key of held keyspace `pid`: built at its load and kept in step
        with every write; after a reopen, the one saved at the last clean close if the replica
        still carries that close's token, else built by a scan of the keyspace."""
        kept = self._key_filters.get(pid)
        if kept is None:
            kept = self._key_filters[pid] = self._saved_key_filter(pid) or self._scanned_key_filter(pid)
        return kept

    def _saved_key_filter(self, pid: str) -> KeyFilter | None:
        if self.read_only and not self.clean:
            return None  # a process has it open: its keys may have changed since the last close
        if self._saved_filters is None:
            try:
                self._saved_filters = read_saved((self._files / KEY_FILTER_FILE).read_bytes())
            except FileNotFoundError:
                self._saved_filters = {}
        token, raw = self._db.get(_META_TOKEN), self._saved_filters.get(pid)
        return None if token is None or raw is None else KeyFilter.from_bytes(raw, token)

    def _scanned_key_filter(self, pid: str) -> KeyFilter:
        # A comprehension, not list(): the scan then lets other threads run (see WRITE_CHUNK).
        built = KeyFilter.build(hashes([key for key in self._cf(PARTITION_CF_PREFIX + pid).keys()]))
        # A growing partition's filter is rebuilt each time its keys double: worth a line only
        # for the global keyspace, whose scans take seconds.
        log.log(logging.INFO if pid == GLOBAL else logging.DEBUG, "replica %s: key filter of %s built from its %d keys",
                self.path, pid, built.keys)
        return built

    def key_filter_bytes(self) -> int:
        """Memory of the held keyspaces' key filters."""
        return sum(self._key_filter(pid).nbytes for pid in self.partitions())

    def _save_key_filters(self, token: bytes) -> None:
        """Save the held keyspaces' filters under the token the close is about to write
        (re-stamping the saved ones this open did not use)."""
        path = self._files / KEY_FILTER_FILE
        filters = {pid: self._key_filters.get(pid) or self._saved_key_filter(pid) for pid in self.partitions()}
        part = path.with_suffix(".part")
        part.write_bytes(saved_bytes({pid: f.to_bytes(token) for pid, f in filters.items() if f is not None}))
        os.replace(part, path)

    def _forget_key_filter(self, pid: str) -> None:
        """A keyspace dropped: its filter goes (a reload builds a new one)."""
        self._key_filters.pop(pid, None)
        if self._saved_filters is not None:
            self._saved_filters.pop(pid, None)

    def put_entries(self, pid: str, entries: Mapping[bytes, Entry]) -> None:
        self.put_packed(pid, list(entries), [e.pack() for e in entries.values()])

    # --- staging -----------------------------------------------------------------------------

    def stage(self, batch_id: int, changes: pa.Table | Mapping[str, Mapping[bytes, Entry]],
              read_version: int | None = None) -> None:
        """Record what `batch_id`, tagged against table version `read_version`, changes
        (`changes_schema` rows), replacing what was staged before."""
        schema = changes_schema(self.width)
        if not isinstance(changes, pa.Table):
            changes = changes_table(changes, self.width)
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, schema) as writer:
            writer.write_table(changes.cast(schema))
        self._db[_META_STAGED_DATA] = sink.getvalue().to_pybytes()
        self._db[_META_STAGED_BATCH] = str(batch_id).encode()
        if read_version is None:
            self._delete_meta(_META_STAGED_READ)
        else:
            self._db[_META_STAGED_READ] = str(read_version).encode()

    def _staged_table(self) -> pa.Table | None:
        raw = self._db.get(_META_STAGED_DATA)
        return None if raw is None else pa.ipc.open_stream(raw).read_all()

    def staged(self) -> dict[str, dict[bytes, Entry]]:
        table = self._staged_table()
        return {} if table is None else entries_of_changes(table)

    def promote_staged(self) -> int:
        """Move staged entries into the committed view. Returns entries promoted."""
        table = self._staged_table()
        promoted = 0 if table is None else self.apply_changes(table)
        self.discard_staged()
        return promoted

    def apply_changes(self, changes: pa.Table) -> int:
        """Write committed entries (`changes_schema` rows) into the partitions held; others are
        skipped (they load from the table, which already has the commit). Returns entries written."""
        if not changes.num_rows:
            return 0
        if self.located:
            if not self.has_partition(GLOBAL):
                return 0
            raws = pack_located_many(change_orderings(changes), changes.column("deleted").to_numpy(False),
                                     changes.column("pid").combine_chunks(), _deleted_at(changes))
            self.put_packed(GLOBAL, changes.column("key").to_pylist(), raws)
            return changes.num_rows
        # One sort by partition, then each held partition's rows are one slice.
        encoded = pc.dictionary_encode(changes.column("pid")).combine_chunks()
        codes = encoded.indices.to_numpy()
        order = np.argsort(codes, kind="stable")
        bounds = [0, *(np.flatnonzero(np.diff(codes[order])) + 1).tolist(), len(order)]
        rows = changes.take(pa.array(order))
        keys = rows.column("key").combine_chunks()
        raws = pack_array(change_orderings(rows), rows.column("deleted").to_numpy(False), _deleted_at(rows))
        applied = 0
        for start, end in zip(bounds[:-1], bounds[1:]):
            pid = encoded.dictionary[codes[order[start]]].as_py()
            if self.has_partition(pid):
                self.put_packed(pid, keys.slice(start, end - start).to_pylist(),
                                raws.slice(start, end - start).to_pylist())
                applied += end - start
        return applied

    def held_of(self, pids: Iterable[str]) -> list[str]:
        """The keyspaces holding entries of these table partitions: the held ones among them,
        or in global scope the one keyspace (if held and any partition is named)."""
        if self.located:
            return [GLOBAL] if self.has_partition(GLOBAL) and any(True for _ in pids) else []
        return [pid for pid in pids if self.has_partition(pid)]

    def put_changes(self, changes: Mapping[str, Mapping[bytes, Entry]]) -> int:
        """Write another writer's row-level changes (partition -> key -> entry) into the held
        keyspaces. In global scope a delete applies only where the index places the key: a
        key the same commit moved keeps its new partition. Returns entries written."""
        if not self.located:
            written = 0
            for pid in self.held_of(changes):
                if changes[pid]:
                    self.put_entries(pid, changes[pid])
                    written += len(changes[pid])
            return written
        if not self.has_partition(GLOBAL):
            return 0
        upserts = {k: (pid, e) for pid, entries in changes.items() for k, e in entries.items() if not e.deleted}
        deletes = {k: (pid, e) for pid, entries in changes.items() for k, e in entries.items()
                   if e.deleted and k not in upserts}
        if deletes:
            *_, where = unpack_located_many(self.peek(GLOBAL, list(deletes)), self.width)  # not counted
            deletes = {k: v for (k, v), loc in zip(deletes.items(), where) if loc is None or loc == v[0]}
        chosen = {**upserts, **deletes}
        if chosen:
            raws = pack_located_many([e.values() for _, e in chosen.values()], [e.deleted for _, e in chosen.values()],
                                     [pid for pid, _ in chosen.values()], [e.deleted_at for _, e in chosen.values()])
            self.put_packed(GLOBAL, list(chosen), raws)
        return len(chosen)

    def discard_staged(self) -> None:
        for key in (_META_STAGED_DATA, _META_STAGED_BATCH, _META_STAGED_READ):
            self._delete_meta(key)


def _compacted_away(error: Exception) -> bool:
    """RocksDB's error for a table file listed in the MANIFEST and deleted since."""
    text = str(error)
    return ".sst" in text and "No such file or directory" in text


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


def _deleted_at(changes: pa.Table):
    return pc.fill_null(changes.column("deleted_at"), 0).to_numpy()


_KEPT_OPEN: dict[str, ShardReplica] = {}


def _identity(path: Path) -> bytes | None:
    """The database's id RocksDB wrote when it made the directory's database."""
    try:
        return (path / "IDENTITY").read_bytes()
    except FileNotFoundError:
        return None


def is_kept_open(path: str | os.PathLike[str]) -> bool:
    """Whether this process keeps the replica at `path` open (`acquire`)."""
    return kept_open(path) is not None


def kept_open(path: str | os.PathLike[str]) -> ShardReplica | None:
    """The replica at `path` if this process keeps it open (`acquire`)."""
    return _KEPT_OPEN.get(str(path))


def close_kept_open(under: Path | None = None) -> None:
    """Close the replicas `acquire` kept open (all of them at exit, so they are found clean
    next time; or those under one directory). One whose directory is gone, or that fails to
    close, is let go: it is wiped on its next open, which costs a reload, never correctness."""
    for replica in list(_KEPT_OPEN.values()):
        if under is not None and not replica.path.is_relative_to(under):
            continue
        _KEPT_OPEN.pop(str(replica.path), None)
        if replica.replaced():
            replica._abandon()
            continue
        try:
            with replica.in_use:
                replica.close()
        except Exception as e:
            log.warning("replica %s could not be closed cleanly (%s); it rebuilds on its next open",
                        replica.path, str(e).splitlines()[0])
            replica._abandon()


# Linux names an open descriptor's file: RocksDB reaches a pinned directory through it.
_PROC_FD = os.path.isdir("/proc/self/fd")


class HeldHere(Exception):
    """The directory is open read-write in this process already."""


class PinnedDir:
    """A replica's directory held open for one read-write open of it. RocksDB reaches its
    files through the descriptor (/proc/self/fd on Linux), so an open whose directory was
    removed writes nothing into one made in its place: a dirty replica's flush at close wrote
    its table files, a MANIFEST and a CURRENT naming it into the new replica, which then
    listed column families its own open lacked. One read-write open per directory per
    process, as RocksDB's lock was per path name and process."""

    _held: set[tuple[int, int]] = set()
    _held_lock = threading.Lock()

    def __init__(self, path: Path):
        self.fd: int | None = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        stat = os.fstat(self.fd)
        self._id = (stat.st_dev, stat.st_ino)
        with PinnedDir._held_lock:
            taken = self._id in PinnedDir._held
            PinnedDir._held.add(self._id)
        if taken:
            os.close(self.fd)
            self.fd = None
            raise HeldHere(f"replica {path} is open read-write in this process already")
        self.db_path = f"/proc/self/fd/{self.fd}" if _PROC_FD else str(path)

    def release(self) -> None:
        if self.fd is None:
            return
        with PinnedDir._held_lock:
            PinnedDir._held.discard(self._id)
        os.close(self.fd)
        self.fd = None


def _open_locked(path: Path, timeout_s: float,
                 block_cache_bytes: int = DEFAULT_BLOCK_CACHE_BYTES) -> tuple[Rdict, PinnedDir]:
    """Open read-write, waiting for another process's lock to go (a retried task, or a worker
    that keeps the replica open, which RELEASE_FILE asks to let go)."""
    deadline = time.monotonic() + timeout_s
    delay = 0.02
    while True:
        try:
            pinned = PinnedDir(path)
            try:
                db = Rdict(pinned.db_path, _options(block_cache_bytes))
            except BaseException:
                pinned.release()
                raise
            # Ours now: a request left by this open (or by one before, whose holder died) is
            # answered; one that arrives later is written again by its waiting open.
            (path / RELEASE_FILE).unlink(missing_ok=True)
            return db, pinned
        except Exception as e:  # rocksdict raises a bare Exception for IO errors
            here = isinstance(e, HeldHere)
            if not here and "lock" not in str(e).lower():
                raise
            if time.monotonic() >= deadline:
                holder = "this process (another open of it)" if here else "another process"
                raise ReplicaLockedError(f"replica {path} is locked by {holder} for over {timeout_s:.0f}s") from e
            (path / RELEASE_FILE).touch()
            time.sleep(delay)
            delay = min(delay * 2, 0.5)
