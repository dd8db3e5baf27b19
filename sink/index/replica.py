"""One shard's replica: a RocksDB directory with one column family per table partition.

The `default` column family holds metadata: format, key spec, the Delta version the
replica reflects, the batch staged on top of it, and per-partition load records.
Entries a batch will change are staged apart (column family `_staged`) until the
commit carrying that batch is seen in the Delta log; then they are promoted.

WAL is off (the replica is rebuildable from the table). A `dirty` flag, persisted
on open and cleared after a full flush on close, tells a replica left by a killed
process: it is wiped, since memtable contents were lost with it.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from rocksdict import (
    AccessType,
    BlockBasedOptions,
    Options,
    Rdict,
    SstFileWriter,
    WriteBatch,
    WriteOptions,
)

from sink.errors import ReplicaLockedError
from sink.index.entry import Entry

FORMAT_VERSION = "1"
PARTITION_CF_PREFIX = "p:"
STAGED_CF = "_staged"
_SEP = b"\x00"  # partition id / key separator in staged keys; partition ids never hold NUL
_META_FORMAT = b"format"
_META_SPEC = b"spec"
_META_VERSION = b"version"
_META_STAGED_BATCH = b"staged_batch"
_META_DIRTY = b"dirty"
_META_PART = b"part:"
# Above this many entries a partition load goes through an SST file and ingest.
_SST_THRESHOLD = 20_000


def replica_spec(key_cols, partition_cols, ordering: str) -> str:
    """What a replica's entries mean; a replica of another spec is rebuilt."""
    return json.dumps({"key": list(key_cols), "partition_by": list(partition_cols), "ordering": ordering})


def replica_path(index_root: str | os.PathLike[str], table_id: str, shard: int, num_shards: int) -> Path:
    return Path(index_root) / table_id / f"shard-{shard}-of-{num_shards}"


def _options() -> Options:
    opts = Options(raw_mode=True)
    opts.create_if_missing(True)
    table = BlockBasedOptions()
    # Most lookups in event streams miss: a bloom filter answers those without I/O.
    table.set_bloom_filter(10, False)
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

    def __init__(self, path: Path, db: Rdict, read_only: bool = False):
        self.path = path
        self._db = db
        self._lock = threading.Lock()
        self.read_only = read_only
        if not read_only:
            write_opts = WriteOptions()
            write_opts.disable_wal = True
            self._db.set_write_options(write_opts)

    @classmethod
    def open_read_only(cls, path: str | os.PathLike[str]) -> ShardReplica:
        """A read-only view, usable beside the process that holds the replica open."""
        return cls(Path(path), Rdict(str(path), _options(), access_type=AccessType.read_only()), read_only=True)

    @property
    def spec(self) -> str | None:
        raw = self._db.get(_META_SPEC)
        return None if raw is None else raw.decode()

    @property
    def clean(self) -> bool:
        """False while a process has it open, or after one died with it open."""
        return self._db.get(_META_DIRTY) != b"1"

    # --- lifecycle ---------------------------------------------------------------------------

    @classmethod
    def open(cls, path: str | os.PathLike[str], spec: str, lock_timeout_s: float = 60.0) -> ShardReplica:
        """Open (or create) the replica at `path` for the given key spec.

        A replica of another format or key spec, or one a killed process left dirty,
        is wiped: it costs a reload, never correctness.
        """
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        db = _open_locked(path, lock_timeout_s)
        replica = cls(path, db)
        if not replica._usable(spec):
            replica._close_db()
            shutil.rmtree(path)
            path.mkdir(parents=True)
            replica = cls(path, _open_locked(path, lock_timeout_s))
            replica._db[_META_FORMAT] = FORMAT_VERSION.encode()
            replica._db[_META_SPEC] = spec.encode()
        replica._db[_META_DIRTY] = b"1"
        replica._db.flush()
        return replica

    def _usable(self, spec: str) -> bool:
        db = self._db
        return (
            db.get(_META_FORMAT) == FORMAT_VERSION.encode()
            and db.get(_META_SPEC) == spec.encode()
            and db.get(_META_DIRTY) != b"1"
        )

    def close(self) -> None:
        """Flush every column family, then mark the replica clean."""
        if self.read_only:
            self._close_db()
            return
        for name in Rdict.list_cf(str(self.path), _options()):
            if name != "default":
                cf = self._db.get_column_family(name)
                cf.flush()
                del cf
        self._db[_META_DIRTY] = b"0"
        self._db.flush()
        self._close_db()

    def _close_db(self) -> None:
        self._db.close()

    def __enter__(self) -> ShardReplica:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close()

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

    def load_partition(
        self, pid: str, keys: list[bytes], entries: list[Entry], reason: str, now: float | None = None
    ) -> None:
        """Replace partition `pid` with exactly these entries; visible only once complete."""
        now = time.time() if now is None else now
        with self._lock:
            self.drop_partition(pid)
            cf_name = PARTITION_CF_PREFIX + pid
            cf = self._db.create_column_family(cf_name, _options())
            try:
                if len(keys) >= _SST_THRESHOLD:
                    self._ingest_sorted(cf, keys, entries)
                elif keys:
                    batch = WriteBatch(raw_mode=True)
                    batch.set_default_column_family(self._db.get_column_family_handle(cf_name))
                    for k, e in zip(keys, entries):
                        batch.put(k, e.pack())
                    self._db.write(batch)
            finally:
                del cf
            info = PartitionInfo(loaded_entries=len(keys), loaded_at=now, last_access=now, reason=reason)
            self._db[_META_PART + pid.encode()] = json.dumps(info.__dict__).encode()

    def _ingest_sorted(self, cf: Rdict, keys: list[bytes], entries: list[Entry]) -> None:
        order = sorted(range(len(keys)), key=keys.__getitem__)
        sst = self.path / f"ingest-{os.getpid()}-{threading.get_ident()}.sst"
        writer = SstFileWriter(_options())
        writer.open(str(sst))
        for i in order:
            writer[keys[i]] = entries[i].pack()
        writer.finish()
        try:
            cf.ingest_external_file([str(sst)])
        finally:
            sst.unlink(missing_ok=True)

    def drop_partition(self, pid: str) -> None:
        meta_key = _META_PART + pid.encode()
        if self._db.get(meta_key) is not None:
            del self._db[meta_key]
        if PARTITION_CF_PREFIX + pid in self._cf_names():
            self._db.drop_column_family(PARTITION_CF_PREFIX + pid)

    def drop_all(self) -> None:
        """Forget every partition and staged entry (the replica then reloads on demand)."""
        for name in self._cf_names():
            if name.startswith(PARTITION_CF_PREFIX) or name == STAGED_CF:
                self._db.drop_column_family(name)
        for key in [k for k, _ in self._db.items(from_key=_META_PART) if k.startswith(_META_PART)]:
            del self._db[key]
        if self._db.get(_META_STAGED_BATCH) is not None:
            del self._db[_META_STAGED_BATCH]

    def partition_sizes(self) -> dict[str, tuple[int, int]]:
        """Per held partition: (entries, bytes on disk and in memory), RocksDB's estimates."""
        out = {}
        for pid in self.partitions():
            cf = self._db.get_column_family(PARTITION_CF_PREFIX + pid)
            try:
                entries = cf.property_int_value("rocksdb.estimate-num-keys") or 0
                size = (cf.property_int_value("rocksdb.total-sst-files-size") or 0) + (
                    cf.property_int_value("rocksdb.cur-size-all-mem-tables") or 0)
            finally:
                del cf
            out[pid] = (entries, size)
        return out

    def touch(self, pids: Iterable[str], now: float | None = None) -> None:
        now = time.time() if now is None else now
        for pid in pids:
            meta_key = _META_PART + pid.encode()
            raw = self._db.get(meta_key)
            if raw is not None:
                rec = json.loads(raw)
                rec["last_access"] = now
                self._db[meta_key] = json.dumps(rec).encode()

    def entries(self, pid: str):
        """Every committed (key, entry) of a held partition, in key order."""
        cf = self._db.get_column_family(PARTITION_CF_PREFIX + pid)
        try:
            for key, raw in cf.items():
                yield key, Entry.unpack(raw)
        finally:
            del cf

    def _cf_names(self) -> list[str]:
        return Rdict.list_cf(str(self.path), _options())

    # --- lookups -----------------------------------------------------------------------------

    def lookup(self, pid: str, keys: list[bytes]) -> list[Entry | None]:
        """Committed entries of `keys` in a held partition (staged entries are not visible)."""
        if not keys:
            return []
        cf = self._db.get_column_family(PARTITION_CF_PREFIX + pid)
        try:
            raws = cf.get(keys)
        finally:
            del cf
        return [None if r is None else Entry.unpack(r) for r in raws]

    # --- staging -----------------------------------------------------------------------------

    def stage(self, batch_id: int, changes: Mapping[str, Mapping[bytes, Entry]]) -> None:
        """Record what `batch_id` changes, replacing whatever was staged before."""
        self.discard_staged()
        cf = self._db.create_column_family(STAGED_CF, _options())
        del cf
        batch = WriteBatch(raw_mode=True)
        batch.set_default_column_family(self._db.get_column_family_handle(STAGED_CF))
        for pid, entries in changes.items():
            prefix = pid.encode() + _SEP
            for key, entry in entries.items():
                batch.put(prefix + key, entry.pack())
        self._db.write(batch)
        self._db[_META_STAGED_BATCH] = str(batch_id).encode()

    def staged(self) -> dict[str, dict[bytes, Entry]]:
        if STAGED_CF not in self._cf_names():
            return {}
        out: dict[str, dict[bytes, Entry]] = {}
        cf = self._db.get_column_family(STAGED_CF)
        try:
            for raw_key, raw in cf.items():
                pid, _, key = raw_key.partition(_SEP)
                out.setdefault(pid.decode(), {})[key] = Entry.unpack(raw)
        finally:
            del cf
        return out

    def promote_staged(self) -> int:
        """Move staged entries into the committed view; partitions not held are skipped
        (they load from the table, which already has the commit). Returns entries promoted."""
        promoted = 0
        for pid, entries in self.staged().items():
            if self.has_partition(pid):
                self.put_entries(pid, entries)
                promoted += len(entries)
        self.discard_staged()
        return promoted

    def put_entries(self, pid: str, entries: Mapping[bytes, Entry]) -> None:
        """Write committed entries into a held partition."""
        batch = WriteBatch(raw_mode=True)
        batch.set_default_column_family(self._db.get_column_family_handle(PARTITION_CF_PREFIX + pid))
        for key, entry in entries.items():
            batch.put(key, entry.pack())
        self._db.write(batch)

    def discard_staged(self) -> None:
        if STAGED_CF in self._cf_names():
            self._db.drop_column_family(STAGED_CF)
        if self._db.get(_META_STAGED_BATCH) is not None:
            del self._db[_META_STAGED_BATCH]


def _open_locked(path: Path, timeout_s: float) -> Rdict:
    """Open read-write, waiting for another process's lock to go (a retried task)."""
    deadline = time.monotonic() + timeout_s
    delay = 0.05
    while True:
        try:
            return Rdict(str(path), _options())
        except Exception as e:  # rocksdict raises a bare Exception for IO errors
            if "lock" not in str(e).lower():
                raise
            if time.monotonic() >= deadline:
                raise ReplicaLockedError(
                    f"replica {path} is locked by another process for over {timeout_s:.0f}s"
                ) from e
            time.sleep(delay)
            delay = min(delay * 2, 1.0)
