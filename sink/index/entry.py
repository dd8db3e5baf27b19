"""What the index stores per key: the ordering value and whether the key is deleted.

Packed as 9 bytes (little-endian int64 ordering, one deleted byte); the *_many helpers
do whole batches through numpy, so no per-key struct calls sit on the hot path. In global
scope the entry also says where the key lives: its partition id follows the 9 bytes.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import pyarrow as pa

_PACK = struct.Struct("<q?")
SIZE = _PACK.size
_DTYPE = np.dtype([("ordering", "<i8"), ("deleted", "?")])
# Entries a batch changes, as tagging returns them and staging stores them.
CHANGES_SCHEMA = pa.schema([("pid", pa.string()), ("key", pa.binary()), ("ordering", pa.int64()),
                            ("deleted", pa.bool_())])


class Entry(NamedTuple):
    ordering: int
    deleted: bool = False

    def pack(self) -> bytes:
        return _PACK.pack(self.ordering, self.deleted)

    @classmethod
    def unpack(cls, raw: bytes) -> Entry:
        return cls(*_PACK.unpack(raw))


def pack_many(orderings: np.ndarray | Sequence[int], deleted: np.ndarray | Sequence[bool]) -> list[bytes]:
    """Packed values of aligned ordering / deleted arrays."""
    records = np.empty(len(orderings), _DTYPE)
    records["ordering"] = orderings
    records["deleted"] = deleted
    buf = records.tobytes()
    return [buf[i:i + SIZE] for i in range(0, len(buf), SIZE)]


# Stands in for "not found" while unpacking: deleted byte 2 never occurs in a real entry.
_MISSING = b"\x00" * 8 + b"\x02"


def unpack_many(raws: Sequence[bytes | None]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(found, orderings, deleted) arrays of packed values, None meaning not found
    (orderings and deleted are 0/False there)."""
    if not len(raws):
        return np.zeros(0, bool), np.zeros(0, np.int64), np.zeros(0, bool)
    records = np.frombuffer(b"".join([_MISSING if r is None else r for r in raws]),
                            np.dtype([("ordering", "<i8"), ("flag", "u1")]))
    found = records["flag"] != 2
    return found, np.where(found, records["ordering"], 0), records["flag"] == 1


def pack_located_many(orderings, deleted, locations: Sequence[str]) -> list[bytes]:
    """Packed values that also carry each key's partition id (global scope)."""
    return [raw + loc.encode() for raw, loc in zip(pack_many(orderings, deleted), locations)]


def unpack_located_many(raws: Sequence[bytes | None]) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[str | None]]:
    """`unpack_many` of located values, plus each key's partition id (None when not found)."""
    found, orderings, deleted = unpack_many([None if r is None else r[:SIZE] for r in raws])
    return found, orderings, deleted, [None if r is None else r[SIZE:].decode() for r in raws]
