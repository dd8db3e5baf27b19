"""One shard's replica: a RocksDB directory with one column family per table partition.

In global scope (keys unique across the table) it has one keyspace instead, the column
family of `GLOBAL`, holding every key of the shard with the partition it lives in; it is
loaded (and invalidated) as a whole.

`ShardReplica` is a façade over its parts: the RocksDB handle (`sink.index.rocks`), the
metadata in the `default` column family (`sink.index.metadata`), the keyspaces and their
lookups through key filters and the memory tier (`sink.index.keyspaces`), and the staged
batch (`sink.index.staging`). The replicas a process keeps open between batches are in
`sink.index.registry`.

WAL is off (the replica is rebuildable from the table). A `dirty` flag, persisted
on open and cleared after a full flush on close, tells a replica left by a killed
process: it is wiped, since memtable contents were lost with it.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

import pyarrow as pa
from rocksdict import AccessType, Checkpoint, Rdict, WriteOptions

from sink.index import holder, rocks
from sink.index.entry import Entry
from sink.index.hot_tier import HotTier, tier_for
from sink.index.keyspaces import Keyspaces
from sink.index.metadata import PartitionInfo, ReplicaMeta
from sink.index.staging import Staging
from sink.library_errors import compacted_away, first_line, is_corruption

log = logging.getLogger(__name__)

READ_ONLY_OPEN_ATTEMPTS = 5
# Fills an empty replica directory with a replica's files (a snapshot, sink.index.snapshots):
# the version they reflect, or None when it found none.
Seed = Callable[[Path], int | None]


class ShardReplica:
    """An open shard replica. Use `ShardReplica.open(...)` as a context manager. Its parts
    are `meta`, `keyspaces` and `staging`; the façade keeps what spans them, and the reads
    and writes a batch makes."""

    def __init__(self, path: Path, db: Rdict, read_only: bool = False,
                 block_cache_bytes: int = rocks.DEFAULT_BLOCK_CACHE_BYTES, pinned: rocks.PinnedDir | None = None):
        self.path = path
        # Where this open's files are: the directory it opened, even once `path` names another.
        self._pinned = pinned
        self._files = Path(pinned.db_path) if pinned is not None else path
        self._db = db
        # Held by each use of a replica kept open, so that a checkpoint another thread makes
        # for a reader (sink.index.holder) never sees half a batch's writes.
        self.in_use = threading.Lock()
        self.read_only = read_only
        self.repaired: str | None = None  # why the replica was found damaged and wiped on open
        self.restored: int | None = None  # the snapshot's version, when the open started from one
        self._identity = rocks.identity(self._files)
        self.flushed_at = time.monotonic()
        self.meta = ReplicaMeta(db)
        self.keyspaces = Keyspaces(db, self._files, self.meta, read_only, block_cache_bytes, path)
        self.staging = Staging(self.meta, self.keyspaces)
        if not read_only:
            write_opts = WriteOptions()
            write_opts.disable_wal = True
            self._db.set_write_options(write_opts)

    # --- opening and closing -------------------------------------------------------------------

    @classmethod
    def open(cls, path: str | os.PathLike[str], spec: str, lock_timeout_s: float = 60.0,
             hot_cache_entries: int = 0, block_cache_bytes: int = rocks.DEFAULT_BLOCK_CACHE_BYTES,
             resident_keys: int = 0, seed: Seed | None = None) -> ShardReplica:
        """Open (or create) the replica at `path` for the given key spec.

        A replica of another format or key spec, one a killed process left dirty, or one
        whose files are damaged is wiped: it costs a reload, never correctness. An empty
        one starts from what `seed` puts in its directory, when that is usable for `spec`.
        """
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        repaired = None
        try:
            replica = cls._open_for(path, spec, lock_timeout_s, block_cache_bytes, seed)
        except Exception as e:  # rocksdict raises a bare Exception
            if not is_corruption(e):
                raise
            repaired = wipe(path, e)  # the local replica's damage: a seeded one that fails to open is let go
            replica = cls._open_for(path, spec, lock_timeout_s, block_cache_bytes, seed)
        replica.tier = tier_for(str(path), hot_cache_entries, resident_keys, replica.meta.token)
        replica.mark_dirty()
        holder.record(path, time.time())
        replica.repaired = repaired
        return replica

    @classmethod
    def open_read_only(cls, path: str | os.PathLike[str]) -> ShardReplica:
        """A read-only view, usable beside the process that holds the replica open. The open
        reads the MANIFEST, then the files it lists: the writer's compaction may delete one in
        between (RocksDB then reports a missing .sst), and a new open reads the new MANIFEST."""
        def one() -> ShardReplica:
            # Every table file opened at open: one the writer deletes afterwards stays readable.
            options = rocks.options()
            options.set_max_open_files(-1)
            return cls(Path(path), Rdict(str(path), options, access_type=AccessType.read_only()), read_only=True)

        for _ in range(READ_ONLY_OPEN_ATTEMPTS - 1):
            try:
                return one()
            except Exception as e:
                if not compacted_away(e):
                    raise
        return one()

    @classmethod
    def _open_for(cls, path: Path, spec: str, lock_timeout_s: float, block_cache_bytes: int,
                  seed: Seed | None) -> ShardReplica:
        """Open read-write; a replica not usable for `spec` is replaced by the seeded one, if
        usable, else by an empty one."""
        path.mkdir(parents=True, exist_ok=True)
        replica = cls._locked_open(path, lock_timeout_s, block_cache_bytes)
        _sweep_beside(path)  # ours alone now: what a killed restore or publish of it left
        try:
            usable = replica.meta.usable_for(spec)
        except Exception:
            replica._close_db()  # frees RocksDB's lock on the path before the caller wipes it
            raise
        if usable:
            return replica
        seeded = _seeded(path, seed)  # filled while this open holds the lock
        replica._close_db()
        shutil.rmtree(path)
        if seeded is not None:
            os.rename(seeded[0], path)
            replica = _opened_if_usable(path, spec, lock_timeout_s, block_cache_bytes)
            if replica is not None:
                replica.restored = seeded[1]
                return replica
            shutil.rmtree(path)
        path.mkdir(parents=True)
        replica = cls._locked_open(path, lock_timeout_s, block_cache_bytes)
        replica.meta.start(spec)
        return replica

    @classmethod
    def _locked_open(cls, path: Path, lock_timeout_s: float, block_cache_bytes: int) -> ShardReplica:
        db, pinned = rocks.open_locked(path, lock_timeout_s, block_cache_bytes)
        return cls(path, db, block_cache_bytes=block_cache_bytes, pinned=pinned)

    def flush(self) -> None:
        """Write every column family's memtable to disk (the WAL is off)."""
        self.keyspaces.flush()
        self._db.flush()
        self.flushed_at = time.monotonic()

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
        self.keyspaces.filters.save(token, self.partitions())
        self.meta.mark_clean(token)
        self.tier.token = token

    def mark_dirty(self) -> None:
        self.meta.mark_dirty()

    def copy_to(self, dest: Path) -> int | None:
        """Copy the replica, as a close leaves it (`checkpoint`), into the new directory
        `dest` (on its filesystem RocksDB links the table files instead of copying them); it
        stays in use. Returns the version the copy reflects."""
        try:  # marked dirty again even when the checkpoint fails after marking it clean
            self.checkpoint()
            Checkpoint(self._db).create_checkpoint(str(dest))
            self.keyspaces.filters.copy_saved(dest)
        finally:
            self.mark_dirty()
        return self.version

    def replaced(self) -> bool:
        """Whether its directory no longer holds this open database: removed, or another one
        made in its place (a replica lost and rebuilt by another process)."""
        return rocks.identity(self.path) != self._identity

    def abandon(self) -> None:
        """Let go of a replica whose directory was removed or replaced, or that cannot be closed
        cleanly: nothing of it can be saved. The handle is closed all the same (RocksDB's lock
        on the path is per process)."""
        self.tier.clear()
        try:
            self._close_db()
        except Exception:  # writing into a removed directory fails; the handle goes all the same
            pass

    def _close_db(self) -> None:
        self.keyspaces.let_go()
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
            self.abandon()

    # --- what it is and reflects (sink.index.metadata) ----------------------------------------------

    @property
    def spec(self) -> str | None:
        return self.meta.spec

    @property
    def located(self) -> bool:
        return self.meta.located

    @property
    def width(self) -> int:
        return self.meta.width

    @property
    def clean(self) -> bool:
        return self.meta.clean

    @property
    def version(self) -> int | None:
        return self.meta.version

    def set_version(self, version: int) -> None:
        self.meta.set_version(version)

    @property
    def staged_batch(self) -> int | None:
        return self.meta.staged_batch

    def partitions(self) -> dict[str, PartitionInfo]:
        return self.meta.partitions()

    def has_partition(self, pid: str) -> bool:
        return self.meta.has_partition(pid)

    def touch(self, pids: Iterable[str], now: float | None = None) -> None:
        self.meta.touch(pids, now)

    # --- keyspaces (sink.index.keyspaces) ---------------------------------------------------------

    @property
    def tier(self) -> HotTier:
        return self.keyspaces.tier

    @tier.setter
    def tier(self, tier: HotTier) -> None:
        self.keyspaces.tier = tier

    @property
    def lookups(self) -> dict[str, int]:
        return self.keyspaces.lookups

    @lookups.setter
    def lookups(self, counts: dict[str, int]) -> None:
        self.keyspaces.lookups = counts

    def load_partition(self, pid: str, keys: list[bytes], entries: list[Entry], reason: str,
                       now: float | None = None) -> None:
        self.load_packed(pid, keys, [e.pack() for e in entries], reason, now)

    def load_packed(self, pid: str, keys: Sequence[bytes], raws: Sequence[bytes], reason: str,
                    now: float | None = None) -> None:
        """Replace partition `pid` with exactly these entries; visible only once complete."""
        self.keyspaces.load_chunks(pid, [(keys, raws)], reason, now)

    def load_chunks(self, pid: str, chunks: Iterable[tuple[Sequence[bytes], Sequence[bytes]]], reason: str,
                    now: float | None = None, *, ascending: bool = False) -> int:
        return self.keyspaces.load_chunks(pid, chunks, reason, now, ascending=ascending)

    def drop_partition(self, pid: str, invalidated: bool = False) -> None:
        self.keyspaces.drop_partition(pid, invalidated)

    def drop_all(self) -> None:
        """Forget every partition and staged entry (the replica then reloads on demand)."""
        self.keyspaces.drop_all()
        self.meta.discard_staged()

    def lookup(self, pid: str, keys: list[bytes]) -> list[Entry | None]:
        return self.keyspaces.lookup(pid, keys)

    def lookup_packed(self, pid: str, keys: Sequence[bytes]) -> list[bytes | None]:
        return self.keyspaces.lookup_packed(pid, keys)

    def peek(self, pid: str, keys: Sequence[bytes]) -> list[bytes | None]:
        return self.keyspaces.peek(pid, keys)

    def put_entries(self, pid: str, entries: Mapping[bytes, Entry]) -> None:
        self.keyspaces.put_entries(pid, entries)

    # --- the staged batch (sink.index.staging) ------------------------------------------------------

    def stage(self, batch_id: int, changes: pa.Table | Mapping[str, Mapping[bytes, Entry]],
              read_version: int | None = None) -> None:
        self.staging.stage(batch_id, changes, read_version)

    def promote_staged(self) -> int:
        return self.staging.promote()

    def discard_staged(self) -> None:
        self.meta.discard_staged()


# Directories beside a replica's, named after it: a snapshot being restored into it, and its
# copy being published (sink.index.snapshots.local_copy_dir).
RESTORING, PUBLISHING = ".restore-", ".snapshot-"


def _seeded(path: Path, seed: Seed | None) -> tuple[Path, int] | None:
    """The files `seed` fills for the replica at `path`, in a new directory beside it (its own
    never holds part of a snapshot: a process killed while downloading leaves the directory
    the next open sweeps), and the version they reflect; None when it found none, or failed."""
    if seed is None:
        return None
    files = path.with_name(f"{RESTORING}{path.name}-{os.urandom(6).hex()}")
    files.mkdir()
    try:
        version = seed(files)
    except Exception as e:  # a snapshot spares a load; without one the replica loads
        log.warning("replica %s: no snapshot restored (%s); it loads from the table", path, first_line(e))
        version = None
    if version is None:
        shutil.rmtree(files, ignore_errors=True)
        return None
    return files, version


def _opened_if_usable(path: Path, spec: str, lock_timeout_s: float, block_cache_bytes: int) -> ShardReplica | None:
    """The seeded replica at `path`, open, if it is usable for `spec` (closed if not; any error
    opening it is logged: the caller starts an empty one instead)."""
    replica = None
    try:
        replica = ShardReplica._locked_open(path, lock_timeout_s, block_cache_bytes)
        if replica.meta.usable_for(spec):
            return replica
    except Exception as e:
        log.warning("replica %s: the snapshot it started from does not open (%s); starting empty", path,
                    first_line(e))
    if replica is not None:
        replica._close_db()
    return None


def _sweep_beside(path: Path) -> None:
    for prefix in (RESTORING, PUBLISHING):
        for stale in path.parent.glob(f"{prefix}{path.name}-*"):
            shutil.rmtree(stale, ignore_errors=True)


def wipe(path: Path, error: BaseException) -> str:
    """Delete a damaged replica not open in this process (it rebuilds from the table); returns
    the reason, logged."""
    reason = first_line(error)
    log.warning("replica %s is damaged (%s): wiped, it rebuilds from the table", path, reason)
    shutil.rmtree(path, ignore_errors=True)
    return reason
