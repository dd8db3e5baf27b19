"""The classify step: records + the index's committed view -> one operation per record.

Pure: no Spark, no RocksDB. `lookup(partition, keys)` answers with packed entries (or
None) from the replica. Records of one key are applied in (ordering, arrival) order on
top of the indexed entry, so a key seen twice in one batch is one insert then updates,
never two inserts; an incoming record older than the current entry is `stale`.
Each key that changes gets one `write` on its last applied record: what the table must
do (`insert`, `update`, `delete`), or `tombstone` when only the index changes (a delete
of a key the table does not hold).

Keys seen once in a batch (the common case) are classified with array operations; only
keys with several records in the batch go through the per-record loop.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from sink import ordering
from sink.index.entry import (
    Entry,
    changes_schema,
    entries_of_changes,
    expired,
    ordering_names,
    unpack_located_many,
    unpack_many,
)

INSERT, UPDATE, DELETE, STALE, TOMBSTONE = "insert", "update", "delete", "stale", "tombstone"
OPS = (INSERT, UPDATE, DELETE, STALE)
_OP_NAMES = pa.array([INSERT, UPDATE, DELETE, STALE])
_WRITE_NAMES = pa.array([INSERT, UPDATE, DELETE, TOMBSTONE])
_I, _U, _D, _S = range(4)  # op codes, also write codes (with 3 = tombstone)
_NO_WRITE = -1

LookupPacked = Callable[[str, list[bytes]], Sequence[bytes | None]]
# Packed entries of keys in one given partition.
LookupOne = Callable[[list[bytes]], Sequence[bytes | None]]
# Global scope: packed located entries of keys, wherever they live.
LookupLocated = Callable[[list[bytes]], Sequence[bytes | None]]


@dataclass
class TagResult:
    op: pa.Array  # per record: insert / update / delete / stale
    write: pa.Array  # per record: what the table must do, null where nothing
    hit: pa.Array  # on the first record of each key: was the key in the index; null elsewhere
    changes: pa.Table  # changes_schema(width): the entry after this batch of every key it changes
    # Global scope, on the record carrying a key's write: the partition of the row the table
    # holds before the batch (the row a delete removes, or a move deletes), and the key's
    # partition after the batch; null elsewhere.
    stored_at: pa.Array | None = None
    location: pa.Array | None = None

    def changes_dict(self) -> dict[str, dict[bytes, Entry]]:
        return entries_of_changes(self.changes)


Orderings = pa.Array | pa.ChunkedArray | Sequence[pa.Array]


def _columns(orderings: Orderings) -> list[pa.Array]:
    """One int64 array per ordering column."""
    return [orderings] if isinstance(orderings, (pa.Array, pa.ChunkedArray)) else list(orderings)


def _changes(pids: pa.Array, keys: pa.Array, values: np.ndarray, deleted: np.ndarray, now: int) -> pa.Table:
    """The changes table of changed keys; deletes this batch applies are stamped `now`."""
    width = values.shape[1]
    stamps = np.where(deleted, np.int64(now), np.int64(0))
    return pa.table([pids, keys, *(pa.array(values[:, i]) for i in range(width)), pa.array(deleted), pa.array(stamps)],
                    schema=changes_schema(width))


def tag(
    keys: pa.Array,
    partitions: pa.Array,
    orderings: Orderings,
    deletes: pa.Array,
    seqs: pa.Array,
    lookup: LookupPacked,
    incoming_wins_ties: bool = True,
    now: int = 0,
    expire_before: int | None = None,
    shield: tuple[str, LookupOne] | None = None,
) -> TagResult:
    """Tag every record. Arrays are aligned; keys are encoded keys (string or binary);
    `orderings` one int64 array per ordering column, compared in order. Deletes this batch
    applies are stamped `now`; stored deletes older than `expire_before` count as absent
    (`tombstone_ttl_hours`). `shield`: the partition holding deletes that named no partition
    and found no row (sink.tagging.placement), and its lookup; a key its own partition lacks takes
    its entry there."""
    columns = _columns(orderings)
    n = len(keys)
    if n == 0:
        return TagResult(pa.array([], pa.string()), pa.array([], pa.string()), pa.array([], pa.bool_()),
                         changes_schema(len(columns)).empty_table())
    keys = keys.cast(pa.binary())
    order = pc.sort_indices(
        pa.table({"p": partitions, "k": keys, **dict(zip(ordering_names(len(columns)), columns)), "s": seqs}),
        sort_keys=[("p", "ascending"), ("k", "ascending"),
                   *((c, "ascending") for c in ordering_names(len(columns))), ("s", "ascending")],
    ).to_numpy()
    p_sorted, k_sorted = partitions.take(order), keys.take(order)
    o = ordering.stack(columns)[order]
    d = deletes.to_numpy(zero_copy_only=False)[order]
    first = np.ones(n, bool)
    if n > 1:
        first[1:] = ~pc.and_(pc.equal(p_sorted[1:], p_sorted[:-1]),
                             pc.equal(k_sorted[1:], k_sorted[:-1])).to_numpy(zero_copy_only=False)
    starts = np.flatnonzero(first)
    sizes = np.diff(np.append(starts, n))
    group_pids, group_keys = p_sorted.take(starts), k_sorted.take(starts)
    present, e_ord, e_del, e_at = _lookup_groups(group_pids, group_keys, lookup, len(columns))
    found = present & ~expired(present, e_del, e_at, expire_before)  # hits count what the index answered
    if shield is not None:
        _shielded(*shield, group_pids, group_keys, found, e_ord, e_del, expire_before)

    op = np.full(n, _S, np.int8)
    write = np.full(n, _NO_WRITE, np.int8)
    new_ord = e_ord.copy()
    new_del = e_del.copy()
    changed = np.zeros(len(starts), bool)

    single = np.flatnonzero(sizes == 1)
    rows = starts[single]
    oo, dd, f, eo, ed = o[rows], d[rows], found[single], e_ord[single], e_del[single]
    stale = f & _older(oo, eo, incoming_wins_ties)
    live = f & ~ed
    op[rows] = np.where(stale, _S, np.where(dd, _D, np.where(live, _U, _I)))
    write[rows] = np.where(stale, _NO_WRITE, np.where(dd, np.where(live, _D, 3), np.where(live, _U, _I)))
    applied = ~stale
    changed[single[applied]] = True
    new_ord[single[applied]] = oo[applied]
    new_del[single[applied]] = dd[applied]

    several = np.flatnonzero(sizes > 1).tolist()
    values, stored = (_comparable(o), _comparable(e_ord)) if several else (None, None)
    for g in several:
        state = _tag_group(starts[g], sizes[g], bool(found[g]), stored[g], bool(e_del[g]), values, d,
                           incoming_wins_ties, op, write)
        if state is not None:
            changed[g], new_ord[g], new_del[g] = True, state[0], state[1]

    unsorted = np.empty(n, np.int64)
    unsorted[order] = np.arange(n)
    op_out = _OP_NAMES.take(pa.array(op[unsorted]))
    w = write[unsorted]
    write_out = _WRITE_NAMES.take(pa.array(np.where(w < 0, 0, w), mask=w < 0))
    hit_sorted = np.zeros(n, bool)
    hit_sorted[starts] = present
    hit_out = pa.array(hit_sorted[unsorted], mask=~first[unsorted])
    idx = pa.array(np.flatnonzero(changed))
    changes = _changes(group_pids.take(idx), group_keys.take(idx), new_ord[changed], new_del[changed], now)
    return TagResult(op_out, write_out, hit_out, changes)


def _comparable(values: np.ndarray) -> list:
    """Rows of ordering values as Python values that compare like the rows: ints with one
    ordering column (the common case, cheapest), tuples with several."""
    if values.shape[1] == 1:
        return values[:, 0].tolist()
    return [tuple(v) for v in values.tolist()]


def _older(incoming: np.ndarray, stored: np.ndarray, incoming_wins_ties: bool) -> np.ndarray:
    """Row-wise: the incoming ordering loses to the stored one (stale)."""
    if incoming_wins_ties:
        return ordering.less(incoming, stored)
    return ordering.less(incoming, stored) | ordering.equal(incoming, stored)


def _lookup_groups(pids: pa.Array, keys: pa.Array, lookup: LookupPacked, width: int):
    """(found, ordering, deleted, deleted_at) of each distinct key, one lookup call per
    partition. `pids` is sorted, so each partition's keys are one slice."""
    n = len(keys)
    bounds = [0, *(np.flatnonzero(pc.not_equal(pids[1:], pids[:-1]).to_numpy(zero_copy_only=False)) + 1).tolist(), n]
    raws: list[bytes | None] = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        raws.extend(lookup(pids[start].as_py(), keys.slice(start, end - start).to_pylist()))
    return unpack_many(raws, width)


def _shielded(shield: str, lookup: LookupOne, pids: pa.Array, keys: pa.Array, found: np.ndarray,
              e_ord: np.ndarray, e_del: np.ndarray, expire_before: int | None) -> None:
    """Keys their own partition holds no live row of take the delete kept for them under
    `shield`, where it is newer (in place): a delete that named no partition and found no row
    makes older upserts of its key stale, wherever they arrive. (A replica that loaded the
    partition may hold an older tombstone there that one tagging since the delete does not:
    stale deletes are tombstone rows too.)"""
    todo = np.flatnonzero((~found | e_del) & pc.not_equal(pids, shield).to_numpy(zero_copy_only=False))
    if not len(todo):
        return
    s_present, s_ord, s_del, s_at = unpack_many(lookup(keys.take(pa.array(todo)).to_pylist()), e_ord.shape[1])
    newer = s_present & ~expired(s_present, s_del, s_at, expire_before) & (
        ~found[todo] | ordering.less(e_ord[todo], s_ord))
    found[todo[newer]] = True
    e_ord[todo[newer]] = s_ord[newer]
    e_del[todo[newer]] = s_del[newer]


def _tag_group(start, size, found, e_ord, e_del, values, d, incoming_wins, op, write):
    """Tag one key's records (sorted; `values`: `_comparable` orderings); return its
    (ordering, deleted) after the batch, or None if nothing changed."""
    initially_live = found and not e_del
    state = (e_ord, e_del) if found else None
    last = None
    for row in range(start, start + size):
        value = values[row]
        if state is not None and (value < state[0] or (value == state[0] and not incoming_wins)):
            continue  # op stays stale
        if d[row]:
            op[row] = _D
            state = (value, True)
        else:
            op[row] = _I if state is None or state[1] else _U
            state = (value, False)
        last = row
    if last is None:
        return None
    if state[1]:
        write[last] = _D if initially_live else 3
    else:
        write[last] = _U if initially_live else _I
    return state


def tag_global(
    keys: pa.Array,
    partitions: pa.Array,
    orderings: Orderings,
    deletes: pa.Array,
    seqs: pa.Array,
    lookup: LookupLocated,
    incoming_wins_ties: bool = True,
    now: int = 0,
    expire_before: int | None = None,
) -> TagResult:
    """Tag every record with keys unique across the table (scope "global").

    `partitions` is each record's partition id, null where a delete names no partition: the
    index says where the key lives. A newer upsert in another partition than the stored row
    moves the key (the write is an update whose `stored_at` differs from its partition: the
    commit deletes the old row and inserts the new one). A stale record never moves a key.
    `now` and `expire_before` as in `tag`."""
    columns = _columns(orderings)
    names = ordering_names(len(columns))
    n = len(keys)
    if n == 0:
        empty = pa.array([], pa.string())
        return TagResult(empty, empty, pa.array([], pa.bool_()), changes_schema(len(columns)).empty_table(), empty,
                         empty)
    keys = keys.cast(pa.binary())
    order = pc.sort_indices(pa.table({"k": keys, **dict(zip(names, columns)), "s": seqs}),
                            sort_keys=[("k", "ascending"), *((c, "ascending") for c in names),
                                       ("s", "ascending")]).to_numpy()
    k_sorted = keys.take(order)
    # Partitions as codes into `pids` (-1: none), so the classification below is integer work.
    encoded = pc.dictionary_encode(partitions.take(order))
    pids = [*encoded.dictionary.to_pylist(), ""]
    nowhere = len(pids) - 1  # a delete of a key no partition holds: kept under ""
    own = pc.fill_null(encoded.indices, -1).to_numpy(zero_copy_only=False).astype(np.int64)
    o = ordering.stack(columns)[order]
    d = deletes.to_numpy(zero_copy_only=False)[order]
    first = np.ones(n, bool)
    if n > 1:
        first[1:] = ~pc.equal(k_sorted[1:], k_sorted[:-1]).to_numpy(zero_copy_only=False)
    starts = np.flatnonzero(first)
    sizes = np.diff(np.append(starts, n))
    group_keys = k_sorted.take(starts)
    present, e_ord, e_del, e_at, located = unpack_located_many(lookup(group_keys.to_pylist()), len(columns))
    found = present & ~expired(present, e_del, e_at, expire_before)  # hits count what the index answered
    e_loc = _codes(located, present, pids)

    op = np.full(n, _S, np.int8)
    write = np.full(n, _NO_WRITE, np.int8)
    stored_at = np.full(n, -1, np.int64)
    location = np.full(n, -1, np.int64)
    changed = np.zeros(len(starts), bool)
    new_ord, new_del, new_loc = e_ord.copy(), e_del.copy(), e_loc.copy()

    single = np.flatnonzero(sizes == 1)
    rows = starts[single]
    oo, dd, f, eo, ed, el = o[rows], d[rows], found[single], e_ord[single], e_del[single], e_loc[single]
    stale = f & _older(oo, eo, incoming_wins_ties)
    live = f & ~ed
    op[rows] = np.where(stale, _S, np.where(dd, _D, np.where(live, _U, _I)))
    write[rows] = np.where(stale, _NO_WRITE, np.where(dd, np.where(live, _D, 3), np.where(live, _U, _I)))
    stored_at[rows] = np.where(~stale & live, el, -1)
    # A delete leaves the key where it was; one of an unknown key, where the record says ("" if nowhere).
    unplaced = np.where(f, el, -1)
    after = np.where(dd, np.where(live, el, np.where(own[rows] >= 0, own[rows], unplaced)), own[rows])
    after = np.where(after < 0, nowhere, after)
    location[rows] = np.where(stale, -1, after)
    applied = ~stale
    changed[single[applied]] = True
    new_ord[single[applied]] = oo[applied]
    new_del[single[applied]] = dd[applied]
    new_loc[single[applied]] = after[applied]

    several = np.flatnonzero(sizes > 1).tolist()
    values, stored = (_comparable(o), _comparable(e_ord)) if several else (None, None)
    for g in several:
        state = _tag_global_group(starts[g], sizes[g], bool(found[g]), stored[g], bool(e_del[g]), int(e_loc[g]),
                                  values, d, own, nowhere, incoming_wins_ties, op, write, stored_at, location)
        if state is not None:
            changed[g], new_ord[g], new_del[g], new_loc[g] = True, state[0], state[1], state[2]

    unsorted = np.empty(n, np.int64)
    unsorted[order] = np.arange(n)
    w = write[unsorted]
    hit_sorted = np.zeros(n, bool)
    hit_sorted[starts] = present
    idx = pa.array(np.flatnonzero(changed))
    dictionary = pa.array(pids, pa.string())
    changes = _changes(_named(dictionary, new_loc[changed]), group_keys.take(idx), new_ord[changed],
                       new_del[changed], now)
    return TagResult(
        _OP_NAMES.take(pa.array(op[unsorted])),
        _WRITE_NAMES.take(pa.array(np.where(w < 0, 0, w), mask=w < 0)),
        pa.array(hit_sorted[unsorted], mask=~first[unsorted]),
        changes,
        _named(dictionary, stored_at[unsorted]),
        _named(dictionary, location[unsorted]),
    )


def _codes(located: list[str | None], present: np.ndarray, pids: list[str]) -> np.ndarray:
    """Codes into `pids` of the partitions the index located keys in (-1 where not found);
    partitions it lacks are appended."""
    codes = np.full(len(located), -1, np.int64)
    index = {pid: i for i, pid in enumerate(pids)}
    for i in np.flatnonzero(present).tolist():
        pid = located[i]
        code = index.get(pid)
        if code is None:
            code = index[pid] = len(pids)
            pids.append(pid)
        codes[i] = code
    return codes


def _named(dictionary: pa.Array, codes: np.ndarray) -> pa.Array:
    """Partition ids of `codes` (null for -1)."""
    return dictionary.take(pa.array(codes, mask=codes < 0))


def _tag_global_group(start, size, found, e_ord, e_del, e_loc, values, d, own, nowhere, incoming_wins, op, write,
                      stored_at, location):
    """Tag one key's records (sorted; `values`: `_comparable` orderings; partitions as codes,
    -1 for none) in global scope; return its (ordering, deleted, partition) after the batch,
    or None if nothing changed."""
    table_row = e_loc if found and not e_del else -1  # where the table holds the key's row
    state = (e_ord, e_del, e_loc) if found else None
    last = None
    for row in range(start, start + size):
        value = values[row]
        if state is not None and (value < state[0] or (value == state[0] and not incoming_wins)):
            continue  # op stays stale
        if d[row]:
            op[row] = _D
            where = state[2] if state is not None and (not state[1] or own[row] < 0) else own[row]
            state = (value, True, where if where >= 0 else nowhere)
        else:
            op[row] = _I if state is None or state[1] else _U
            state = (value, False, own[row])
        last = row
    if last is None:
        return None
    if state[1]:
        write[last] = _D if table_row >= 0 else 3
        # The row a delete removes is where the table holds it, whatever the record names.
        if table_row >= 0:
            state = (state[0], True, table_row)
    else:
        write[last] = _U if table_row >= 0 else _I
    stored_at[last] = table_row
    location[last] = state[2]
    return state
