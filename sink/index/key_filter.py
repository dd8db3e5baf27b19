"""A membership filter of one keyspace's keys (a partition's, or the global one), asked for a
whole batch at once.

Most keys of a batch are new to the table; RocksDB's own bloom filters answer them too, but
through one Python call per key. This filter answers the batch with a few numpy operations,
so only the keys it may hold are looked up. It is a blocked bloom filter: each key sets
`BITS_SET` bits in one 64-bit word. It never says "absent" for a key it was given (no false
negatives); a false positive costs one RocksDB lookup that misses.

Sized at `BITS_PER_KEY` bits per key when built (2 bytes), it is rebuilt from the keyspace
once its keys have doubled, so it stays between 1 and 2 bytes per key.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import xxhash

from sink.xxh64 import xxh64

# Not Spark's seed (42): the keys of one shard share that hash's residue mod the shard count.
SEED = 0
BITS_PER_KEY = 16
BITS_SET = 5
MIN_WORDS = 64
_MAGIC = b"SINKKF1\x00"
# magic, the replica's token, keys, built_for, words, xxh64 of the words
_HEADER = struct.Struct("<8s8sQQQQ")
# The saved file of a replica's filters: magic, then per keyspace its id's length, its
# filter's length, the id and the filter (`KeyFilter.to_bytes`, which checks itself).
_SAVED_MAGIC = b"SINKKFS1"
_ENTRY = struct.Struct("<IQ")


def hashes(keys: Sequence[bytes] | pa.Array | pa.ChunkedArray) -> np.ndarray:
    """The filter's 64-bit hash of each key (XXH64, seed SEED)."""
    return xxh64(keys if isinstance(keys, pa.Array | pa.ChunkedArray) else pa.array(keys, pa.binary()), SEED)


def _words_for(keys: int) -> int:
    return max(MIN_WORDS, -(-keys * BITS_PER_KEY // 64))


def _masks(h: np.ndarray) -> np.ndarray:
    """The bits each hash sets in its word: `BITS_SET` 6-bit slices of its low 32 bits."""
    one = np.uint64(1)
    mask = np.zeros(len(h), np.uint64)
    for i in range(BITS_SET):
        mask |= one << ((h >> np.uint64(6 * i)) & np.uint64(63))
    return mask


@dataclass
class KeyFilter:
    words: np.ndarray  # uint64
    keys: int  # keys added (those the filter did not already hold count once)
    built_for: int  # keys it was sized for

    @classmethod
    def build(cls, h: np.ndarray) -> KeyFilter:
        words = np.zeros(_words_for(len(h)), np.uint64)
        built = cls(words, 0, len(h))
        built.add(h)
        return built

    def _slots(self, h: np.ndarray) -> np.ndarray:
        """The word of each hash (multiply-shift on its high 32 bits: no modulo bias)."""
        return ((h >> np.uint64(32)) * np.uint64(len(self.words))) >> np.uint64(32)

    def may_contain(self, h: np.ndarray) -> np.ndarray:
        """False where the key is certainly absent."""
        if not len(h):
            return np.zeros(0, bool)
        masks = _masks(h)
        return (self.words[self._slots(h)] & masks) == masks

    def add(self, h: np.ndarray) -> None:
        if not len(h):
            return
        self.keys += int(np.count_nonzero(~self.may_contain(h)))
        np.bitwise_or.at(self.words, self._slots(h), _masks(h))

    @property
    def full(self) -> bool:
        """Its keys have doubled since it was sized: rebuild it."""
        return self.keys > 2 * max(self.built_for, MIN_WORDS * 64 // BITS_PER_KEY)

    @property
    def nbytes(self) -> int:
        return self.words.nbytes

    def to_bytes(self, token: bytes) -> bytes:
        body = self.words.astype("<u8").tobytes()
        header = _HEADER.pack(_MAGIC, token, self.keys, self.built_for, len(self.words), xxhash.xxh64_intdigest(body))
        return header + body

    @classmethod
    def from_bytes(cls, raw: bytes, token: bytes) -> KeyFilter | None:
        """The filter saved with `token`; None when the bytes are not one whole (a truncated
        or damaged file), or were saved with another token (the keyspace changed since)."""
        if len(raw) < _HEADER.size:
            return None
        magic, saved_with, keys, built_for, words, checksum = _HEADER.unpack_from(raw)
        body = raw[_HEADER.size:]
        if magic != _MAGIC or saved_with != token or not words or len(body) != 8 * words \
                or xxhash.xxh64_intdigest(body) != checksum:
            return None
        return cls(np.frombuffer(body, "<u8").astype(np.uint64), keys, built_for)


def saved_bytes(filters: dict[str, bytes]) -> bytes:
    """One file's bytes for every keyspace's saved filter (pid -> `KeyFilter.to_bytes`)."""
    parts = [_SAVED_MAGIC]
    for pid, raw in filters.items():
        name = pid.encode()
        parts += [_ENTRY.pack(len(name), len(raw)), name, raw]
    return b"".join(parts)


def read_saved(data: bytes) -> dict[str, bytes]:
    """The filters in `saved_bytes`' output, pid -> bytes for `KeyFilter.from_bytes`; a
    truncated tail, or a file of another format, yields what is whole before it (nothing)."""
    if not data.startswith(_SAVED_MAGIC):
        return {}
    out, at = {}, len(_SAVED_MAGIC)
    while at + _ENTRY.size <= len(data):
        name_len, raw_len = _ENTRY.unpack_from(data, at)
        at += _ENTRY.size
        if at + name_len + raw_len > len(data):
            break
        pid = data[at:at + name_len].decode(errors="replace")
        out[pid] = data[at + name_len:at + name_len + raw_len]
        at += name_len + raw_len
    return out
