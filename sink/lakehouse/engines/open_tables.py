"""Delta tables kept open in this process between batches.

Opening a table reads its log from the last checkpoint: 5-10 ms per table on the bench's
tables, paid by every batch that loads a partition, and more as commits pile up between
checkpoints. A table kept open is brought to the version asked for by reading only the
commits since (~1-3 ms for one commit).

A table is lent only to the sink instance that opened it (`owner`): a running sink already
assumes its table is not replaced under it (its engine keeps the table open too), but a new
sink in the same process must not inherit a table object from before a table was dropped
and recreated at the same place."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from deltalake import DeltaTable

# Tables kept per process (the least recently returned idle one dropped first): a sink keeps
# its table and its tombstone table, a Python worker may serve a few sinks.
KEPT = 8


@dataclass
class _Kept:
    table: DeltaTable
    version: int
    users: int = 0


_lock = threading.Lock()
_kept: OrderedDict[tuple[str, str], _Kept] = OrderedDict()


@contextmanager
def lend(uri: str, owner: str, version: int | None = None) -> Iterator[DeltaTable]:
    """The table at `uri` at `version` (None: its latest) until the block ends. `owner` names
    the sink instance; "" keeps nothing open (a fresh open). Borrowers of one version share
    the table (delta-rs guards it for use across threads); it moves to another version only
    when nobody holds it, and a borrower that cannot have it opens its own."""
    key = (uri, owner)
    kept = _borrow(key, version) if owner else None
    table = kept.table if kept is not None else DeltaTable(uri, version=version)
    try:
        yield table
    finally:
        if owner:
            _give_back(key, kept if kept is not None else _Kept(table, table.version()))


def bring_forward(uri: str, owner: str, version: int | None = None) -> None:
    """Bring the table kept open for `owner` to `version` (None: its latest) now, while it is
    idle, so that its next borrower finds it there; a table not kept stays unopened, and one
    in use is left to its next borrower."""
    key = (uri, owner)
    with _lock:
        kept = _kept.get(key)
        if kept is not None and not kept.users and not _bring(kept, version):
            del _kept[key]


def _borrow(key: tuple[str, str], version: int | None) -> _Kept | None:
    with _lock:  # bringing a table forward reads a commit or two: the next borrower waits, then shares
        kept = _kept.get(key)
        if kept is None:
            return None
        if kept.users:
            if version is None or kept.version != version:  # held at another version (or "latest" asked)
                return None
        elif not _bring(kept, version):
            del _kept[key]
            return None
        kept.users += 1
        return kept


def _bring(kept: _Kept, version: int | None) -> bool:
    """Bring an idle table to `version` (None: the latest); False when it cannot get there (a
    version older than the one it holds, or a log it cannot read forward): the borrower then
    opens afresh."""
    try:
        if version is None:
            kept.table.update_incremental()
        elif kept.version < version:
            kept.table.load_as_version(version)
        elif kept.version > version:
            return False
    except Exception:  # e.g. log files cleaned up: a fresh open reports what is wrong
        return False
    kept.version = kept.table.version()
    return True


def _give_back(key: tuple[str, str], kept: _Kept) -> None:
    with _lock:
        if kept.users:  # borrowed from the kept ones
            kept.users -= 1
        elif key not in _kept:  # opened afresh: kept unless another one is
            _kept[key] = kept
        if not kept.users and _kept.get(key) is kept:
            _kept.move_to_end(key)
        idle = [k for k, held in _kept.items() if not held.users]
        for k in idle[:max(0, len(_kept) - KEPT)]:
            del _kept[k]


def forget(owner: str) -> None:
    """Drop the tables kept for `owner` and for its uses kept apart as "<owner>/<use>" (its
    sink closed)."""
    with _lock:
        for key in [k for k in _kept if k[1] == owner or k[1].startswith(owner + "/")]:
            del _kept[key]
