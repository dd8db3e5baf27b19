"""Key encoding, the shard function, partition ids and ordering values.

The ONE place that defines them, for both sides: Spark SQL expressions for the
routing step, and Arrow/Python functions for every Python path (tagging,
partition loads, catch-up). Tests hold the two sides equal.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from urllib.parse import quote, unquote

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from sink import columns as C
from sink.xxh64 import xxh64

# How key columns become the index's key bytes (`spark_key_expr`, `encode_keys`); recorded in
# the table's contract, so a change of encoding is refused rather than silently mismatched.
KEY_ENCODING = "string-v1"
# Spark's xxhash64() seed; Python must use the same one to agree on shards.
SPARK_XXHASH_SEED = 42
UNPARTITIONED = "_all"

# Column types allowed per role, as Spark's DataType.typeName().
KEY_TYPES = ("string", "byte", "short", "integer", "long", "date", "boolean")
PARTITION_TYPES = KEY_TYPES
ORDERING_TYPES = ("byte", "short", "integer", "long", "timestamp", "date")


def quoted_column(name: str) -> str:
    return "`" + name.replace("`", "``") + "`"


# --- Spark side ---------------------------------------------------------------------------


def spark_key_expr(key_cols: Sequence[str]) -> str:
    """SQL for the encoded key string; equals `encode_keys` on the same values."""
    if len(key_cols) == 1:
        return f"CAST({quoted_column(key_cols[0])} AS STRING)"
    parts = []
    for c in key_cols:
        s = f"CAST({quoted_column(c)} AS STRING)"
        parts.append(f"CAST(char_length({s}) AS STRING), ':', {s}")
    return "concat(" + ", ".join(parts) + ")"


def spark_shard_expr(key_expr: str, num_shards: int) -> str:
    """SQL for the shard of an encoded key; equals `shard_of`."""
    return f"pmod(xxhash64({key_expr}), {int(num_shards)})"


def spark_route_expr(num_shards: int) -> str:
    """SQL for the column to `repartition(num_shards, ...)` a batch by, so that shard s lands in
    Spark partition s: one shard per tagging task. Repartitioning by the shard itself hashes
    it again, and shards collide (with 2 shards both land in one task: measured, one core
    tagged the whole batch while the other idled)."""
    return _routed(C.SHARD, num_shards)


def spark_write_route_expr(partition_cols: Sequence[str], insert: str, tasks: int, insert_split: int) -> str:
    """SQL for the column to `repartition(tasks, ...)` tagged writes by: a partition's writes
    that change stored rows in the task its partition hashes to (a file's changes must meet in
    one task), its new keys (`insert`: SQL true for them) spread by key over that task and the
    next `insert_split - 1`, each of which writes them a file of their own."""
    base = f"CAST(hash({', '.join(quoted_column(c) for c in partition_cols) or '0'}) AS BIGINT)"
    spread = f"IF({insert}, pmod(xxhash64({C.KEY}), {int(insert_split)}), 0)"
    return _routed(f"pmod({base} + {spread}, {int(tasks)})", tasks)


def spark_copies_route_expr(copy: str, tasks: int) -> str:
    """SQL for the column to `repartition(tasks, ...)` rows by, copied to the tasks they go to
    first: column `copy` is each copy's task, 0 <= it < tasks."""
    return _routed(copy, tasks)


def _routed(task_sql: str, tasks: int) -> str:
    """SQL routing a row to Spark partition `task_sql` (0 <= it < tasks) by `repartition`."""
    routes = ", ".join(str(r) for r in shard_routes(tasks))
    return f"CAST(element_at(array({routes}), CAST({task_sql} AS INT) + 1) AS BIGINT)"


@functools.cache
def shard_routes(num_shards: int) -> tuple[int, ...]:
    """For each shard s, the smallest BIGINT r with Spark's pmod(hash(r), num_shards) == s:
    what HashPartitioning sends to partition s."""
    routes: dict[int, int] = {}
    r = 0
    while len(routes) < num_shards:
        routes.setdefault(spark_hash_long(r) % num_shards, r)
        r += 1
    return tuple(routes[s] for s in range(num_shards))


_MASK32 = 0xFFFFFFFF


def spark_hash_long(value: int, seed: int = 42) -> int:
    """Spark's hash() of a BIGINT (Murmur3_x86_32.hashLong, seed 42), as a signed int."""
    def mix_k1(k1: int) -> int:
        k1 = (k1 * 0xCC9E2D51) & _MASK32
        k1 = ((k1 << 15) | (k1 >> 17)) & _MASK32
        return (k1 * 0x1B873593) & _MASK32

    def mix_h1(h1: int, k1: int) -> int:
        h1 ^= k1
        h1 = ((h1 << 13) | (h1 >> 19)) & _MASK32
        return (h1 * 5 + 0xE6546B64) & _MASK32

    value &= (1 << 64) - 1
    h1 = mix_h1(mix_h1(seed & _MASK32, mix_k1(value & _MASK32)), mix_k1(value >> 32))
    h1 ^= 8  # the input's length in bytes
    h1 ^= h1 >> 16
    h1 = (h1 * 0x85EBCA6B) & _MASK32
    h1 ^= h1 >> 13
    h1 = (h1 * 0xC2B2AE35) & _MASK32
    h1 ^= h1 >> 16
    return h1 - (1 << 32) if h1 >= 1 << 31 else h1


def spark_ordering_expr(col: str, type_name: str) -> str:
    """SQL turning the ordering column into a comparable BIGINT; equals `ordering_values`."""
    c = quoted_column(col)
    if type_name == "timestamp":
        return f"unix_micros({c})"
    if type_name == "date":
        return f"CAST(unix_date({c}) AS BIGINT)"
    return f"CAST({c} AS BIGINT)"


# --- Python side --------------------------------------------------------------------------


def encode_keys(table: pa.Table, key_cols: Sequence[str]) -> pa.Array:
    """The encoded key of every row, as strings (utf-8 bytes are the index key)."""
    strings = [_as_string(table.column(c)) for c in key_cols]
    if len(strings) == 1:
        return strings[0]
    pieces = [
        pc.binary_join_element_wise(pc.cast(pc.utf8_length(s), pa.string()), s, ":")
        for s in strings
    ]
    return pc.binary_join_element_wise(*pieces, "")


def decode_key(encoded: bytes, key_cols: Sequence[str]) -> dict[str, str]:
    """The key columns' values, as text, of an encoded key (the inverse of `encode_keys`)."""
    text = encoded.decode()
    if len(key_cols) == 1:
        return {key_cols[0]: text}
    values, at = {}, 0
    for c in key_cols:
        colon = text.index(":", at)
        length = int(text[at:colon])
        values[c] = text[colon + 1:colon + 1 + length]
        at = colon + 1 + length
    return values


def describe_key(encoded: bytes, key_cols: Sequence[str]) -> str:
    """An encoded key as its columns' values, for messages: `id='k1'`, `tenant='a', id='7'`."""
    try:
        return ", ".join(f"{c}={v!r}" for c, v in decode_key(encoded, key_cols).items())
    except (ValueError, UnicodeDecodeError):  # not of this key spec
        return repr(encoded)


def shard_of(key: bytes, num_shards: int) -> int:
    """Shard of one encoded key (`shards_of`)."""
    return shards_of(pa.array([key], pa.binary()), num_shards)[0].as_py()


def shards_of(keys: pa.Array | pa.ChunkedArray, num_shards: int) -> pa.Array:
    """Shard of every encoded key: Spark's pmod(xxhash64(key), n), the signed hash taken
    modulo n into [0, n)."""
    return pa.array(shards_of_hashes(spark_hashes(keys), num_shards))


def spark_hashes(keys: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """Spark's xxhash64 of every encoded key (uint64), which `shards_of_hashes` takes."""
    return xxh64(keys, SPARK_XXHASH_SEED)


def shards_of_hashes(hashed: np.ndarray, num_shards: int) -> np.ndarray:
    """The shards of keys hashed by `spark_hashes`: the signed hash modulo n, into [0, n)."""
    return hashed.view(np.int64) % num_shards


def ordering_values(array: pa.Array | pa.ChunkedArray) -> pa.Array | pa.ChunkedArray:
    """Ordering column -> int64 (timestamps in microseconds UTC, dates in days)."""
    t = array.type
    if pa.types.is_timestamp(t):
        return pc.cast(pc.cast(array, pa.timestamp("us", tz=t.tz)), pa.int64())
    if pa.types.is_date(t):
        return pc.cast(pc.cast(array, pa.date32()), pa.int32()).cast(pa.int64())
    return pc.cast(array, pa.int64())


def partition_id(columns: Sequence[str], values: Sequence[str | None]) -> str:
    """Name of a table partition (and its column family) from Delta's partition strings."""
    if not columns:
        return UNPARTITIONED
    return "/".join(f"{quote(c, safe='')}={quote(v or '', safe='')}" for c, v in zip(columns, values))


def null_partition_id(columns: Sequence[str]) -> str:
    """The partition id of null partition values: where partitioned scope keeps deletes that
    named no partition and found no row (sink.tagging.placement)."""
    return partition_id(columns, [None] * len(columns))


def partition_values(pid: str) -> dict[str, str]:
    """Inverse of `partition_id`: column -> Delta partition string."""
    if pid == UNPARTITIONED:
        return {}
    out = {}
    for piece in pid.split("/"):
        c, _, v = piece.partition("=")
        out[unquote(c)] = unquote(v)
    return out


def partition_ids(table: pa.Table, partition_cols: Sequence[str]) -> pa.Array:
    """The partition id of every row; computed once per distinct partition, not per row."""
    if not partition_cols:
        return pa.array([UNPARTITIONED] * table.num_rows, pa.string())
    strings = [_as_string(table.column(c)) for c in partition_cols]
    joined = strings[0] if len(strings) == 1 else pc.binary_join_element_wise(*strings, "\x00")
    encoded = pc.dictionary_encode(joined).combine_chunks() if isinstance(
        joined, pa.ChunkedArray) else pc.dictionary_encode(joined)
    names = [
        partition_id(partition_cols, v.split("\x00") if len(strings) > 1 else [v])
        for v in encoded.dictionary.to_pylist()
    ]
    return pc.take(pa.array(names, pa.string()), encoded.indices)


def with_partition_values(rows: pa.Table, pids: pa.Array, partition_cols: Sequence[str]) -> pa.Table:
    """`rows` with their partition columns set to the values of `pids` (one per row; the
    null partition gives nulls), typed as the columns are."""
    encoded = pc.dictionary_encode(pids)
    values = [partition_values(pid) for pid in encoded.dictionary.to_pylist()]
    for c in partition_cols:
        strings = pc.take(pa.array([v.get(c) or None for v in values], pa.string()), encoded.indices)
        rows = rows.set_column(rows.schema.get_field_index(c), c, strings.cast(rows.schema.field(c).type))
    return rows


def _as_string(col: pa.Array | pa.ChunkedArray) -> pa.Array:
    if isinstance(col, pa.ChunkedArray):
        col = col.combine_chunks()
    return pc.cast(col, pa.string())
