"""Reading index entries (one shard's keys only) from the Delta tables."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from deltalake import DeltaTable

from sink import columns as C
from sink import keys
from sink.delta_log.predicates import keys_predicate, partition_predicate
from sink.index import history_locations
from sink.index.entry import expire_before, pack_located_many, pack_many
from sink.ordering import arrow_greater, columns_of, stack
from sink.xxh64 import xxh64

# Tombstone rows name the writer and batch that wrote them: they count once the table holds
# that batch (tombstones are written before the batch's commit, so none is ever missing).
TOMBSTONE_WRITER = "_tombstone_writer_id"
TOMBSTONE_BATCH = "_tombstone_batch_id"
# When the batch deleted the key (its start, UTC); rows from before the column count as
# deleted at the epoch, i.e. expired under any tombstone_ttl_hours.
TOMBSTONE_DELETED_AT = "_tombstone_deleted_at"
# The writer of the tombstones of rows another writer (not a sink) deleted: their batch is the
# version of the commit that removed the row (sink.batch.other_writers), and they count once
# the table is at that version.
OTHER_WRITERS = "(other writers)"
# Keys per chunk a global keyspace is packed and written in: bounds the Python objects a
# load holds at once (a 5M-key shard read whole peaked at 4.0 GB, in chunks at 1.3 GB).
LOAD_CHUNK_KEYS = 1_000_000


def read_partition(
    table: DeltaTable,
    tombstones: DeltaTable | None,
    pid: str,
    key_cols: Sequence[str],
    ordering: str | Sequence[str],
    shard: int,
    num_shards: int,
    wanted: pa.Array | None = None,
    history: bool = False,
) -> tuple[list[bytes], list[bytes]]:
    """Keys and packed entries of partition `pid` for `shard`: rows of `table` at its loaded
    version, and tombstones of keys the table lacks (a `history` table keeps a deleted key's
    versions: there a tombstone newer than the newest one wins). One entry per key; array
    operations throughout; keys ascending. `wanted` (encoded keys): only those keys' entries."""
    ordering = columns_of(ordering)
    columns = [*key_cols, *ordering]
    live = _key_orderings(pa.table(table.scan(columns=columns, predicate=_predicate(table, pid, key_cols, wanted))),
                          key_cols, ordering, shard, num_shards, wanted=wanted)
    if tombstones is not None:
        tomb = _key_orderings(committed_tombstones(table, tombstones, _predicate(tombstones, pid, key_cols, wanted),
                                                   columns), key_cols, ordering,
                              shard, num_shards, stamped=True, wanted=wanted)
        live = _overlay(live, tomb, len(ordering), rows_stand=not history)
    live = live.take(pc.sort_indices(live.column("k")))  # RocksDB's order: an SST file is written as it comes
    return live.column("k").to_pylist(), _pack(live, len(ordering))


def _predicate(table: DeltaTable, pid: str, key_cols: Sequence[str], wanted: pa.Array | None) -> str:
    """The scan predicate of partition `pid` of `table` (the data or the tombstone table), and
    of the `wanted` keys where they can be named (`keys_predicate`)."""
    types = {f.name: f.type for f in pa.schema(table.schema().to_arrow())}
    predicate = partition_predicate(keys.partition_values(pid), types)
    named = None if wanted is None else keys_predicate(wanted.cast(pa.binary()).to_pylist(), key_cols, types)
    return predicate if named is None else f"({predicate}) AND ({named})"


def _overlay(live: pa.Table, tomb: pa.Table, width: int, located: bool = False, rows_stand: bool = True
             ) -> pa.Table:
    """Rows (k, values[, l]) with tombstones (k, values[, l], at) joined in: a key the table
    has no row of is deleted where it has a tombstone. `rows_stand`: a row of the table is live
    whatever tombstone it has (the index never calls deleted a key the table holds: another
    writer, a RESTORE, may bring back a row older than a delete); else (a history table, whose
    deleted keys keep their versions) a key is deleted where its tombstone is newer than its
    row (equal ordering: the row stands, as a delete that won a tie would have removed it).
    Adds "deleted" and "at"."""
    names = _value_names(width)
    if not tomb.num_rows:
        return live.append_column("deleted", pa.array(np.zeros(live.num_rows, bool))).append_column(
            "at", pa.array(np.zeros(live.num_rows, np.int64)))
    dead_names = [f"t{n}" for n in names]
    renamed = tomb.rename_columns([{"l": "tl", **dict(zip(names, dead_names))}.get(c, c) for c in tomb.column_names])
    joined = live.join(renamed, "k", join_type="full outer")
    row = [joined.column(n) for n in names]
    dead = [joined.column(n) for n in dead_names]
    deleted = pc.is_null(row[0])
    if not rows_stand:
        deleted = pc.or_kleene(deleted, pc.fill_null(arrow_greater(dead, row), False))
    out = {"k": joined.column("k"), **{n: pc.if_else(deleted, t, r) for n, t, r in zip(names, dead, row)}}
    if located:
        out["l"] = pc.if_else(pc.is_null(row[0]), joined.column("tl"), joined.column("l"))
    return pa.table({**out, "deleted": pc.fill_null(deleted, False), "at": pc.fill_null(joined.column("at"), 0)})


def _pack(rows: pa.Table, width: int) -> list[bytes]:
    values = stack([rows.column(n) for n in _value_names(width)])
    deleted = rows.column("deleted").to_numpy(zero_copy_only=False) if "deleted" in rows.column_names else False
    at = rows.column("at").to_numpy() if "at" in rows.column_names else 0
    if "l" in rows.column_names:
        return pack_located_many(values, deleted, pc.fill_null(rows.column("l"), "").to_pylist(), at)
    return pack_many(values, deleted, at)


@dataclass
class GlobalRead:
    """One shard's whole keyspace (global scope): one row per key, sorted by key ("k", the
    ordering values, "l": its partition, "deleted", "at"), and how many keys the table holds
    in several partitions (the newest row wins; that table breaks the scope's promise, e.g.
    written before it or by another tool)."""

    rows: pa.Table
    keys_in_several_partitions: int
    width: int

    def chunks(self, size: int = LOAD_CHUNK_KEYS) -> Iterator[tuple[list[bytes], list[bytes]]]:
        """Keys and located packed entries, `size` keys at a time, in key order (chunks are
        disjoint, ascending key ranges)."""
        for start in range(0, self.rows.num_rows, size):
            part = self.rows.slice(start, size)
            yield part.column("k").to_pylist(), _pack(part, self.width)


def read_global(
    table: DeltaTable,
    tombstones: DeltaTable | None,
    key_cols: Sequence[str],
    partition_cols: Sequence[str],
    ordering: str | Sequence[str],
    shard: int,
    num_shards: int,
    history: bool = False,
) -> GlobalRead:
    """Every key of `shard` in the table, with the partition it lives in, overlaid with
    tombstones as `read_partition` does (a delete of a key with no row stays where its
    delete record put it, "" when that named no partition). The table is read batch by
    batch, keeping only this shard's keys as Arrow columns. A `history` table's key is in
    every partition holding a version or a stored delete of it (sink.index.history_locations)."""
    ordering = columns_of(ordering)
    width = len(ordering)
    columns = C.distinct(key_cols, partition_cols, ordering)
    parts = [_located(pa.Table.from_batches([batch]), key_cols, partition_cols, ordering, shard, num_shards)
             for batch in pa.RecordBatchReader.from_stream(table.scan(columns=columns))]
    rows = pa.concat_tables([_empty(width, located=True), *parts])
    live, spread = _one_per_key(rows, width)
    tomb_rows = None if tombstones is None else _located(committed_tombstones(table, tombstones, None, columns),
                                                         key_cols, partition_cols, ordering, shard, num_shards,
                                                         stamped=True)
    if tomb_rows is not None:
        tomb, _ = _one_per_key(tomb_rows, width)
        live = _overlay(live, tomb, width, located=True, rows_stand=not history)
    if history:
        named = pa.concat_tables([t.select(["k", "l"]) for t in (rows, tomb_rows) if t is not None])
        lists = history_locations.partition_lists(named.column("k"), named.column("l"))
        live = live.drop_columns(["l"]).join(lists, "k", join_type="left outer")
        spread = 0  # a history table keeps a key's versions where their values say
    return GlobalRead(live.take(pc.sort_indices(live, [("k", "ascending")])), spread, width)


def _located(data: pa.Table, key_cols, partition_cols, ordering: list[str], shard, num_shards,
             stamped: bool = False) -> pa.Table:
    """(k, values, l: partition id[, at: deleted-at seconds]) of this shard's rows."""
    rows = _shard_rows(data, key_cols, shard, num_shards, extra=partition_cols)
    if rows is None:
        return _empty(len(ordering), located=True, stamped=stamped)
    return pa.table({"k": rows.column(_KEY).cast(pa.binary()), **_values(rows, ordering),
                     "l": keys.partition_ids(rows, partition_cols),
                     **({"at": stamp_seconds(rows)} if stamped else {})})


def _one_per_key(out: pa.Table, width: int) -> tuple[pa.Table, int]:
    """One row per key (its highest ordering), and the number of keys found in several partitions."""
    if _all_distinct(xxh64(out.column("k"))):
        return out, 0
    per_key = pa.table({"k": out.column("k"), "l": out.column("l")}).group_by("k").aggregate([("l", "count_distinct")])
    return _newest_per_key(out, width), int(pc.sum(pc.greater(per_key.column("l_count_distinct"), 1)).as_py() or 0)


def _value_names(width: int) -> list[str]:
    return ["o"] + [f"o_{i}" for i in range(1, width)]


def _values(rows: pa.Table, ordering: list[str]) -> dict[str, pa.ChunkedArray]:
    """The ordering columns as int64, named by `_value_names`."""
    return {n: keys.ordering_values(rows.column(c)).cast(pa.int64())
            for n, c in zip(_value_names(len(ordering)), ordering)}


def _empty(width: int, located: bool = False, stamped: bool = False) -> pa.Table:
    columns = {"k": pa.array([], pa.binary()), **{n: pa.array([], pa.int64()) for n in _value_names(width)}}
    if located:
        columns["l"] = pa.array([], pa.string())
    if stamped:
        columns["at"] = pa.array([], pa.int64())
    return pa.table(columns)


def _newest_per_key(out: pa.Table, width: int) -> pa.Table:
    """One row per key "k" (which repeats): the one with the highest ordering values (then
    the latest "at")."""
    ranking = [(n, "descending") for n in _value_names(width)]
    if "at" in out.column_names:
        ranking.append(("at", "descending"))
    newest = out.take(pc.sort_indices(out, [("k", "ascending"), *ranking]))
    key_col = newest.column("k").combine_chunks()
    first = np.ones(newest.num_rows, bool)
    first[1:] = ~pc.equal(key_col[1:], key_col[:-1]).to_numpy(zero_copy_only=False)
    return newest.filter(pa.array(first))


def stamp_seconds(rows: pa.Table) -> pa.Array:
    """Tombstone rows' deleted-at in seconds since the epoch (0 where unknown)."""
    if TOMBSTONE_DELETED_AT not in rows.column_names:
        return pa.array(np.zeros(rows.num_rows, np.int64))
    micros = pc.cast(pc.cast(rows.column(TOMBSTONE_DELETED_AT), pa.timestamp("us", tz="UTC")), pa.int64())
    return pc.fill_null(pc.divide(micros, 1_000_000), 0)


def committed_tombstones(table: DeltaTable, tombstones: DeltaTable, predicate: str | None,
                         columns: list[str]) -> pa.Table:
    """The tombstone rows matching `predicate` whose batch `table` (at its loaded version)
    holds; rows from before tombstones named their batch count always."""
    names = set(pa.schema(tombstones.schema().to_arrow()).names)
    if TOMBSTONE_DELETED_AT in names:
        columns = [*columns, TOMBSTONE_DELETED_AT]
    if not {TOMBSTONE_WRITER, TOMBSTONE_BATCH} <= names:
        return pa.table(tombstones.scan(columns=columns, predicate=predicate))
    scanned = pa.table(tombstones.scan(columns=[*columns, TOMBSTONE_WRITER, TOMBSTONE_BATCH], predicate=predicate))
    rows = pa.table({c: _plain(scanned.column(c)) for c in scanned.column_names})
    return rows.filter(committed(table, rows)).select(columns)


def expired_rows(rows: pa.Table, ttl_seconds: int | None, now: float) -> pa.Array:
    """Rows whose delete is older than the TTL, by the rule tagging applies to index entries
    (rows without a time count as deleted at the epoch)."""
    cutoff = expire_before(ttl_seconds, now)
    if cutoff is None:
        return pa.array(np.zeros(rows.num_rows, bool))
    return pc.less(stamp_seconds(rows), cutoff)


def committed(table: DeltaTable, rows: pa.Table) -> pa.Array:
    """Which tombstone rows belong to a batch `table` (at its loaded version) holds, or to a
    commit of another writer at or before that version; rows without a writer and batch count
    as committed."""
    if not {TOMBSTONE_WRITER, TOMBSTONE_BATCH} <= set(rows.column_names):
        return pa.array(np.ones(rows.num_rows, bool))
    writers = rows.column(TOMBSTONE_WRITER)
    done = pc.is_null(rows.column(TOMBSTONE_BATCH))
    for writer in pc.unique(writers).drop_null().to_pylist():
        landed = table.version() if writer == OTHER_WRITERS else table.transaction_version(writer)
        if landed is not None:
            mine = pc.fill_null(pc.equal(writers, writer), False)
            done = pc.or_(done, pc.and_(mine, pc.less_equal(rows.column(TOMBSTONE_BATCH), landed)))
    return done


def _key_orderings(data: pa.Table, key_cols, ordering: list[str], shard, num_shards,
                   stamped: bool = False, wanted: pa.Array | None = None) -> pa.Table:
    """(k: encoded key bytes, values[, at: deleted-at seconds]) of this shard's rows (of the
    `wanted` keys only, when given), one row per key (the highest ordering)."""
    rows = _shard_rows(data, key_cols, shard, num_shards, wanted=wanted)
    if rows is None:
        return _empty(len(ordering), stamped=stamped)
    out = pa.table({"k": rows.column(_KEY).cast(pa.binary()), **_values(rows, ordering),
                    **({"at": stamp_seconds(rows)} if stamped else {})})
    if _all_distinct(rows.column(_HASH).to_numpy()):  # the hashes that chose the shard
        return out
    return _newest_per_key(out, len(ordering))


def _all_distinct(hashed: np.ndarray) -> bool:
    """Whether no key occurs twice, told by their hashes (equal keys hash alike; a collision
    only sends the rows through `_newest_per_key`, which is exact). Arrow's count_distinct
    took 3-7 s on a shard's 5M keys, this 0.3 s."""
    hashed = np.sort(hashed)
    return not bool((hashed[1:] == hashed[:-1]).any())


def _shard_rows(data: pa.Table, key_cols, shard, num_shards, extra=(), wanted: pa.Array | None = None
                ) -> pa.Table | None:
    """This shard's rows (of the `wanted` encoded keys only, when given) with their encoded
    key in column KEY and its hash, which chose the shard, in column HASH (None when there are
    none)."""
    if data.num_rows == 0:
        return None
    names = list(dict.fromkeys([*key_cols, *extra, *[c for c in data.column_names if c not in key_cols]]))
    data = pa.table({c: _plain(data.column(c)) for c in names})
    encoded = keys.encode_keys(data, key_cols)
    if wanted is not None:  # before the shards: hashing costs a Python call per key
        named = pc.is_in(encoded.cast(pa.binary()), value_set=wanted.cast(pa.binary()))
        data, encoded = data.filter(named), encoded.filter(named)
    hashed = keys.spark_hashes(encoded)
    mine = keys.shards_of_hashes(hashed, num_shards) == shard
    in_shard = pa.array(mine)
    return (data.filter(in_shard).append_column(_KEY, encoded.filter(in_shard))
            .append_column(_HASH, pa.array(hashed[mine])))


_KEY, _HASH = "__key", "__hash"


def plain(table: pa.Table) -> pa.Table:
    """A delta-rs scan's columns as plain Arrow types (`_plain`)."""
    return pa.table({c: _plain(table.column(c)) for c in table.column_names})


def _plain(col: pa.ChunkedArray) -> pa.ChunkedArray:
    """delta-rs scans give string_view and dictionary columns; key functions take plain ones."""
    if pa.types.is_dictionary(col.type):
        col = col.cast(col.type.value_type)
    if pa.types.is_string_view(col.type) or pa.types.is_large_string(col.type):
        return col.cast(pa.string())
    return col
