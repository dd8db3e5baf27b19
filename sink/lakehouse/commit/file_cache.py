"""The data files this process wrote lately, held in memory so that a rewrite reads them back
without Parquet; and the key and ordering columns of the files it probed, so that a later
probe of a file it left in place reads none of it.

A batch's rewrite mostly reads files the previous batch wrote: updates of recent keys reach
every file of the newest partitions, which a stream keeps rewriting. A Delta data file never
changes once written (its name is unique), so rows held for a location are that file's rows
for as long as a snapshot names it; a file no snapshot names is never looked up again and
ages out. Merge-on-read leaves every file it marks in place, so each batch probes the same
files again: with their probe columns held, a batch reads only the files it changes."""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

import pyarrow as pa

from sink.lakehouse.commit.key_locator import KeyLocator, MergedKeys

if TYPE_CHECKING:
    from pyroaring import BitMap64

    from sink.delta_log.deletion_vectors import Descriptor


class Buffers(Protocol):
    def get_total_buffer_size(self) -> int: ...


Held = TypeVar("Held", bound=Buffers)


class FileCache(Generic[Held]):
    """Tables (or a file's columns) by file location, least recently used evicted first, at
    most `max_bytes` of Arrow buffers held (one larger than that is not held). Thread-safe: a
    batch's partitions are rewritten in threads."""

    def __init__(self, max_bytes: int = 0):
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._tables: OrderedDict[str, tuple[Held, int]] = OrderedDict()
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

    def put(self, location: str, rows: Held) -> None:
        # Whole buffers count, not the slice's share: a slice keeps them alive.
        size = rows.get_total_buffer_size()
        with self._lock:
            self._drop(location)
            if size > self.max_bytes:
                return
            self._tables[location] = (rows, size)
            self.nbytes += size
            self._evict()

    def get(self, location: str) -> Held | None:
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


class ProbedColumns:
    """Some columns of one data file, by their names in the file, with the file's schema and
    footer (what a probe needs to open it); once the file was probed twice, its keys sorted
    (`locator`) instead of its key columns."""

    def __init__(self, schema: pa.Schema, metadata, columns: dict[str, pa.ChunkedArray],
                 locator: KeyLocator | None = None):
        self.schema = schema
        self.metadata = metadata  # pyarrow.parquet.FileMetaData
        self.columns = columns
        self.locator = locator
        # Its stats as a file with a deletion vector carries them (`merge_on_read._wide_stats`), by
        # the table's column mapping; a few hundred bytes, not counted.
        self.marked_stats: dict[tuple[tuple[str, str], ...] | None, str] = {}
        # The rows its latest deletion vector seen here deletes, by that vector's descriptor
        # (a vector's bytes never change): the one this process wrote, or read; compressed,
        # not counted.
        self.deleted: tuple[Descriptor, BitMap64] | None = None

    def replaced(self, columns: dict[str, pa.ChunkedArray], locator: KeyLocator | None) -> ProbedColumns:
        """The same file's entry holding `columns` and `locator` instead, its stats and
        deletion vector kept."""
        entry = ProbedColumns(self.schema, self.metadata, columns, locator)
        entry.marked_stats, entry.deleted = self.marked_stats, self.deleted
        return entry

    def get_total_buffer_size(self) -> int:
        held = sum(c.get_total_buffer_size() for c in self.columns.values())
        return held + (self.locator.get_total_buffer_size() if self.locator is not None else 0)


# This process's; sized by the sink on the driver, off (0 bytes) in Spark's Python workers.
WRITTEN: FileCache[pa.Table] = FileCache()
# Files' entries by location, and partitions' keys sorted together (`key_hits.merged_keys_at`).
PROBED: FileCache[ProbedColumns | MergedKeys] = FileCache()
