"""Where a history table's key lives in global scope: every partition its events named.

A history table (scd_type 2) keeps every version of a key, each in the partition of its own
values, so in global scope one key's versions may sit in several partitions. Its index entry
then carries, in the place of the one partition a type 1 entry names, the sorted list of the
partitions any of its events named (upserts and deletes that named one). That is a superset
of where its versions and its stored deletes are: a batch reads exactly those partitions of
the key, and a partition in the list that holds none of its rows only costs a probe.

Replicas of one shard may list a key differently: one that tagged a batch whose event lost
a tie lists that event's partition, one built from the table since does not. So a batch
writes the entry of every key its events name into its changes (staged, and the changelog
another executor catches up from), whether its own list grew or not: an older event in a
partition this replica already lists still adds a version there, which the other replica
must learn to read.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from sink.index.entry import changes_schema, unpack_located_many

# Partition ids are URL-quoted (sink.keys.partition_id): a newline never occurs in one.
SEPARATOR = "\n"


def split(location: str | None) -> list[str]:
    """The partitions of a located entry's location ([] for none)."""
    return [p for p in (location or "").split(SEPARATOR) if p]


def joined(pids) -> str:
    return SEPARATOR.join(sorted(set(pids)))


def partition_lists(keys: pa.Array, pids: pa.Array) -> pa.Table:
    """("k", "l"): each key of `keys` with a partition in `pids` (null: none), and its
    partitions as a location."""
    rows = pa.table({"k": keys, "l": pids}).filter(pc.is_valid(pids))
    grouped = rows.group_by("k").aggregate([("l", "distinct")])
    return pa.table({"k": grouped.column("k"),
                     "l": pa.array([joined(ps) for ps in grouped.column("l_distinct").to_pylist()], pa.string())})


def widen(changes: pa.Table, keys: pa.Array, partitions: pa.Array, looked_up: Sequence[bytes],
          raws: Sequence[bytes | None], width: int) -> tuple[pa.Table, pa.Array]:
    """A global-scope batch's index changes with every key's location widened to its list:
    the stored one (`raws`, the entries of the `looked_up` keys) plus the partitions the
    batch's records name (`keys`, `partitions`: null where a delete names none). A stored
    key whose records name a partition while its entry did not change joins with its entry
    as it was and its list widened, grown or not (another replica may list less).

    Also returns each record's stored location (null where the index lacks the key): the
    partitions a batch reads of it."""
    present, orderings, deleted, deleted_at, located = unpack_located_many(raws, width)
    stored = {k: loc for k, loc, p in zip(looked_up, located, present) if p}
    lists = partition_lists(keys.cast(pa.binary()), partitions)
    named = dict(zip(lists.column("k").to_pylist(), map(split, lists.column("l").to_pylist())))
    changed = set(changes.column("key").to_pylist())
    locations = {k: joined([*split(stored.get(k)), *named.get(k, [])]) for k in {*changed, *named}}
    pids = pa.array([locations[k] for k in changes.column("key").to_pylist()], pa.string())
    out = changes.set_column(0, "pid", pids)
    named_only = [i for i, k in enumerate(looked_up) if present[i] and k not in changed and k in named]
    if named_only:
        rows = np.array(named_only, np.int64)
        out = pa.concat_tables([out, pa.table(
            [pa.array([locations[looked_up[i]] for i in named_only], pa.string()),
             pa.array([looked_up[i] for i in named_only], pa.binary()),
             *(pa.array(orderings[rows, j]) for j in range(width)),
             pa.array(deleted[rows]), pa.array(deleted_at[rows])], schema=changes_schema(width))])
    record_keys = keys.cast(pa.binary()).to_pylist()
    return out, pa.array([stored.get(k) for k in record_keys], pa.string())
