"""Partitioned scope: deletes that name no partition (key-only deletes, as Debezium sends them
under the default replica identity) are placed where their key lives.

Such a delete is looked for in every partition of the table (the tagging task first loads the
partitions its replica lacks: one it did not look at must never make a live key "unknown") and
among the batch's own upserts of its key:
- one partition holds the key: the delete applies there;
- several: the record goes to quarantine as ambiguous;
- none: a delete of an unknown key, kept under the null partition (`keys.null_partition_id`),
  where it makes older upserts of its key stale in any partition (`classify.tag`'s shield).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

AMBIGUOUS = "ambiguous"
# What became of deletes with a null partition column, and (quarantined by sink.routing: an
# upsert needs its partition) of upserts with one.
PLACEMENTS = ("located", "unknown", AMBIGUOUS)
WITHOUT_PARTITION = (*PLACEMENTS, "upsert")


@dataclass
class Placement:
    pids: pa.Array  # every record's partition id, the placed deletes' included
    ambiguous: np.ndarray  # records to quarantine (mask)
    reasons: list[str]  # the quarantine reason of each ambiguous record, in record order
    located: int  # deletes placed in the one partition holding their key
    unknown: int  # deletes of keys no partition holds, kept under the null partition


def unplaced_deletes(rows: pa.Table, partition_cols: Sequence[str], deletes: pa.Array) -> np.ndarray:
    """Which records are deletes with a null partition column."""
    if not partition_cols or not rows.num_rows:
        return np.zeros(rows.num_rows, bool)
    unplaced = pc.is_null(rows.column(partition_cols[0]))
    for c in partition_cols[1:]:
        unplaced = pc.or_(unplaced, pc.is_null(rows.column(c)))
    return pc.and_(unplaced, pc.fill_null(deletes, False)).to_numpy(zero_copy_only=False)


def place_deletes(keys: pa.Array, pids: pa.Array, unplaced: np.ndarray, deletes: np.ndarray,
                  live: Sequence[Sequence[str]], null_pid: str, partition_cols: Sequence[str]) -> Placement:
    """Place the `unplaced` records (deletes with no partition; their `pids` are null).
    `live[i]`: the partitions whose committed rows hold the key of the i-th unplaced record;
    the batch's upserts of that key (records neither unplaced nor deletes) add theirs."""
    keys = keys.cast(pa.binary())
    where = np.flatnonzero(unplaced)
    wanted = keys.take(pa.array(where))
    upserts = np.flatnonzero(~unplaced & ~deletes & pc.is_in(keys, wanted).to_numpy(zero_copy_only=False))
    in_batch: dict[bytes, set[str]] = {}
    for key, pid in zip(keys.take(pa.array(upserts)).to_pylist(), pids.take(pa.array(upserts)).to_pylist()):
        in_batch.setdefault(key, set()).add(pid)
    placed = pids.to_pylist()
    ambiguous = np.zeros(len(placed), bool)
    reasons, located = [], 0
    for i, key, stored in zip(where.tolist(), wanted.to_pylist(), live):
        candidates = sorted(set(stored) | in_batch.get(key, set()))
        if len(candidates) == 1:
            placed[i], located = candidates[0], located + 1
        elif candidates:
            ambiguous[i] = True
            shown = ", ".join(candidates[:3]) + (", ..." if len(candidates) > 3 else "")
            reasons.append(f"{AMBIGUOUS} delete without a partition: null {' or '.join(partition_cols)}, and the "
                           f"key has rows in {len(candidates)} partitions ({shown}); scope = 'global' keeps one row "
                           "per key")
        else:
            placed[i] = null_pid
    unknown = len(where) - located - int(ambiguous.sum())
    return Placement(pa.array(placed, pa.string()), ambiguous, reasons, located, unknown)
