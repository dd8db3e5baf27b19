"""What became of a batch's records, counted where they were tagged: each tagging task sends
its counts in its stats row, so the driver needs none of the records to report them."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from sink import columns as C
from sink import keys
from sink.routing import NULL_PARTITION
from sink.tagging.classify import DELETE, INSERT, STALE, TOMBSTONE, UPDATE

QUARANTINED = "quarantined"

# What became of each input record: what reached the table (one insert, update or delete per
# key and batch; delete_missing: a delete of a key the table does not hold, kept as a
# tombstone only), unchanged (an update the stored row already held: a re-delivery, found at
# the commit), stale (older than the stored or the batch's newer record), superseded (applied,
# then overwritten by a later record of its key in the same batch), quarantined.
UNCHANGED = "unchanged"
OUTCOMES = (INSERT, UPDATE, DELETE, "delete_missing", UNCHANGED, STALE, "superseded", QUARANTINED)
_OUTCOME_OF_WRITE = {INSERT: INSERT, UPDATE: UPDATE, DELETE: DELETE, TOMBSTONE: "delete_missing"}


def outcomes(op: pa.ChunkedArray, write: pa.ChunkedArray) -> dict[str, int]:
    """Count of each OUTCOMES entry, from the records' tags."""
    counts = dict.fromkeys(OUTCOMES, 0)
    for name, n in zip(*_value_counts(write.drop_null())):
        counts[_OUTCOME_OF_WRITE[name]] += n
    unwritten = op.filter(pc.is_null(write))
    for name, n in zip(*_value_counts(unwritten)):
        counts[name if name in (STALE, QUARANTINED) else "superseded"] += n
    return counts


def summary(records: pa.Table, pids: pa.Array, scope: str, partition_cols: list[str]) -> dict:
    """One task's tagged `records` (each in partition `pids`) summed up for the driver: outcomes,
    index hits and misses, the partitions named, upserts quarantined for want of a partition,
    and keys whose records name several partitions (partitioned scope; a key's records are all
    in one shard, so the tasks' counts add up)."""
    hits = records.column(C.HIT)
    reasons = records.column(C.REASON)
    several, example = (0, None) if scope == "global" or not partition_cols else keys_in_several_partitions(
        records, pids)
    return {
        "ops": outcomes(records.column(C.OP), records.column(C.WRITE)),
        "hits": pc.sum(pc.cast(pc.fill_null(hits, False), "int64")).as_py() or 0,
        "misses": pc.sum(pc.cast(pc.equal(hits, False), "int64")).as_py() or 0,
        "pids": pc.unique(pids).drop_null().to_pylist(),
        "upserts_without_partition": pc.sum(pc.cast(pc.fill_null(
            pc.starts_with(reasons, NULL_PARTITION), False), "int64")).as_py() or 0,
        "keys_in_several_partitions": several,
        "several_partitions_example": example,
    }


def keys_in_several_partitions(records: pa.Table, pids: pa.Array) -> tuple[int, list | None]:
    """How many keys of the valid `records` name several partitions, and an example
    [key, [partitions]] (None when there is none)."""
    valid = pc.is_null(records.column(C.REASON))
    batch_keys = records.column(C.KEY).filter(valid).combine_chunks()
    # Only keys named twice can name two partitions: group those alone (a few hundred of a
    # batch's 50k keys in a shard; grouping all of them took 12 ms).
    codes = pc.dictionary_encode(batch_keys).indices.to_numpy(zero_copy_only=False)
    repeated = np.bincount(codes, minlength=1)[codes] > 1
    if not repeated.any():
        return 0, None
    repeated = pa.array(repeated)
    per_key = pa.table({"k": batch_keys.filter(repeated), "p": pids.filter(valid).filter(repeated)}) \
        .group_by("k").aggregate([("p", "count_distinct"), ("p", "distinct")])
    spread = per_key.filter(pc.greater(per_key.column("p_count_distinct"), 1))
    if not spread.num_rows:
        return 0, None
    first = spread.slice(0, 1).to_pylist()[0]
    return spread.num_rows, [first["k"], sorted(first["p_distinct"])]


def record_partitions(records: pa.Table, partition_cols: list[str], scope: str) -> pa.Array:
    """Each record's partition id; in partitioned scope a delete of a key no partition holds
    is kept under the null partition (sink.tagging.placement)."""
    pids = keys.partition_ids(records, partition_cols)
    if scope == "partitioned" and partition_cols:
        pids = pc.fill_null(pids, keys.null_partition_id(partition_cols))
    return pids


def _value_counts(col) -> tuple[list[str], list[int]]:
    counts = pc.value_counts(col)
    return counts.field("values").to_pylist(), counts.field("counts").to_pylist()
