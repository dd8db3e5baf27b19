"""A replica's metadata, in RocksDB's `default` column family: format, key spec, the Delta
version it reflects, the batch staged on top of it, the clean/dirty flag and the close's
token, and one record per partition held (loaded when, last used when, why)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from dataclasses import dataclass

from rocksdict import Rdict

from sink.index.spec import is_global, ordering_width

FORMAT_VERSION = "2"  # 2: deleted entries carry their delete's time
_FORMAT = b"format"
_SPEC = b"spec"
_VERSION = b"version"
_STAGED_BATCH = b"staged_batch"
_STAGED_DATA = b"staged_data"
_STAGED_READ = b"staged_read_version"  # the table version the staged batch was tagged against
_DIRTY = b"dirty"
_TOKEN = b"token"  # new at every clean close: tells a process its memory tier is current
_PART = b"part:"
_INVALIDATED = b"invalidated:"  # dropped by catch-up; its next load counts as caused by that
_SNAPSHOT = b"snapshot_version"  # the version of its last snapshot (published, tried, or restored from)
_PEEKED = b"peeked:"  # a partition not held, read for a batch's keys: how often since when


@dataclass(frozen=True)
class PartitionInfo:
    loaded_entries: int
    loaded_at: float
    last_access: float
    reason: str


class ReplicaMeta:
    """The metadata of one open replica."""

    def __init__(self, db: Rdict):
        self._db = db
        self._located: bool | None = None
        self._width: int | None = None

    # --- what the replica is -------------------------------------------------------------------

    @property
    def spec(self) -> str | None:
        raw = self._db.get(_SPEC)
        return None if raw is None else raw.decode()

    @property
    def located(self) -> bool:
        """Global scope: one keyspace whose entries carry the key's partition."""
        if self._located is None:
            self._located = is_global(self.spec)
        return self._located

    @property
    def width(self) -> int:
        """Ordering columns per entry."""
        if self._width is None:
            self._width = ordering_width(self.spec)
        return self._width

    def usable_for(self, spec: str) -> bool:
        """Of this format and spec, and not left dirty by a process that died with it open."""
        return self._db.get(_FORMAT) == FORMAT_VERSION.encode() and self._db.get(_SPEC) == spec.encode() and self.clean

    def start(self, spec: str) -> None:
        """An empty replica's first records."""
        self._db[_FORMAT] = FORMAT_VERSION.encode()
        self._db[_SPEC] = spec.encode()

    # --- clean or in use ---------------------------------------------------------------------------

    @property
    def clean(self) -> bool:
        """False while a process has it open, or after one died with it open."""
        return self._db.get(_DIRTY) != b"1"

    @property
    def token(self) -> bytes | None:
        return self._db.get(_TOKEN)

    def mark_dirty(self) -> None:
        """Mark the replica in use (the WAL is off: a process that dies now leaves it dirty)."""
        self._db[_DIRTY] = b"1"
        self._db.flush()

    def mark_clean(self, token: bytes) -> None:
        """After a full flush: clean, under a new close token."""
        self._db[_TOKEN] = token
        self._db[_DIRTY] = b"0"
        self._db.flush()

    # --- version and the staged batch ------------------------------------------------------------

    @property
    def version(self) -> int | None:
        return self._int(_VERSION)

    def set_version(self, version: int) -> None:
        self._db[_VERSION] = str(version).encode()

    @property
    def snapshot_version(self) -> int | None:
        return self._int(_SNAPSHOT)

    def set_snapshot_version(self, version: int) -> None:
        self._db[_SNAPSHOT] = str(version).encode()

    @property
    def staged_batch(self) -> int | None:
        return self._int(_STAGED_BATCH)

    @property
    def staged_read_version(self) -> int | None:
        return self._int(_STAGED_READ)

    @property
    def staged_data(self) -> bytes | None:
        return self._db.get(_STAGED_DATA)

    def set_staged(self, batch_id: int, data: bytes, read_version: int | None) -> None:
        self._db[_STAGED_DATA] = data
        self._db[_STAGED_BATCH] = str(batch_id).encode()
        if read_version is None:
            self._delete(_STAGED_READ)
        else:
            self._db[_STAGED_READ] = str(read_version).encode()

    def discard_staged(self) -> None:
        for key in (_STAGED_DATA, _STAGED_BATCH, _STAGED_READ):
            self._delete(key)

    # --- partitions --------------------------------------------------------------------------------

    def partitions(self) -> dict[str, PartitionInfo]:
        """The partitions held, complete ones only."""
        out = {}
        for key, raw in self._db.items(from_key=_PART):
            if not key.startswith(_PART):
                break
            out[key[len(_PART):].decode()] = PartitionInfo(**json.loads(raw))
        return out

    def has_partition(self, pid: str) -> bool:
        return self._db.get(_PART + pid.encode()) is not None

    def was_invalidated(self, pid: str) -> bool:
        """Dropped by catch-up (a commit changed it) and not loaded since."""
        return self._db.get(_INVALIDATED + pid.encode()) is not None

    def record_peek(self, pid: str, now: float, window_s: float) -> int:
        """Note that partition `pid`, not held, is read for a batch's keys at `now`; returns how
        many such reads (this one included) it had within `window_s` of the first. Its load
        forgets them."""
        meta_key = _PEEKED + pid.encode()
        raw = self._db.get(meta_key)
        rec = json.loads(raw) if raw is not None else None
        if rec is None or now - rec["since"] > window_s:
            rec = {"since": now, "count": 0}
        rec["count"] += 1
        self._db[meta_key] = json.dumps(rec).encode()
        return rec["count"]

    def record_load(self, pid: str, info: PartitionInfo) -> None:
        """Partition `pid` is complete (its peeks and invalidation are forgotten)."""
        self._db[_PART + pid.encode()] = json.dumps(info.__dict__).encode()
        self._delete(_INVALIDATED + pid.encode())
        self._delete(_PEEKED + pid.encode())

    def forget_partition(self, pid: str, invalidated: bool) -> None:
        self._delete(_PART + pid.encode())
        if invalidated:
            self._db[_INVALIDATED + pid.encode()] = b"1"

    def forget_partitions(self) -> None:
        for prefix in (_PART, _INVALIDATED, _PEEKED):
            for key in [k for k, _ in self._db.items(from_key=prefix) if k.startswith(prefix)]:
                del self._db[key]

    def touch(self, pids: Iterable[str], now: float | None = None) -> None:
        now = time.time() if now is None else now
        for pid in pids:
            meta_key = _PART + pid.encode()
            raw = self._db.get(meta_key)
            if raw is not None:
                rec = json.loads(raw)
                rec["last_access"] = now
                self._db[meta_key] = json.dumps(rec).encode()

    def _int(self, key: bytes) -> int | None:
        raw = self._db.get(key)
        return None if raw is None else int(raw)

    def _delete(self, key: bytes) -> None:
        if self._db.get(key) is not None:
            del self._db[key]
