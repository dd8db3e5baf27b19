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


# A partition's merged keys are held in tiers, largest first; a new tier is sorted together with
# the one before it once it holds at least 1/TIER_RATIO of that one's rows (a binary counter:
# a key is sorted again about log2(table / new keys) times). Merge-on-read adds a batch's new
# files to a mirror's 10M keys every other batch, and sorting them into all of them cost
# 1-3 s each time; in tiers a batch sorts the small ones, and the largest only when the others
# add up to half of it. A search costs each tier's (measured: 0.16 s for 100k keys in 10M,
# 4 ms in 250k). Two sorted tiers of comparable size are sorted again, not merged: for 5M and
# 5M string keys a sort took 0.9 s, a merge (a search of one in the other, then a take of
# both) 2.2 s; a merge wins only for a small tier into a large one, which the ratio avoids.
TIER_RATIO = 2


@dataclass(frozen=True)
class MergedKeys:
    """Several files' keys sorted together, in a few tiers (`TIER_RATIO`): a batch's keys are
    searched once per tier, not once per file. The files' rows are numbered one file after the
    other; each file's keys are in one tier."""

    files: tuple[str, ...]  # their locations
    starts: np.ndarray  # file i's rows are numbered starts[i]:starts[i + 1]
    tiers: tuple[KeyLocator, ...]  # largest first

    @classmethod
    def of(cls, runs: Sequence[tuple[str, KeyLocator]]) -> MergedKeys:
        """From each file's location and its keys' locator (rows numbered in the file)."""
        return cls((), np.zeros(1, np.int64), ()).adding(runs)

    def adding(self, runs: Sequence[tuple[str, KeyLocator]]) -> MergedKeys:
        """With more files (as `of` takes them): their keys sorted together into a new tier,
        then the newest two tiers sorted together while the newest holds at least 1/TIER_RATIO
        of the rows of the one before it; the larger tiers are left as they are."""
        if not runs:
            return self
        starts = np.concatenate([self.starts, self.starts[-1] + np.cumsum([r.num_rows for _, r in runs])])
        located = [r for _, r in runs]
        tier = _sorted_together(located, [r.rows.astype(np.int64) + start
                                          for r, start in zip(located, starts[len(self.files):])])
        tiers = [*self.tiers, tier] if tier.num_rows else list(self.tiers)
        while len(tiers) > 1 and tiers[-1].num_rows * TIER_RATIO >= tiers[-2].num_rows:
            newest, before = tiers.pop(), tiers.pop()
            tiers.append(_sorted_together([before, newest], [before.rows, newest.rows]))
        return MergedKeys((*self.files, *(f for f, _ in runs)), starts.astype(np.int64), tuple(tiers))

    def keeping(self, files: Collection[str]) -> MergedKeys | None:
        """Those of its files among `files` (others left the table), without sorting again;
        None when none is."""
        kept = [i for i, f in enumerate(self.files) if f in files]
        if not kept:
            return None
        starts = np.concatenate([[0], np.cumsum(np.diff(self.starts)[kept])]).astype(np.int64)
        keep = np.zeros(len(self.files), bool)
        keep[kept] = True
        shift = np.zeros(len(self.files), np.int64)
        shift[kept] = starts[:-1] - self.starts[kept]
        tiers = []
        for tier in self.tiers:
            of_file = np.searchsorted(self.starts, tier.rows, side="right") - 1
            mine = keep[of_file]
            if mine.any():
                tiers.append(KeyLocator(tier.sorted_keys.filter(pa.array(mine)),
                                        tier.rows[mine] + shift[of_file[mine]], tier.unique))
        return MergedKeys(tuple(self.files[i] for i in kept), starts, tuple(tiers))

    def find(self, incoming: pa.Array) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per file, what `KeyLocator.find` finds in it."""
        found = [tier.find(incoming) for tier in self.tiers]
        numbered = np.concatenate([np.zeros(0, np.int64), *(rows for rows, _ in found)])
        needle = np.concatenate([np.zeros(0, np.int64), *(at for _, at in found)])
        if len(found) > 1:  # each tier's ascending: a file's rows are in one tier
            order = np.argsort(numbered, kind="stable")
            numbered, needle = numbered[order], needle[order]
        bounds = np.searchsorted(numbered, self.starts)
        return [(numbered[bounds[i]:bounds[i + 1]] - self.starts[i], needle[bounds[i]:bounds[i + 1]])
                for i in range(len(self.files))]

    def get_total_buffer_size(self) -> int:
        return sum(tier.get_total_buffer_size() for tier in self.tiers) + self.starts.nbytes


def _sorted_together(runs: Sequence[KeyLocator], rows: Sequence[np.ndarray]) -> KeyLocator:
    """The keys of sorted `runs`, numbered `rows` (each run's, renumbered as the caller needs),
    sorted into one locator: a sort, not a merge (see TIER_RATIO)."""
    keys = pa.chunked_array([r.sorted_keys for r in runs], type=runs[0].sorted_keys.type).combine_chunks()
    return KeyLocator.of(keys, np.concatenate([np.zeros(0, np.int64), *rows]))
