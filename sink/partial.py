"""Partial updates (`ignore_null_updates`): an update's null columns keep the stored value.

A key's records in one batch are applied in (ordering, arrival) order, so its write must
carry, per column, the last non-null value of the records applied since the key's last
delete in the batch; the MERGE then fills the columns still null from the stored row
(`coalesce(source, target)`). A key deleted earlier in the batch has no stored values to
keep: its write replaces the row whole (not partial).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from sink.tagging import DELETE, INSERT, UPDATE

_APPLIED = pa.array([INSERT, UPDATE, DELETE])
_UPSERTS = pa.array([INSERT, UPDATE])


def fold_nulls(
    rows: pa.Table,
    value_cols: Sequence[str],
    groups: pa.Array,
    orderings: Sequence[pa.Array],
    arrivals: pa.Array,
    op: pa.Array,
    write: pa.Array,
) -> tuple[pa.Table, pa.Array]:
    """`rows` with each upsert write's null `value_cols` filled from the key's earlier
    records in the batch, and the partial flag of each record: on an upsert write, whether
    the MERGE keeps stored values in its null columns (no delete of the key in the batch);
    null elsewhere. `groups` names each record's key (with its partition where keys are
    unique per partition), `orderings` one int64 array per ordering column; arrays are aligned
    with `rows`."""
    n = rows.num_rows
    upsert_write = pc.fill_null(pc.is_in(write, _UPSERTS), False).to_numpy(zero_copy_only=False)
    applied = np.flatnonzero(pc.is_in(op, _APPLIED).to_numpy(zero_copy_only=False))
    if len(applied) == 0:
        return rows, pa.nulls(n, pa.bool_())
    codes = pc.dictionary_encode(groups.take(pa.array(applied))).indices.to_numpy(zero_copy_only=False)
    # np.lexsort sorts by its last key first: key, then the ordering columns in order, then arrival.
    order = np.lexsort((arrivals.to_numpy(zero_copy_only=False)[applied],
                        *(o.to_numpy(zero_copy_only=False)[applied] for o in reversed(orderings)), codes))
    row = applied[order]  # the applied records, by key then (ordering, arrival)
    code = codes[order]
    deleting = pc.equal(op, DELETE).to_numpy(zero_copy_only=False)[row]
    # Deletes so far in the key's run, and in the whole run: records after the last delete fold.
    starts = np.flatnonzero(np.r_[True, code[1:] != code[:-1]])
    run_of = np.repeat(np.arange(len(starts)), np.diff(np.r_[starts, len(row)]))
    cum = np.cumsum(deleting)
    before_run = np.r_[0, cum][starts]
    so_far = cum - before_run[run_of]
    total = np.add.reduceat(deleting.astype(np.int64), starts)
    partial = np.full(n, None, object)
    partial[row] = np.where(upsert_write[row], total[run_of] == 0, None)
    partial_out = pa.array(partial.tolist(), pa.bool_())

    folding = ~deleting & (so_far == total[run_of])
    sizes = np.bincount(run_of[folding], minlength=len(starts))
    kept = folding & (sizes[run_of] > 1)
    take = row[kept]  # still by key then (ordering, arrival): each run is contiguous and ends on its write
    if len(take) == 0 or not value_cols:
        return rows, partial_out
    runs = run_of[kept]
    run_starts = np.flatnonzero(np.r_[True, runs[1:] != runs[:-1]])
    writes_at = take[np.r_[run_starts[1:], len(take)] - 1]
    for c in value_cols:
        values = rows.column(c).take(pa.array(take))
        valid = pc.is_valid(values).to_numpy(zero_copy_only=False)
        last_valid = np.maximum.reduceat(np.where(valid, np.arange(len(take)), -1), run_starts)
        # A column null in every record of the run stays null (the MERGE keeps the stored value).
        source = np.where(last_valid >= 0, take[np.maximum(last_valid, 0)], writes_at)
        index = np.arange(n)
        index[writes_at] = source
        i = rows.schema.get_field_index(c)
        rows = rows.set_column(i, rows.schema.field(i), rows.column(c).take(pa.array(index)))
    return rows, partial_out


def fill_from_stored(rows: pa.Table, row_pids: pa.Array, stored: pa.Table, stored_pids: pa.Array,
                     key_cols: Sequence[str], value_cols: Sequence[str]) -> pa.Table:
    """`rows` with their null `value_cols` taken from the `stored` row of the same key in the
    partition `row_pids` names (global scope: a moved key's new row keeps what its old row
    held)."""
    if rows.num_rows == 0 or stored.num_rows == 0:
        return rows
    here, there, pid = "__row", "__stored_row", "__pid"
    left = pa.table({**{c: rows.column(c) for c in key_cols}, pid: row_pids,
                     here: pa.array(np.arange(rows.num_rows))})
    right = pa.table({**{c: stored.column(c).cast(rows.schema.field(c).type) for c in key_cols}, pid: stored_pids,
                      there: pa.array(np.arange(stored.num_rows))})
    # Only row numbers cross the join (Arrow's hash join does not carry nested columns); a key
    # stored twice in one partition (a foreign writer's doing) gives its first row.
    pairs = left.join(right, [*key_cols, pid], join_type="left outer").group_by(here).aggregate([(there, "min")])
    at = np.full(rows.num_rows, -1, np.int64)
    matched = pairs.filter(pc.is_valid(pairs.column(f"{there}_min")))
    at[matched.column(here).to_numpy()] = matched.column(f"{there}_min").to_numpy()
    take = pa.array(at, mask=at < 0)
    for c in value_cols:
        i = rows.schema.get_field_index(c)
        kept = stored.column(c).cast(rows.schema.field(i).type).take(take)
        rows = rows.set_column(i, rows.schema.field(i), pc.coalesce(rows.column(c), kept))
    return rows
