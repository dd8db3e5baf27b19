"""Who holds a shard replica open, and a reader's request that the holder checkpoint it.

The WAL is off, so what a process writes into a replica it keeps open (driver tagging, a
reused Python worker) sits in memtables that a read-only open from another process
(`python -m sink inspect`, `verify`) cannot see until a flush: the replica looked empty while
the job ran. A read-write open records its process in HOLDER_FILE; a reader writes
CHECKPOINT_REQUEST, and the holder's background thread (`answer_requests`) checkpoints the
replica as soon as no use holds it, then removes the request. A holder that does not answer
in time is named instead, with what its last checkpoint or flush left readable.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Protocol

log = logging.getLogger(__name__)

HOLDER_FILE = "HOLDER.json"
CHECKPOINT_REQUEST = "CHECKPOINT-REQUEST"
# How often the holder looks for requests: a stat per replica it keeps open.
POLL_S = 0.1


@dataclass(frozen=True)
class Holder:
    """The process that opened a replica read-write (and has not closed it)."""

    pid: int
    host: str
    since: float  # wall-clock seconds of its open

    def alive(self) -> bool | None:
        """Whether the process still runs; None when it ran on another host."""
        if self.host != socket.gethostname():
            return None
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:  # another user's process
            return True
        return True


def record(path: Path, since: float) -> None:
    """Record this process as the holder of the replica at `path` (replaced atomically)."""
    tmp = path / f".{HOLDER_FILE}.{os.getpid()}"
    tmp.write_text(json.dumps(asdict(Holder(os.getpid(), socket.gethostname(), since))))
    os.replace(tmp, path / HOLDER_FILE)


def forget(path: Path) -> None:
    """The replica at `path` is closed: no process holds it."""
    (path / HOLDER_FILE).unlink(missing_ok=True)


def read(path: Path) -> Holder | None:
    """The holder the replica at `path` records; None when closed (or unreadable)."""
    try:
        return Holder(**json.loads((path / HOLDER_FILE).read_text()))
    except (FileNotFoundError, ValueError, TypeError):
        return None


def request_checkpoint(path: Path, timeout_s: float) -> bool:
    """Ask the holder of the replica at `path` to checkpoint it; whether it did within
    `timeout_s` (it answers between uses, so a long partition load delays the answer)."""
    request = path / CHECKPOINT_REQUEST
    request.touch()
    deadline = time.monotonic() + timeout_s
    while request.exists():
        if time.monotonic() >= deadline:
            request.unlink(missing_ok=True)
            return False
        time.sleep(0.02)
    return True


class Checkpointable(Protocol):
    path: Path
    in_use: threading.Lock

    def replaced(self) -> bool: ...

    def checkpoint(self) -> None: ...


def answer(replicas: Iterable[Checkpointable]) -> None:
    """One round: checkpoint each replica a reader asked for, unless a use holds it (the
    next round tries again)."""
    for replica in replicas:
        request = replica.path / CHECKPOINT_REQUEST
        if not request.exists() or not replica.in_use.acquire(blocking=False):
            continue
        try:
            if not replica.replaced():
                replica.checkpoint()
        except Exception as e:  # a replica closed under the round: its close checkpointed it
            log.debug("checkpoint request for %s not answered: %s", replica.path, e)
        finally:
            replica.in_use.release()
        request.unlink(missing_ok=True)


_answerer: threading.Thread | None = None
_answerer_lock = threading.Lock()


def answer_requests(replicas: Callable[[], Iterable[Checkpointable]]) -> None:
    """Start this process's background thread that answers checkpoint requests for the
    replicas it keeps open (`replicas()` lists them), once."""
    global _answerer
    with _answerer_lock:
        if _answerer is None or not _answerer.is_alive():
            def run() -> None:
                while True:
                    time.sleep(POLL_S)
                    answer(replicas())

            _answerer = threading.Thread(target=run, name="sink-checkpoint-requests", daemon=True)
            _answerer.start()
