"""Delta deletion vectors, byte for byte as the protocol (PROTOCOL.md "Deletion Vector Format",
"Deletion Vector File Storage Format") and Delta's Spark engine write them.

A deletion vector is a set of row positions (0-based, physical, in its data file). Serialised:
the magic number (little-endian) then the 64-bit "portable" RoaringBitmap, which pyroaring's
`BitMap64.serialize()` writes. Stored (`u` descriptors): in a `deletion_vector_<uuid>.bin` file
at the table's root holding one or more of them: a version byte, then per vector its size
(big-endian), its bytes and their CRC-32 (big-endian). The file's UUID is Z85-encoded in the
descriptor (`pathOrInlineDv`), and `offset` points at the vector's size field.
"""

from __future__ import annotations

import struct
import uuid
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow.fs as pafs
from pyroaring import BitMap64

from sink.delta_log import paths
from sink.errors import DeletionVectorError

MAGIC = 1681511377  # RoaringBitmapArrayFormat.Portable
FILE_VERSION = 1
FILE_PREFIX, FILE_SUFFIX = "deletion_vector_", ".bin"
_Z85 = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.-:+=^!/*?&<>()[]{}@%$#"
_Z85_VALUE = {c: i for i, c in enumerate(_Z85)}


@dataclass(frozen=True)
class Descriptor:
    """A deletion vector's descriptor as the log holds it (`add.deletionVector`)."""

    storage_type: str  # "u" (file by UUID), "i" (inline), "p" (absolute path)
    path_or_inline_dv: str
    offset: int | None
    size_in_bytes: int
    cardinality: int

    @classmethod
    def from_json(cls, d: dict) -> Descriptor:
        return cls(d["storageType"], d["pathOrInlineDv"], d.get("offset"), d["sizeInBytes"], d["cardinality"])

    def to_json(self) -> dict:
        out = {"storageType": self.storage_type, "pathOrInlineDv": self.path_or_inline_dv}
        if self.offset is not None:
            out["offset"] = self.offset
        return {**out, "sizeInBytes": self.size_in_bytes, "cardinality": self.cardinality}

    def file_location(self, root: str) -> str:
        """Where a stored vector's file is (`root`: the table's location on its filesystem)."""
        if self.storage_type == "p":
            return paths.file_location(root, self.path_or_inline_dv)
        prefix, encoded = self.path_or_inline_dv[:-20], self.path_or_inline_dv[-20:]
        name = f"{FILE_PREFIX}{uuid.UUID(bytes=z85_decode(encoded))}{FILE_SUFFIX}"
        return f"{root}/{prefix}/{name}" if prefix else f"{root}/{name}"


def serialize(rows: BitMap64) -> bytes:
    """A vector's bytes: magic then the portable 64-bit bitmap."""
    return struct.pack("<I", MAGIC) + rows.serialize()


def deserialize(data: bytes) -> BitMap64:
    (magic,) = struct.unpack_from("<I", data)
    if magic != MAGIC:
        raise DeletionVectorError(f"deletion vector has magic number {magic}, not the portable format's {MAGIC}")
    return BitMap64.deserialize(data[4:])


def write_file(fs: pafs.FileSystem, root: str, vectors: Sequence[BitMap64]) -> list[Descriptor]:
    """One new deletion-vector file at the table's root holding `vectors`, and their descriptors
    (in order). Its name is new (a random UUID): it is never overwritten, and until a commit
    names it no reader sees it."""
    file_id = uuid.uuid4()
    encoded = z85_encode(file_id.bytes)
    chunks, descriptors, at = [bytes([FILE_VERSION])], [], 1
    for rows in vectors:
        data = serialize(rows)
        chunks.append(struct.pack(">I", len(data)) + data + struct.pack(">I", zlib.crc32(data) & 0xFFFFFFFF))
        descriptors.append(Descriptor("u", encoded, at, len(data), len(rows)))
        at += len(chunks[-1])
    with fs.open_output_stream(f"{root}/{FILE_PREFIX}{file_id}{FILE_SUFFIX}") as out:
        out.write(b"".join(chunks))
    return descriptors


def read(fs: pafs.FileSystem, root: str, descriptor: Descriptor) -> BitMap64:
    """The rows a descriptor deletes, checked against its size, CRC and cardinality."""
    if descriptor.storage_type == "i":
        data = z85_decode(descriptor.path_or_inline_dv)[:descriptor.size_in_bytes]
    else:
        location = descriptor.file_location(root)
        offset = descriptor.offset or 0
        with fs.open_input_file(location) as f:
            f.seek(offset)
            framed = f.read(4 + descriptor.size_in_bytes + 4)
        (size,) = struct.unpack_from(">I", framed)
        data = framed[4:4 + size]
        if size != descriptor.size_in_bytes or len(data) != size:
            raise DeletionVectorError(f"{location} at {offset}: a deletion vector of {size} bytes, "
                                      f"its descriptor says {descriptor.size_in_bytes}")
        (crc,) = struct.unpack_from(">I", framed, 4 + size)
        if crc != zlib.crc32(data) & 0xFFFFFFFF:
            raise DeletionVectorError(f"{location} at {offset}: the deletion vector's CRC-32 does not match")
    rows = deserialize(data)
    if len(rows) != descriptor.cardinality:
        raise DeletionVectorError(f"deletion vector {descriptor.path_or_inline_dv}: {len(rows)} rows, "
                                  f"its descriptor says {descriptor.cardinality}")
    return rows


def positions(rows: BitMap64) -> np.ndarray:
    """The set's row positions, ascending (one copy out of the bitmap, not an iteration)."""
    return np.frombuffer(rows.to_array(), dtype=np.uint64).astype(np.int64)


def bitmap(rows: np.ndarray) -> BitMap64:
    """The set of row positions `rows` (integers)."""
    return BitMap64(rows.astype(np.uint64).tolist())


def z85_encode(data: bytes) -> str:
    """Z85 (ZeroMQ RFC 32) of `data`, whose length is a multiple of 4."""
    if len(data) % 4:
        raise ValueError("Z85 encodes whole 4-byte blocks")
    out = []
    for (word,) in struct.iter_unpack(">I", data):
        block = []
        for _ in range(5):
            word, digit = divmod(word, 85)
            block.append(_Z85[digit])
        out.extend(reversed(block))
    return "".join(out)


def z85_decode(text: str) -> bytes:
    if len(text) % 5:
        raise DeletionVectorError(f"{text!r} is not Z85: its length is not a multiple of 5")
    words = []
    for i in range(0, len(text), 5):
        word = 0
        for c in text[i:i + 5]:
            if c not in _Z85_VALUE:
                raise DeletionVectorError(f"{text!r} is not Z85: {c!r}")
            word = word * 85 + _Z85_VALUE[c]
        words.append(word)
    return struct.pack(f">{len(words)}I", *words)
