"""The RocksDB handle of a replica: its options, the shared block caches, and the locked,
pinned read-write open of a directory."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

from rocksdict import BlockBasedOptions, Cache, DataBlockIndexType, Options, Rdict

from sink.errors import ReplicaLockedError
from sink.library_errors import is_lock_held

DEFAULT_BLOCK_CACHE_BYTES = 64 << 20
# Table files a replica keeps open (RocksDB's table cache); past it the least recently used close.
MAX_OPEN_FILES = 4096
# Written by an open that waits for the replica's lock: the worker keeping it open lets go.
RELEASE_FILE = "RELEASE"
# One block cache per size, shared by every replica of the process (it must outlive them).
_BLOCK_CACHES: dict[int, Cache] = {}
# Linux names an open descriptor's file: RocksDB reaches a pinned directory through it.
_PROC_FD = os.path.isdir("/proc/self/fd")


def options(block_cache_bytes: int = DEFAULT_BLOCK_CACHE_BYTES) -> Options:
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


def identity(path: Path) -> bytes | None:
    """The database's id RocksDB wrote when it made the directory's database."""
    try:
        return (path / "IDENTITY").read_bytes()
    except FileNotFoundError:
        return None


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


def open_locked(path: Path, timeout_s: float,
                block_cache_bytes: int = DEFAULT_BLOCK_CACHE_BYTES) -> tuple[Rdict, PinnedDir]:
    """Open read-write, waiting for another process's lock to go (a retried task, or a worker
    that keeps the replica open, which RELEASE_FILE asks to let go)."""
    deadline = time.monotonic() + timeout_s
    delay = 0.02
    while True:
        try:
            pinned = PinnedDir(path)
            try:
                db = Rdict(pinned.db_path, options(block_cache_bytes))
            except BaseException:
                pinned.release()
                raise
            # Ours now: a request left by this open (or by one before, whose holder died) is
            # answered; one that arrives later is written again by its waiting open.
            (path / RELEASE_FILE).unlink(missing_ok=True)
            return db, pinned
        except Exception as e:  # rocksdict raises a bare Exception for IO errors
            here = isinstance(e, HeldHere)
            if not here and not is_lock_held(e):
                raise
            if time.monotonic() >= deadline:
                holder = "this process (another open of it)" if here else "another process"
                raise ReplicaLockedError(f"replica {path} is locked by {holder} for over {timeout_s:.0f}s") from e
            (path / RELEASE_FILE).touch()
            time.sleep(delay)
            delay = min(delay * 2, 0.5)
