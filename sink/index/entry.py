"""What the index stores per key: the ordering value, whether the key is deleted and, for a
deleted key, when (the deleting batch's time, seconds since the epoch; 0 when unknown):
`tombstone_ttl_hours` expires deletes by it.

Packed as 17 bytes (little-endian int64 ordering, one deleted byte, int64 deleted-at); the
*_many helpers do whole batches through numpy, so no per-key struct calls sit on the hot
path. In global scope the entry also says where the key lives: its partition id follows.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import pyarrow as pa

_PACK = struct.Struct("<q?q")
SIZE = _PACK.size
_DTYPE = np.dtype([("ordering", "<i8"), ("deleted", "?"), ("deleted_at", "<i8")])
# Entries a batch changes, as tagging returns them and staging stores them.
CHANGES_SCHEMA = pa.schema([("pid", pa.string()), ("key", pa.binary()), ("ordering", pa.int64()),
                            ("deleted", pa.bool_()), ("deleted_at", pa.int64())])


class Entry(NamedTuple):
    ordering: int
    deleted: bool = False
    deleted_at: int = 0

    def pack(self) -> bytes:
        return _PACK.pack(self.ordering, self.deleted, self.deleted_at)

    @classmethod
    def unpack(cls, raw: bytes) -> Entry:
        return cls(*_PACK.unpack(raw))


def pack_many(orderings: np.ndarray | Sequence[int], deleted: np.ndarray | Sequence[bool],
              deleted_at: np.ndarray | Sequence[int] | int = 0) -> list[bytes]:
    """Packed values of aligned ordering / deleted / deleted-at arrays."""
    records = np.zeros(len(orderings), _DTYPE)
    records["ordering"] = orderings
    records["deleted"] = deleted
    records["deleted_at"] = np.where(records["deleted"], deleted_at, 0)
    buf = records.tobytes()
    return [buf[i:i + SIZE] for i in range(0, len(buf), SIZE)]


# Stands in for "not found" while unpacking: deleted byte 2 never occurs in a real entry.
_MISSING = b"\x00" * 8 + b"\x02" + b"\x00" * 8


def unpack_many(raws: Sequence[bytes | None]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(found, orderings, deleted, deleted_at) arrays of packed values, None meaning not
    found (0/False there)."""
    if not len(raws):
        return np.zeros(0, bool), np.zeros(0, np.int64), np.zeros(0, bool), np.zeros(0, np.int64)
    records = np.frombuffer(b"".join([_MISSING if r is None else r for r in raws]),
                            np.dtype([("ordering", "<i8"), ("flag", "u1"), ("deleted_at", "<i8")]))
    found = records["flag"] != 2
    return found, np.where(found, records["ordering"], 0), records["flag"] == 1, records["deleted_at"].copy()


def expired(found: np.ndarray, deleted: np.ndarray, deleted_at: np.ndarray, expire_before: int | None) -> np.ndarray:
    """Which entries are deletes older than `expire_before` (None: none expire): tagging
    treats them as absent, so a late update of such a key writes it again."""
    if expire_before is None:
        return np.zeros(len(found), bool)
    return found & deleted & (deleted_at < expire_before)


def pack_located_many(orderings, deleted, locations: Sequence[str], deleted_at=0) -> list[bytes]:
    """Packed values that also carry each key's partition id (global scope)."""
    return [raw + loc.encode() for raw, loc in zip(pack_many(orderings, deleted, deleted_at), locations)]


def unpack_located_many(raws: Sequence[bytes | None]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray,
                                                               list[str | None]]:
    """`unpack_many` of located values, plus each key's partition id (None when not found)."""
    found, orderings, deleted, deleted_at = unpack_many([None if r is None else r[:SIZE] for r in raws])
    return found, orderings, deleted, deleted_at, [None if r is None else r[SIZE:].decode() for r in raws]
