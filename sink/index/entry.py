"""What the index stores per key: the ordering value and whether the key is deleted."""

from __future__ import annotations

import struct
from typing import NamedTuple

_PACK = struct.Struct("<q?")


class Entry(NamedTuple):
    ordering: int
    deleted: bool = False

    def pack(self) -> bytes:
        return _PACK.pack(self.ordering, self.deleted)

    @classmethod
    def unpack(cls, raw: bytes) -> Entry:
        return cls(*_PACK.unpack(raw))
