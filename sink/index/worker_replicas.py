"""Replicas a reused Spark Python worker keeps open between its tagging tasks.

A tagging task on an executor used to open its shard's replica and close it again, both on
the task's time: the open ~0.05 s, the close a flush of every column family the batch wrote
(~1.5 ms each, 0.1-0.2 s a batch). A reused worker (`spark.python.worker.reuse`, Spark's
default) keeps the replicas it used open for its next tasks instead, and a background thread
checkpoints them (`ShardReplica.checkpoint`: flushed, key filters saved, marked clean), off
the tasks' time: once a replica has gone CHECKPOINT_IDLE_S without a use, or has been in use
without a checkpoint for CHECKPOINT_EVERY_S. A checkpoint after every use (a flush of every
column family the batch wrote, the compactions of those small files, the key filters saved)
took CPU the next tasks needed: on two executors sharing two cores, the events batch at 1M
rows took 1.62 s with it and 1.45 s without (medians of 13 and 6 runs).

- Spark stops idle workers without warning (a closed socket, or SIGKILL) after a minute
  idle: a replica is checkpointed well before. One lost before its checkpoint (a worker
  killed in a busy stream) is dirty and rebuilt, never trusted, as when a task is killed.
- One process holds a replica (RocksDB's lock). Another process that needs it writes
  `RELEASE_FILE` in its directory while its open waits for the lock; the holder closes it once
  its use and checkpoint are done.
- A worker keeps at most MAX_KEPT replicas (each holds table files and memory); past it, the
  least recently used one is closed after its checkpoint.
"""

from __future__ import annotations

import os
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

from sink.index import registry
from sink.index.registry import close_kept_open, kept_open
from sink.index.replica import ShardReplica
from sink.index.rocks import RELEASE_FILE

MAX_KEPT = 8
# A replica is checkpointed once unused this long (Spark stops a worker idle for 60 s), or
# once in use without a checkpoint this long (as the driver flushes its replicas: FLUSH_EVERY_S).
CHECKPOINT_IDLE_S = 10.0
CHECKPOINT_EVERY_S = 60.0
# How often the background thread looks for due checkpoints and release requests (a stat per
# kept replica).
POLL_S = 0.05


def reused_worker(env: Mapping[str, str] = os.environ) -> bool:
    """Whether this process is a Spark Python worker that serves several tasks: Spark sets
    SPARK_REUSE_WORKER for its workers when spark.python.worker.reuse is on."""
    return bool(env.get("SPARK_REUSE_WORKER"))


class _Kept:
    """A replica this worker keeps open: its use lock (a task's use, or a checkpoint or release
    by the background thread), and in monotonic seconds the end of its last use and the first
    use since its last checkpoint (None: nothing awaits a checkpoint)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.used_at = 0.0
        self.dirty_since: float | None = None

    def checkpoint_due(self, now: float) -> bool:
        return self.dirty_since is not None and (
            now - self.used_at >= CHECKPOINT_IDLE_S or now - self.dirty_since >= CHECKPOINT_EVERY_S)


_KEPT: OrderedDict[str, _Kept] = OrderedDict()  # least recently used first
_KEPT_LOCK = threading.Lock()  # guards _KEPT and the background thread's start
_clock = time.monotonic  # seconds; tests set their own
_keeper: threading.Thread | None = None


@contextmanager
def use(path: str | os.PathLike[str], spec: str, **options) -> Iterator[ShardReplica]:
    """The replica at `path` for one task's use, kept open after it (`registry.acquire`
    options); its checkpoint runs in the background when due (`_Kept.checkpoint_due`)."""
    key = str(path)
    with _KEPT_LOCK:
        kept = _KEPT.setdefault(key, _Kept())
        _start_keeper()
    with kept.lock:
        with _KEPT_LOCK:  # again: the background thread may have let it go while this waited
            _KEPT[key] = kept
            _KEPT.move_to_end(key)
        # A use that fails leaves the replica unmarked (dirty): its next use goes on with it,
        # as a kept-open replica's does on the driver; a damaged one is wiped by the caller.
        with registry.kept(path, spec, **options) as replica:
            yield replica
        kept.used_at = _clock()
        if kept.dirty_since is None:
            kept.dirty_since = kept.used_at


def _start_keeper() -> None:
    global _keeper
    if _keeper is None or not _keeper.is_alive():
        _keeper = threading.Thread(target=_keep, name="sink-replica-keeper", daemon=True)
        _keeper.start()


def _keep() -> None:
    while True:
        time.sleep(POLL_S)
        keep_up()


def keep_up() -> None:
    """One round of the background thread: checkpoint the replicas whose checkpoint is due,
    and close those another process asked for, or past MAX_KEPT. A replica in use is left to
    its next round."""
    now = _clock()
    with _KEPT_LOCK:
        kept = list(_KEPT.items())
    excess = len(kept) - MAX_KEPT
    for i, (key, entry) in enumerate(kept):
        if not entry.lock.acquire(blocking=False):
            continue
        try:
            _keep_one(key, entry, now, release=i < excess or (Path(key) / RELEASE_FILE).exists())
        finally:
            entry.lock.release()


def _keep_one(key: str, entry: _Kept, now: float, release: bool) -> None:
    replica = kept_open(key)
    if replica is not None and replica.replaced():
        release = True  # lost under it: let go at once, never checkpointed into another's directory
    elif replica is not None and entry.checkpoint_due(now):
        entry.dirty_since = None
        try:
            with replica.in_use:  # a reader's checkpoint request may be answered beside this
                replica.checkpoint()
        except Exception:  # a full disk, say: the close below lets it go
            release = True
    if replica is None or release:
        with _KEPT_LOCK:
            _KEPT.pop(key, None)
        # One that fails to close is let go (and logged): it rebuilds on its next open.
        close_kept_open(under=Path(key))
