"""Where a data file holds given keys, found in time that grows with the keys looked up, not
with the file: its keys sorted once, then a binary search per key. A file merge-on-read
leaves in place is probed again by every batch that updates its partition; `pc.index_in` over
its keys would hash every row of it each time. A partition of several such files has their
keys sorted together (`MergedKeys`): one search for all of them."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

# A file of fewer rows has its keys hashed with the partition's other small files' in one
# `pc.index_in` rather than searched (`KeyLocator.find`): a search costs about what hashing
# this many keys does (0.3 ms, measured), and merge-on-read adds a small file to a partition
# each batch. Its keys are held as they are, never sorted.
SEARCHED_ROWS = 16_384


@dataclass(frozen=True)
class KeyLocator:
    """One file's keys (`stored_rows.row_keys`), sorted, and each one's row in the file."""

    sorted_keys: pa.Array
    rows: np.ndarray
    unique: bool  # no key repeated: each incoming key finds one row at most

    @classmethod
    def of(cls, keys: pa.Array, rows: np.ndarray | None = None) -> KeyLocator:
        """`keys` sorted; `rows`: each key's row (None: its position in `keys`)."""
        if pa.types.is_integer(keys.type) and not keys.null_count:  # numpy's sort: no kernel calls
            numbers = keys.to_numpy()
            order = np.argsort(numbers, kind="stable")
            ordered_numbers = numbers[order]
            return cls(pa.array(ordered_numbers, keys.type), order if rows is None else rows[order],
                       not np.any(ordered_numbers[1:] == ordered_numbers[:-1]))
        at = pc.sort_indices(keys)  # nulls last, where search_sorted expects them
        ordered = keys.take(at)
        # Sorted, a repeated key sits next to itself (nulls, all last, compare as null).
        repeated = len(ordered) > 1 and (ordered.null_count > 1 or pc.any(
            pc.equal(ordered.slice(1), ordered.slice(0, len(ordered) - 1))).as_py() is True)
        order = at.to_numpy()
        return cls(ordered, order if rows is None else rows[order], not repeated)

    @property
    def num_rows(self) -> int:
        return len(self.rows)

    def merged_with(self, other: KeyLocator) -> KeyLocator:
        """This and `other` (keys of one type) as one locator, their sorted keys merged: linear
        in the rows, where sorting them again cost about a second at 10M keys, every time
        merge-on-read's new files joined a mirror's merged keys."""
        if not other.num_rows or not self.num_rows:
            return self if not other.num_rows else other
        if self.sorted_keys.null_count or other.sorted_keys.null_count:  # nulls sort last: sorted anew
            keys = pa.chunked_array([self.sorted_keys, other.sorted_keys], type=self.sorted_keys.type)
            return KeyLocator.of(keys.combine_chunks(), np.concatenate([self.rows, other.rows]))
        mine, theirs = self._numbers, other._numbers
        if mine is not None and theirs is not None:
            at = np.searchsorted(mine, theirs, side="right")
        else:
            at = pc.search_sorted(self.sorted_keys, other.sorted_keys, side="right").to_numpy()
        n, m = self.num_rows, other.num_rows
        placed = at.astype(np.int64) + np.arange(m)  # where each of `other`'s keys lands: after its equals here
        order = np.empty(n + m, np.int64)
        order[placed] = n + np.arange(m)
        mask = np.ones(n + m, bool)
        mask[placed] = False
        order[mask] = np.arange(n)
        if mine is not None and theirs is not None:
            keys = pa.array(np.concatenate([mine, theirs])[order], self.sorted_keys.type)
        else:
            keys = pa.chunked_array([self.sorted_keys, other.sorted_keys], type=self.sorted_keys.type
                                    ).combine_chunks().take(pa.array(order))
        # A key of `other` that is also here lands right after its equal.
        after = placed[placed > 0]
        repeated = len(after) and pc.any(pc.equal(keys.take(pa.array(after)), keys.take(pa.array(after - 1)))).as_py()
        rows = np.concatenate([self.rows.astype(np.int64), other.rows.astype(np.int64)])[order]
        return KeyLocator(keys, rows, self.unique and other.unique and not repeated)

    def get_total_buffer_size(self) -> int:
        return self.sorted_keys.get_total_buffer_size() + self.rows.nbytes

    @cached_property
    def _numbers(self) -> np.ndarray | None:
        """The sorted integer keys but the nulls (all last), as a view on their buffer: numpy
        searches a batch's keys of one file in microseconds, where each Arrow kernel call
        costs tens of them, and merge-on-read searches every file of a partition per batch."""
        if not pa.types.is_integer(self.sorted_keys.type):
            return None
        return self.sorted_keys.slice(0, self.num_rows - self.sorted_keys.null_count).to_numpy()

    def find(self, incoming: pa.Array) -> tuple[np.ndarray, np.ndarray]:
        """The file's rows holding a key of `incoming`, ascending, and each one's position in
        `incoming` (the first, when `incoming` repeats the key): what `pc.index_in(keys,
        value_set=incoming)` says, without a value per row of the file. A null key matches
        none."""
        if not self.num_rows:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        numbers = self._numbers
        if numbers is not None and incoming.type == self.sorted_keys.type and not incoming.null_count:
            wanted = incoming.to_numpy()
            lo = np.searchsorted(numbers, wanted, side="left")
            if not len(numbers):  # nulls alone
                return np.zeros(0, np.int64), np.zeros(0, np.int64)
            if self.unique:
                needle = np.flatnonzero(numbers[np.minimum(lo, len(numbers) - 1)] == wanted)
                return self._first_per_row(self.rows[lo[needle]].astype(np.int64), needle)
            return self._runs(lo, np.searchsorted(numbers, wanted, side="right"))
        lo = pc.fill_null(pc.search_sorted(self.sorted_keys, incoming, side="left"), 0).to_numpy()
        if self.unique:  # a key's run is its row at `lo`, when that row holds it
            equal = pc.equal(self.sorted_keys.take(np.minimum(lo, self.num_rows - 1)), incoming)
            needle = np.flatnonzero(pc.fill_null(equal, False).to_numpy(zero_copy_only=False))
            return self._first_per_row(self.rows[lo[needle]].astype(np.int64), needle)
        return self._runs(lo, pc.fill_null(pc.search_sorted(self.sorted_keys, incoming, side="right"), 0).to_numpy())

    @staticmethod
    def _first_per_row(rows: np.ndarray, needle: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Rows found (each incoming key's at most one) by row, each once, with the first
        incoming position that found it: a stable sort keeps that position first."""
        order = np.argsort(rows, kind="stable")
        rows, needle = rows[order], needle[order]
        first = np.ones(len(rows), bool)
        first[1:] = rows[1:] != rows[:-1]
        return rows[first], needle[first]

    def _runs(self, lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """A file that repeats keys: each incoming key's run `lo:hi` of equal sorted keys."""
        counts = (hi - lo).astype(np.int64)
        needle = np.repeat(np.arange(len(lo), dtype=np.int64), counts)
        first = np.cumsum(counts) - counts
        rows = self.rows[np.arange(len(needle)) - np.repeat(first, counts) + np.repeat(lo, counts).astype(np.int64)]
        order = np.lexsort((needle, rows))  # by row, then the first incoming position
        found, where = np.unique(rows[order], return_index=True)
        return found.astype(np.int64), needle[order][where]


@dataclass(frozen=True)
class MergedKeys:
    """Several files' keys sorted together: a batch's keys are searched once for all of
    them, not once per file. The files' rows are numbered one file after the other."""

    files: tuple[str, ...]  # their locations
    starts: np.ndarray  # file i's rows are numbered starts[i]:starts[i + 1]
    locator: KeyLocator

    @classmethod
    def of(cls, runs: Sequence[tuple[str, pa.Array, np.ndarray]]) -> MergedKeys:
        """From each file's location, keys (every row's, in any order) and each key's row."""
        none = KeyLocator(runs[0][1].slice(0, 0), np.zeros(0, np.int64), True)
        return cls((), np.zeros(1, np.int64), none).adding(runs)

    def adding(self, runs: Sequence[tuple[str, pa.Array, np.ndarray]]) -> MergedKeys:
        """With more files (as `of` takes them): their keys sorted together, then merged into
        these (`KeyLocator.merged_with`), which are not sorted again. (Merging many large runs
        two by two costs more than one sort of them for string keys: 5.9 s against ~3.5 s for
        10 files of a 10M-key mirror.)"""
        if not runs:
            return self
        starts = np.concatenate([self.starts, self.starts[-1] + np.cumsum([len(k) for _, k, _ in runs])])
        numbered = np.concatenate([rows.astype(np.int64) + start
                                   for (_, _, rows), start in zip(runs, starts[len(self.files):])])
        keys = pa.chunked_array([k for _, k, _ in runs], type=self.locator.sorted_keys.type).combine_chunks()
        locator = self.locator.merged_with(KeyLocator.of(keys, numbered))
        return MergedKeys((*self.files, *(f for f, _, _ in runs)), starts.astype(np.int64), locator)

    def keeping(self, files: Collection[str]) -> MergedKeys | None:
        """Those of its files among `files` (others left the table), without sorting again;
        None when none is."""
        kept = [i for i, f in enumerate(self.files) if f in files]
        if not kept:
            return None
        starts = np.concatenate([[0], np.cumsum(np.diff(self.starts)[kept])]).astype(np.int64)
        of_file = np.searchsorted(self.starts, self.locator.rows, side="right") - 1
        keep = np.zeros(len(self.files), bool)
        keep[kept] = True
        shift = np.zeros(len(self.files), np.int64)
        shift[kept] = starts[:-1] - self.starts[kept]
        mine = keep[of_file]
        locator = KeyLocator(self.locator.sorted_keys.filter(pa.array(mine)),
                             self.locator.rows[mine] + shift[of_file[mine]], self.locator.unique)
        return MergedKeys(tuple(self.files[i] for i in kept), starts, locator)

    def find(self, incoming: pa.Array) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per file, what `KeyLocator.find` finds in it."""
        numbered, needle = self.locator.find(incoming)  # ascending: file by file
        bounds = np.searchsorted(numbered, self.starts)
        return [(numbered[bounds[i]:bounds[i + 1]] - self.starts[i], needle[bounds[i]:bounds[i + 1]])
                for i in range(len(self.files))]

    def get_total_buffer_size(self) -> int:
        return self.locator.get_total_buffer_size() + self.starts.nbytes
