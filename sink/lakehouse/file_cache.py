"""The data files this process wrote lately, held in memory so that a rewrite reads them back
without Parquet.

A batch's rewrite mostly reads files the previous batch wrote: updates of recent keys reach
every file of the newest partitions, which a stream keeps rewriting. A Delta data file never
changes once written (its name is unique), so rows held for a location are that file's rows
for as long as a snapshot names it; a file no snapshot names is never looked up again and
ages out.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import pyarrow as pa


class FileCache:
    """Tables by file location, least recently used evicted first, at most `max_bytes` of
    Arrow buffers held (a table larger than that is not held). Thread-safe: a batch's
    partitions are rewritten in threads."""

    def __init__(self, max_bytes: int = 0):
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._tables: OrderedDict[str, tuple[pa.Table, int]] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._tables)

    def clear(self) -> None:
        with self._lock:
            self._tables.clear()
            self.nbytes = 0

    def resize(self, max_bytes: int) -> None:
        with self._lock:
            self.max_bytes = max_bytes
            self._evict()

    def put(self, location: str, rows: pa.Table) -> None:
        # Whole buffers count, not the slice's share: a slice keeps them alive.
        size = rows.get_total_buffer_size()
        with self._lock:
            self._drop(location)
            if size > self.max_bytes:
                return
            self._tables[location] = (rows, size)
            self.nbytes += size
            self._evict()

    def get(self, location: str) -> pa.Table | None:
        with self._lock:
            held = self._tables.get(location)
            if held is None:
                return None
            self._tables.move_to_end(location)
            return held[0]

    def discard(self, location: str) -> None:
        with self._lock:
            self._drop(location)

    def _drop(self, location: str) -> None:
        held = self._tables.pop(location, None)
        if held is not None:
            self.nbytes -= held[1]

    def _evict(self) -> None:
        while self.nbytes > self.max_bytes:
            _, (_, size) = self._tables.popitem(last=False)
            self.nbytes -= size


# This process's; sized by the sink on the driver, off (0 bytes) in Spark's Python workers.
WRITTEN = FileCache()
