"""The classify step: records + the index's committed view -> one operation per record.

Pure: no Spark, no RocksDB. `lookup(partition, keys)` answers from the replica.
Records of one key are applied in (ordering, arrival) order on top of the indexed
entry, so a key seen twice in one batch is one insert then updates, never two
inserts; an incoming record older than the current entry is `stale`.
Each key that changes gets one `write` on its last applied record: what the table
must do (`insert`, `update`, `delete`), or `tombstone` when only the index changes
(a delete of a key the table does not hold).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.compute as pc

from sink.index.entry import Entry

INSERT, UPDATE, DELETE, STALE, TOMBSTONE = "insert", "update", "delete", "stale", "tombstone"
OPS = (INSERT, UPDATE, DELETE, STALE)

Lookup = Callable[[str, list[bytes]], Sequence[Entry | None]]


@dataclass
class TagResult:
    op: list[str]
    write: list[str | None]
    # True/False on the first record of each key: was the key in the index; None elsewhere.
    hit: list[bool | None]
    # partition id -> key -> entry after this batch, for every key the batch changes.
    changes: dict[str, dict[bytes, Entry]] = field(default_factory=dict)

    def count(self, op: str) -> int:
        return self.op.count(op)


def tag(
    keys: pa.Array,
    partitions: pa.Array,
    orderings: pa.Array,
    deletes: pa.Array,
    seqs: pa.Array,
    lookup: Lookup,
    incoming_wins_ties: bool = True,
) -> TagResult:
    """Tag every record. Arrays are aligned; keys are encoded key strings."""
    n = len(keys)
    result = TagResult(op=[STALE] * n, write=[None] * n, hit=[None] * n)
    if n == 0:
        return result
    order = pc.sort_indices(
        pa.table({"p": partitions, "k": keys, "o": orderings, "s": seqs}),
        sort_keys=[("p", "ascending"), ("k", "ascending"), ("o", "ascending"), ("s", "ascending")],
    ).to_pylist()
    key_list = [k.encode() for k in keys.to_pylist()]
    part_list = partitions.to_pylist()
    ord_list = orderings.to_pylist()
    del_list = deletes.to_pylist()

    indexed = _lookup_distinct(order, part_list, key_list, lookup)

    i = 0
    while i < n:
        first = order[i]
        pid, key = part_list[first], key_list[first]
        j = i
        while j < n and part_list[order[j]] == pid and key_list[order[j]] == key:
            j += 1
        state = _tag_key(order[i:j], indexed[(pid, key)], ord_list, del_list, incoming_wins_ties, result)
        if state is not None:
            result.changes.setdefault(pid, {})[key] = state
        i = j
    return result


def _lookup_distinct(order, part_list, key_list, lookup: Lookup) -> dict[tuple[str, bytes], Entry | None]:
    by_partition: dict[str, list[bytes]] = {}
    last = None
    for idx in order:
        pk = (part_list[idx], key_list[idx])
        if pk != last:
            by_partition.setdefault(pk[0], []).append(pk[1])
            last = pk
    found = {}
    for pid, keys in by_partition.items():
        for key, entry in zip(keys, lookup(pid, keys)):
            found[(pid, key)] = entry
    return found


def _tag_key(rows, entry: Entry | None, ords, dels, incoming_wins: bool, result: TagResult) -> Entry | None:
    """Tag one key's records (sorted); return its new entry, or None if nothing changed."""
    result.hit[rows[0]] = entry is not None
    initially_live = entry is not None and not entry.deleted
    state = entry
    last_applied = None
    for row in rows:
        o = ords[row]
        if state is not None and (o < state.ordering or (o == state.ordering and not incoming_wins)):
            result.op[row] = STALE
            continue
        if dels[row]:
            result.op[row] = DELETE
            state = Entry(o, True)
        else:
            result.op[row] = INSERT if state is None or state.deleted else UPDATE
            state = Entry(o, False)
        last_applied = row
    if last_applied is None:
        return None
    if state.deleted:
        result.write[last_applied] = DELETE if initially_live else TOMBSTONE
    else:
        result.write[last_applied] = UPDATE if initially_live else INSERT
    return state
