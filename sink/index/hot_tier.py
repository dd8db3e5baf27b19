"""The memory tier: an LRU of recently used committed entries in front of a shard's RocksDB.

It holds only what the replica's committed view holds: every write path of the replica
(load, promotion, change feed, drop) updates or drops it, and a tier is only reused by
a process when the replica carries the token the process wrote when it last closed it
(anything else touched the replica in between: the tier is cleared).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class HotTier:
    def __init__(self, capacity: int):
        self.capacity = capacity
        self._entries: OrderedDict[tuple[str, bytes], bytes] = OrderedDict()
        self.token: bytes | None = None  # the replica's token this tier is valid for

    def __len__(self) -> int:
        return len(self._entries)

    def get_many(self, pid: str, keys: Sequence[bytes]) -> list[bytes | None]:
        entries = self._entries
        out: list[bytes | None] = []
        append = out.append
        for key in keys:
            k = (pid, key)
            raw = entries.get(k)
            if raw is not None:
                entries.move_to_end(k)
            append(raw)
        return out

    def put_many(self, pid: str, keys: Sequence[bytes], raws: Sequence[bytes]) -> None:
        if self.capacity <= 0:
            return
        entries = self._entries
        for key, raw in zip(keys, raws):
            k = (pid, key)
            entries[k] = raw
            entries.move_to_end(k)
        while len(entries) > self.capacity:
            entries.popitem(last=False)

    def drop_partition(self, pid: str) -> None:
        for k in [k for k in self._entries if k[0] == pid]:
            del self._entries[k]

    def clear(self) -> None:
        self._entries.clear()


# One tier per replica directory per process (a Python worker runs one task at a time).
_TIERS: dict[str, HotTier] = {}


def tier_for(path: str, capacity: int, token: bytes | None) -> HotTier:
    """This process's tier for a replica, emptied unless it is valid for `token`."""
    tier = _TIERS.get(path)
    if tier is None or tier.capacity != capacity:
        tier = _TIERS[path] = HotTier(capacity)
    if token is None or tier.token != token:
        tier.clear()
    return tier
