"""Delta tables kept open in this process between batches, lent to one user at a time.

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

from deltalake import DeltaTable

# Idle tables kept per process (least recently returned dropped first): a sink keeps its
# table and its tombstone table, a Python worker may serve a few sinks.
KEPT = 8

_lock = threading.Lock()
_idle: OrderedDict[tuple[str, str], DeltaTable] = OrderedDict()


@contextmanager
def lend(uri: str, owner: str, version: int | None = None) -> Iterator[DeltaTable]:
    """The table at `uri` at `version` (None: its latest), for the caller alone until the
    block ends. `owner` names the sink instance; "" keeps nothing open (a fresh open)."""
    key = (uri, owner)
    with _lock:
        table = _idle.pop(key, None) if owner else None
    table = _brought_to(table, version) if table is not None else None
    if table is None:
        table = DeltaTable(uri, version=version)
    try:
        yield table
    finally:
        if owner:
            with _lock:
                _idle[key] = table  # a concurrent borrower's table, returned earlier, is dropped
                _idle.move_to_end(key)
                while len(_idle) > KEPT:
                    _idle.popitem(last=False)


def _brought_to(table: DeltaTable, version: int | None) -> DeltaTable | None:
    """`table` at `version` (None: the latest), or None when it cannot get there (a version
    older than the one it holds, or a log it cannot read forward): the caller opens afresh."""
    try:
        if version is None:
            table.update_incremental()
        elif table.version() < version:
            table.load_as_version(version)
        elif table.version() > version:
            return None
    except Exception:  # e.g. log files cleaned up: a fresh open reports what is wrong
        return None
    return table


def forget(owner: str) -> None:
    """Drop the tables kept for `owner` and for its uses kept apart as "<owner>/<use>" (its
    sink closed)."""
    with _lock:
        for key in [k for k in _idle if k[1] == owner or k[1].startswith(owner + "/")]:
            del _idle[key]
