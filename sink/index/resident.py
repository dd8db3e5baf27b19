"""A keyspace held whole in memory: every committed entry of one keyspace as columns sorted
by key hash, so a batch's lookups in it are a few numpy and Arrow operations instead of a
RocksDB call per key.

Exact: a key's hash only finds the candidates, the key's bytes decide, and a key the
columns (and their overlay) lack is absent from the keyspace. Writes made after the build go
to an overlay, folded into the columns once it holds a quarter as many entries.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from sink.index.key_filter import hashes

MIN_FOLD = 4096  # overlay entries below which it is never folded
_OVERLAY_ENTRY_BYTES = 180  # a dict slot and two small bytes objects, measured with sys.getsizeof


class Resident:
    """One keyspace's committed entries: `keys` and `raws` in the order of their sorted
    `hashes`, and the entries written since (`overlay`, key -> packed entry)."""

    def __init__(self, key_hashes: np.ndarray, keys: pa.Array, raws: pa.Array):
        self._set_columns(key_hashes, keys, raws, "quicksort")

    def _set_columns(self, key_hashes: np.ndarray, keys: pa.Array, raws: pa.Array, sort: str) -> None:
        order = np.argsort(key_hashes, kind=sort)
        self.hashes = key_hashes[order]
        self.keys = keys.take(order).cast(pa.binary())
        self.raws = raws.take(order).cast(pa.binary())
        self.overlay: dict[bytes, bytes] = {}

    @classmethod
    def of(cls, keys: Sequence[bytes], raws: Sequence[bytes]) -> Resident:
        return cls(hashes(keys), _binary(keys), _binary(raws))

    def __len__(self) -> int:
        """Entries held, counting an overlay entry that replaces a column entry twice."""
        return len(self.hashes) + len(self.overlay)

    @property
    def nbytes(self) -> int:
        return (self.hashes.nbytes + self.keys.nbytes + self.raws.nbytes
                + len(self.overlay) * _OVERLAY_ENTRY_BYTES + sys.getsizeof(self.overlay))

    def positions(self, keys: Sequence[bytes], key_hashes: np.ndarray) -> np.ndarray:
        """Each key's row in the columns, -1 where they lack it."""
        n = len(self.hashes)
        out = np.full(len(keys), -1, np.int64)
        if not n or not len(keys):
            return out
        first = np.searchsorted(self.hashes, key_hashes)
        at = np.minimum(first, n - 1)
        candidates = np.flatnonzero((first < n) & (self.hashes[at] == key_hashes))
        if not len(candidates):
            return out
        rows = at[candidates]
        same = pc.equal(_binary(_taken(keys, candidates)), self.keys.take(rows)).to_numpy(False)
        out[candidates[same]] = rows[same]
        for i, row in zip(candidates[~same].tolist(), rows[~same].tolist()):
            out[i] = self._in_run(keys[i], key_hashes[i], row + 1)  # another key has the same hash: rare
        return out

    def _in_run(self, key: bytes, key_hash: np.uint64, row: int) -> int:
        """The row of `key` among the rows from `row` on that have its hash."""
        while row < len(self.hashes) and self.hashes[row] == key_hash:
            if self.keys[row].as_py() == key:
                return row
            row += 1
        return -1

    def get_many(self, keys: Sequence[bytes], key_hashes: np.ndarray) -> list[bytes | None]:
        """The packed entry of each key, None where the keyspace lacks it."""
        rows = self.positions(keys, key_hashes)
        found = np.flatnonzero(rows >= 0)
        out: list[bytes | None] = [None] * len(keys)
        for i, raw in zip(found.tolist(), self.raws.take(rows[found]).to_pylist()):
            out[i] = raw
        if self.overlay:
            overlay = self.overlay
            for i, key in enumerate(keys):
                raw = overlay.get(key)
                if raw is not None:
                    out[i] = raw
        return out

    def put_many(self, keys: Sequence[bytes], raws: Sequence[bytes]) -> None:
        self.overlay.update(zip(keys, raws))
        if len(self.overlay) >= max(MIN_FOLD, len(self.hashes) // 4):
            self._fold()

    def _fold(self) -> None:
        """The overlay into the columns: the rows it replaces dropped, its entries added."""
        keys, raws = list(self.overlay), list(self.overlay.values())
        key_hashes = hashes(keys)
        kept = np.ones(len(self.hashes), bool)
        replaced = self.positions(keys, key_hashes)
        kept[replaced[replaced >= 0]] = False
        order = np.argsort(key_hashes)
        # Two sorted runs: a stable sort merges them in linear time.
        self._set_columns(np.concatenate([self.hashes[kept], key_hashes[order]]),
                          pa.concat_arrays([self.keys.filter(kept), _binary(keys).take(order)]),
                          pa.concat_arrays([self.raws.filter(kept), _binary(raws).take(order)]), "stable")


def _binary(values: Sequence[bytes]) -> pa.Array:
    # Built as large binary, some 20x faster from a list of bytes here, then cast.
    return pa.array(values, pa.large_binary()).cast(pa.binary())


def _taken(keys: Sequence[bytes], where: np.ndarray) -> list[bytes]:
    return [keys[i] for i in where.tolist()]
