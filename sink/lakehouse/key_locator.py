"""Where a data file holds given keys, found in time that grows with the keys looked up, not
with the file: its keys sorted once, then a binary search per key. A file merge-on-read
leaves in place is probed again by every batch that updates its partition; `pc.index_in` over
its keys would hash every row of it each time."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc


@dataclass(frozen=True)
class KeyLocator:
    """One file's keys (`rewrite.row_keys`), sorted, and each one's row in the file."""

    sorted_keys: pa.Array
    rows: np.ndarray
    unique: bool  # no key repeated: each incoming key finds one row at most

    @classmethod
    def of(cls, keys: pa.Array) -> KeyLocator:
        order = pc.sort_indices(keys)  # nulls last, where search_sorted expects them
        ordered = keys.take(order)
        # Sorted, a repeated key sits next to itself (nulls, all last, compare as null).
        repeated = len(ordered) > 1 and (ordered.null_count > 1 or pc.any(
            pc.equal(ordered.slice(1), ordered.slice(0, len(ordered) - 1))).as_py() is True)
        return cls(ordered, order.to_numpy(), not repeated)

    @property
    def num_rows(self) -> int:
        return len(self.rows)

    def get_total_buffer_size(self) -> int:
        return self.sorted_keys.get_total_buffer_size() + self.rows.nbytes

    def find(self, incoming: pa.Array) -> tuple[np.ndarray, np.ndarray]:
        """The file's rows holding a key of `incoming`, ascending, and each one's position in
        `incoming` (the first, when `incoming` repeats the key): what `pc.index_in(keys,
        value_set=incoming)` says, without a value per row of the file."""
        lo = pc.fill_null(pc.search_sorted(self.sorted_keys, incoming, side="left"), 0).to_numpy()
        if self.unique:  # a key's run is its row at `lo`, when that row holds it
            if not self.num_rows:
                return np.zeros(0, np.int64), np.zeros(0, np.int64)
            equal = pc.equal(self.sorted_keys.take(np.minimum(lo, self.num_rows - 1)), incoming)
            needle = np.flatnonzero(pc.fill_null(equal, False).to_numpy(zero_copy_only=False))
            rows = self.rows[lo[needle]].astype(np.int64)
            # By row; a stable sort keeps a repeated incoming key's first position first.
            order = np.argsort(rows, kind="stable")
            rows, needle = rows[order], needle[order]
            first = np.ones(len(rows), bool)
            first[1:] = rows[1:] != rows[:-1]
            return rows[first], needle[first]
        hi = pc.fill_null(pc.search_sorted(self.sorted_keys, incoming, side="right"), 0).to_numpy()
        counts = (hi - lo).astype(np.int64)
        # Each incoming key's run of equal keys in the sorted file (a file may repeat a key).
        needle = np.repeat(np.arange(len(incoming), dtype=np.int64), counts)
        first = np.cumsum(counts) - counts
        rows = self.rows[np.arange(len(needle)) - np.repeat(first, counts) + np.repeat(lo, counts).astype(np.int64)]
        order = np.lexsort((needle, rows))  # by row, then the first incoming position
        found, where = np.unique(rows[order], return_index=True)
        return found.astype(np.int64), needle[order][where]
