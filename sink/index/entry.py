"""What the index stores per key: the ordering value (one int64 per ordering column), whether
the key is deleted and, for a deleted key, when (the deleting batch's time, seconds since
the epoch; 0 when unknown): `tombstone_ttl_hours` expires deletes by it.

Packed little-endian as the int64 ordering values, one deleted byte and the int64
deleted-at (17 bytes with one ordering column); the *_many helpers do whole batches through
numpy, so no per-key struct calls sit on the hot path. In global scope the entry also says
where the key lives: its partition id follows.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from functools import cache
from typing import NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from sink.ordering import stack

SIZE = struct.calcsize("<q?q")  # with one ordering column


def size(width: int) -> int:
    """Bytes of an entry with `width` ordering columns (a located entry's partition follows)."""
    return SIZE + 8 * (width - 1)


@cache
def _dtype(width: int, flag: str = "?") -> np.dtype:
    return np.dtype([("ordering", "<i8", (width,)), ("deleted", flag), ("deleted_at", "<i8")])


def ordering_names(width: int) -> list[str]:
    """The ordering columns of a changes table."""
    return ["ordering"] + [f"ordering_{i}" for i in range(1, width)]


@cache
def changes_schema(width: int = 1) -> pa.Schema:
    """Entries a batch changes, as tagging returns them and staging stores them."""
    return pa.schema([("pid", pa.string()), ("key", pa.binary()), *((n, pa.int64()) for n in ordering_names(width)),
                      ("deleted", pa.bool_()), ("deleted_at", pa.int64())])


CHANGES_SCHEMA = changes_schema(1)


def width_of(names: Sequence[str]) -> int:
    """Ordering columns among a changes table's (or changelog file's) column names."""
    return sum(1 for n in names if n == "ordering" or n.startswith("ordering_"))


def change_orderings(changes: pa.Table) -> np.ndarray:
    """The (n, width) ordering values of a changes table."""
    names = ordering_names(width_of(changes.column_names))
    return stack([changes.column(n) for n in names])


class Entry(NamedTuple):
    ordering: int | tuple[int, ...]  # a tuple with several ordering columns
    deleted: bool = False
    deleted_at: int = 0

    def values(self) -> tuple[int, ...]:
        return self.ordering if isinstance(self.ordering, tuple) else (self.ordering,)

    def pack(self) -> bytes:
        values = self.values()
        return struct.pack(f"<{len(values)}q?q", *values, self.deleted, self.deleted_at)

    @classmethod
    def unpack(cls, raw: bytes) -> Entry:
        width = (len(raw) - SIZE) // 8 + 1
        *values, deleted, deleted_at = struct.unpack(f"<{width}q?q", raw)
        return cls(values[0] if width == 1 else tuple(values), deleted, deleted_at)

    @classmethod
    def of(cls, values: Sequence[int], deleted: bool = False, deleted_at: int = 0) -> Entry:
        """From one int per ordering column."""
        values = tuple(int(v) for v in values)
        return cls(values[0] if len(values) == 1 else values, bool(deleted), int(deleted_at))


def entries_of_changes(changes: pa.Table) -> dict[str, dict[bytes, Entry]]:
    """A changes table as partition id -> key -> entry."""
    out: dict[str, dict[bytes, Entry]] = {}
    for row, values in zip(changes.to_pylist(), change_orderings(changes).tolist()):
        out.setdefault(row["pid"], {})[row["key"]] = Entry.of(values, row["deleted"], row["deleted_at"])
    return out


def pack_array(orderings: np.ndarray | Sequence[int], deleted: np.ndarray | Sequence[bool],
               deleted_at: np.ndarray | Sequence[int] | int = 0) -> pa.BinaryArray:
    """Packed values of aligned ordering ((n,) or (n, width)) / deleted / deleted-at arrays, as
    one Arrow array over a single buffer (no Python object per value)."""
    orderings = np.asarray(orderings, np.int64)
    orderings = orderings.reshape(len(orderings), -1) if orderings.size else orderings.reshape(0, 1)
    n, width = orderings.shape
    records = np.zeros(n, _dtype(width))
    records["ordering"] = orderings
    records["deleted"] = deleted
    records["deleted_at"] = np.where(records["deleted"], deleted_at, 0)
    offsets = np.arange(0, (n + 1) * size(width), size(width), dtype=np.int32)
    return pa.Array.from_buffers(pa.binary(), n, [None, pa.py_buffer(offsets), pa.py_buffer(records.tobytes())])


def pack_many(orderings: np.ndarray | Sequence[int], deleted: np.ndarray | Sequence[bool],
              deleted_at: np.ndarray | Sequence[int] | int = 0) -> list[bytes]:
    """`pack_array`'s values as bytes objects (what RocksDB writes take)."""
    return pack_array(orderings, deleted, deleted_at).to_pylist()


@cache
def _missing(width: int) -> bytes:
    """Stands in for "not found" while unpacking: deleted byte 2 never occurs in a real entry."""
    return b"\x00" * 8 * width + b"\x02" + b"\x00" * 8


def unpack_many(raws: Sequence[bytes | None], width: int = 1) -> tuple[np.ndarray, np.ndarray, np.ndarray,
                                                                        np.ndarray]:
    """(found, orderings (n, width), deleted, deleted_at) arrays of packed values, None
    meaning not found (0/False there)."""
    if not len(raws):
        return np.zeros(0, bool), np.zeros((0, width), np.int64), np.zeros(0, bool), np.zeros(0, np.int64)
    missing = _missing(width)
    records = np.frombuffer(b"".join([missing if r is None else r for r in raws]), _dtype(width, "u1"))
    found = records["deleted"] != 2
    return (found, np.where(found[:, None], records["ordering"], 0), records["deleted"] == 1,
            records["deleted_at"].copy())


def expire_before(ttl_seconds: int | None, now: float) -> int | None:
    """Deletes stamped before this (seconds since the epoch) have expired as of `now` under
    `tombstone_ttl_seconds`; None: none expire. The one cutoff for index entries and
    tombstone rows alike."""
    return None if ttl_seconds is None else int(now) - ttl_seconds


def expired(found: np.ndarray, deleted: np.ndarray, deleted_at: np.ndarray, expire_before: int | None) -> np.ndarray:
    """Which entries are deletes older than `expire_before` (None: none expire): tagging
    treats them as absent, so a late update of such a key writes it again."""
    if expire_before is None:
        return np.zeros(len(found), bool)
    return found & deleted & (deleted_at < expire_before)


def pack_located_many(orderings, deleted, locations: Sequence[str] | pa.Array, deleted_at=0) -> list[bytes]:
    """Packed values that also carry each key's partition id (global scope)."""
    located = pa.array(locations, pa.string()) if not isinstance(locations, pa.Array) else locations
    return pc.binary_join_element_wise(pack_array(orderings, deleted, deleted_at), located.cast(pa.binary()),
                                       b"").to_pylist()


def unpack_located_many(raws: Sequence[bytes | None], width: int = 1) -> tuple[
        np.ndarray, np.ndarray, np.ndarray, np.ndarray, list[str | None]]:
    """`unpack_many` of located values, plus each key's partition id (None when not found)."""
    n = size(width)
    found, orderings, deleted, deleted_at = unpack_many([None if r is None else r[:n] for r in raws], width)
    return found, orderings, deleted, deleted_at, [None if r is None else r[n:].decode() for r in raws]
