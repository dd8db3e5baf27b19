"""The replicas this process keeps open across batches (tagging on the driver, or in a
reused Python worker: sink.index.worker_replicas), by directory."""

from __future__ import annotations

import atexit
import logging
import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from sink.index import holder
from sink.index.replica import ShardReplica, wipe
from sink.library_errors import first_line

log = logging.getLogger(__name__)

_KEPT_OPEN: dict[str, ShardReplica] = {}
_TERMINATING = False


def acquire(path: str | os.PathLike[str], spec: str, **options) -> ShardReplica:
    """The replica at `path`, kept open for this process across calls (`ShardReplica.open`
    options). Reopened when its directory was removed. A use holds `in_use`: `kept` does both."""
    key = str(path)
    replica = _KEPT_OPEN.get(key)
    if replica is not None and replica.replaced():
        _KEPT_OPEN.pop(key)
        replica.abandon()
        replica = None
    if replica is None:
        if not _KEPT_OPEN:
            atexit.register(close_kept_open)
            holder.answer_requests(lambda: list(_KEPT_OPEN.values()))
        replica = _KEPT_OPEN[key] = ShardReplica.open(path, spec, **options)
    elif replica.spec != spec:
        with replica.in_use:
            replica.close()
        replica = _KEPT_OPEN[key] = ShardReplica.open(path, spec, **options)
    else:
        # A repair or restore at its open was reported by the use that opened it.
        replica.repaired = replica.restored = None
    replica.lookups = dict.fromkeys(replica.lookups, 0)
    return replica


@contextmanager
def kept(path: str | os.PathLike[str], spec: str, **options) -> Iterator[ShardReplica]:
    """One use of the replica `acquire` keeps open, holding its `in_use` lock."""
    replica = acquire(path, spec, **options)
    with replica.in_use:
        if replica.clean:  # checkpointed since its last use: in use again
            replica.mark_dirty()
        yield replica


def is_kept_open(path: str | os.PathLike[str]) -> bool:
    """Whether this process keeps the replica at `path` open (`acquire`)."""
    return kept_open(path) is not None


def kept_open(path: str | os.PathLike[str]) -> ShardReplica | None:
    """The replica at `path` if this process keeps it open (`acquire`)."""
    return _KEPT_OPEN.get(str(path))


def kept_open_paths() -> list[str]:
    return list(_KEPT_OPEN)


def close_kept_open(under: Path | None = None) -> None:
    """Close the replicas `acquire` kept open (all of them at exit, so they are found clean
    next time; or those under one directory). One whose directory is gone, or that fails to
    close, is let go: it is wiped on its next open, which costs a reload, never correctness."""
    for replica in list(_KEPT_OPEN.values()):
        if under is not None and not replica.path.is_relative_to(under):
            continue
        _KEPT_OPEN.pop(str(replica.path), None)
        if replica.replaced():
            replica.abandon()
            continue
        try:
            with replica.in_use:
                replica.close()
        except Exception as e:
            log.warning("replica %s could not be closed cleanly (%s); it rebuilds on its next open",
                        replica.path, first_line(e))
            replica.abandon()


def close_kept_open_on_sigterm() -> None:
    """In a process Spark ends with SIGTERM (a Connect server's foreachBatch worker, stopped
    with its query, a failed one too): close the kept-open replicas clean, then exit at once,
    without the interpreter's teardown, which in such a worker (native threads of RocksDB,
    Arrow and delta-rs still alive) aborted now and then ("terminate called without an active
    exception"). From the main thread only (Python runs signal handlers there)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _on_sigterm)


def _on_sigterm(signum, _frame) -> None:
    global _TERMINATING
    if _TERMINATING:  # Spark may signal twice: the first one's exit is under way
        return
    _TERMINATING = True
    if any(replica.in_use.locked() for replica in _KEPT_OPEN.values()):
        # Mid-use: a close would save half a use. Left dirty, the replica is rebuilt, never trusted.
        os._exit(128 + signum)
    close_kept_open()
    logging.shutdown()
    os._exit(128 + signum)


def wipe_damaged(path: Path, error: BaseException) -> str:
    """Delete a damaged replica, letting go of it if this process keeps it open (it rebuilds
    from the table); returns the reason, logged."""
    kept_replica = _KEPT_OPEN.pop(str(path), None)
    if kept_replica is not None:
        kept_replica.abandon()
    return wipe(path, error)
