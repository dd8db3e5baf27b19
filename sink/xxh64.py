"""XXH64 of every value of an Arrow binary array, in numpy: the digest `xxhash.xxh64_intdigest`
gives (and Spark's xxhash64 of a string, with its seed 42), without a Python call per value.

Values of one length take the same steps, so each length's values are hashed together, a
bounded number at a time, reading their words through unaligned views of the data buffer.
A replica's load hashes every key of the table for its shard (which also tells its keys
distinct, sink.index.loader) and its own keys again for its key filter."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

_P1 = np.uint64(0x9E3779B185EBCA87)
_P2 = np.uint64(0xC2B2AE3D27D4EB4F)
_P3 = np.uint64(0x165667B19E3779F9)
_P4 = np.uint64(0x85EBCA77C2B2AE63)
_P5 = np.uint64(0x27D4EB2F165667C5)
_MASK = (1 << 64) - 1
GROUP_VALUES = 1 << 20  # values hashed at once: bounds the temporaries (a few arrays of this many words)


def xxh64(values: pa.Array | pa.ChunkedArray, seed: int = 0) -> np.ndarray:
    """The uint64 XXH64 digest of each value (binary or string). A null gives `seed`, as
    Spark's xxhash64 of a null does."""
    if isinstance(values, pa.ChunkedArray):  # chunk by chunk: their sum may pass 2 GiB
        return np.concatenate([np.zeros(0, np.uint64), *(xxh64(chunk, seed) for chunk in values.chunks)])
    values = pc.cast(values, pa.large_binary())
    n = len(values)
    offsets = np.frombuffer(values.buffers()[1], np.int64)[values.offset:values.offset + n + 1]
    starts, lengths = offsets[:-1], np.diff(offsets)
    nulls = values.is_null().to_numpy(zero_copy_only=False) if values.null_count else np.zeros(n, bool)
    data = _Words(values.buffers()[2])
    out = np.full(n, seed & _MASK, np.uint64)
    with np.errstate(over="ignore"):
        for length in np.flatnonzero(np.bincount(lengths[~nulls])).tolist():
            rows = np.flatnonzero((lengths == length) & ~nulls)
            for at in range(0, len(rows), GROUP_VALUES):
                part = rows[at:at + GROUP_VALUES]
                out[part] = _digest(data, starts[part], length, seed)
    return out


class _Words:
    """Little-endian 8-, 4- and 1-byte words at any byte offset of a buffer (zero past its end)."""

    def __init__(self, buffer: pa.Buffer | None):
        data = np.frombuffer(buffer, np.uint8) if buffer is not None else np.zeros(0, np.uint8)
        self.padded = np.zeros(len(data) + 8, np.uint8)
        self.padded[:len(data)] = data
        self.u64 = np.ndarray((len(data) + 1,), "<u8", self.padded, 0, (1,))
        self.u32 = np.ndarray((len(data) + 5,), "<u4", self.padded, 0, (1,))

    def read(self, width: int, at: np.ndarray) -> np.ndarray:
        words = {8: self.u64, 4: self.u32, 1: self.padded}[width][at]
        return words if width == 8 else words.astype(np.uint64)


def _rotl(x: np.ndarray, r: int) -> np.ndarray:
    return (x << np.uint64(r)) | (x >> np.uint64(64 - r))


def _round(acc: np.ndarray, lane: np.ndarray) -> np.ndarray:
    """XXH64's round; `lane` is consumed (changed in place: one temporary fewer per step)."""
    lane *= _P2
    lane += acc
    return _rotl(lane, 31) * _P1


def _digest(data: _Words, starts: np.ndarray, length: int, seed: int) -> np.ndarray:
    """XXH64 (the reference's steps) of the `length`-byte values at `starts`."""
    n, at = len(starts), 0
    if length >= 32:
        v = [np.full(n, (seed + init) & _MASK, np.uint64) for init in (int(_P1) + int(_P2), int(_P2), 0, -int(_P1))]
        while at + 32 <= length:
            v = [_round(acc, data.read(8, starts + (at + 8 * i))) for i, acc in enumerate(v)]
            at += 32
        h = _rotl(v[0], 1) + _rotl(v[1], 7) + _rotl(v[2], 12) + _rotl(v[3], 18)
        for acc in v:
            h ^= _round(np.uint64(0), acc)
            h = h * _P1 + _P4
    else:
        h = np.full(n, (seed + int(_P5)) & _MASK, np.uint64)
    h += np.uint64(length)
    while at + 8 <= length:
        h ^= _round(np.uint64(0), data.read(8, starts + at))
        h = _rotl(h, 27) * _P1 + _P4
        at += 8
    if at + 4 <= length:
        word = data.read(4, starts + at)
        word *= _P1
        h ^= word
        h = _rotl(h, 23) * _P2 + _P3
        at += 4
    while at < length:
        byte = data.read(1, starts + at)
        byte *= _P5
        h ^= byte
        h = _rotl(h, 11) * _P1
        at += 1
    h ^= h >> np.uint64(33)
    h *= _P2
    h ^= h >> np.uint64(29)
    h *= _P3
    h ^= h >> np.uint64(32)
    return h
