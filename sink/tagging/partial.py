"""Partial updates: an update's null columns (`ignore_null_updates`), or its string columns
holding `unchanged_value` (a value the source did not send, as Debezium's placeholder for an
unchanged PostgreSQL TOAST column), keep the stored value.

A key's records in one batch are applied in (ordering, arrival) order, so its write must
carry, per column, the last value given by the records applied since the key's last delete
in the batch; the commit then fills the columns still not given from the stored row
(`coalesce(source, target)` for nulls; UNCHANGED, which the write carries in place of
`unchanged_value`, for the others). A key deleted earlier in the batch has no stored values
to keep: its write replaces the row whole (not partial), and one that still lacks a value
it cannot take from a stored row fails the batch (UnchangedValueError).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from sink.errors import UnchangedValueError
from sink.lakehouse.commit.unchanged import UNCHANGED, has_unchanged, is_text, text_type, unchanged_rows
from sink.tagging.classify import DELETE, INSERT, UPDATE

_APPLIED = pa.array([INSERT, UPDATE, DELETE])
_UPSERTS = pa.array([INSERT, UPDATE])
def given(values: pa.Array, nulls_kept: bool, unchanged: str | None) -> np.ndarray:
    """Per value: whether it replaces the stored one (not null under `nulls_kept`, not
    `unchanged` in a string column)."""
    out = pc.is_valid(values).to_numpy(zero_copy_only=False) if nulls_kept else np.ones(len(values), bool)
    if unchanged is not None and text_type(values.type):
        out &= pc.fill_null(pc.not_equal(values, unchanged), True).to_numpy(zero_copy_only=False)
    return out


def fold_nulls(
    rows: pa.Table,
    value_cols: Sequence[str],
    groups: pa.Array,
    orderings: Sequence[pa.Array],
    arrivals: pa.Array,
    op: pa.Array,
    write: pa.Array,
    *,
    nulls_kept: bool = True,
    unchanged: str | None = None,
    key_cols: Sequence[str] = (),
) -> tuple[pa.Table, pa.Array]:
    """`rows` with each upsert write's `value_cols` not given (null, under `nulls_kept`;
    `unchanged` in a string column) filled from the key's earlier records in the batch, and
    the partial flag of each record: on an upsert write, whether the commit keeps stored
    values in the columns it does not give (no delete of the key in the batch); null
    elsewhere. `groups` names each record's key (with its partition where keys are unique per
    partition), `orderings` one int64 array per ordering column; arrays are aligned with
    `rows`. Where `unchanged` is set, a write's values still `unchanged` become UNCHANGED;
    UnchangedValueError when such a write has no stored row to take them from (an insert, or
    an upsert after a delete in the batch), naming the record's `key_cols` (its group when
    none)."""
    applied = np.flatnonzero(pc.is_in(op, _APPLIED).to_numpy(zero_copy_only=False))
    if len(applied) == 0 or not (nulls_kept or (unchanged is not None and
                                                has_unchanged(rows.select(list(value_cols)), unchanged))):
        return rows, pa.nulls(rows.num_rows, pa.bool_())  # nothing to keep: the writes stand as they are
    rows, partial_out = _fold(rows, value_cols, groups, orderings, arrivals, op, write, applied, nulls_kept, unchanged)
    if unchanged is not None:
        rows = _mark_unchanged(rows, value_cols, groups, write, partial_out, unchanged, key_cols)
    return rows, partial_out


def _fold(rows: pa.Table, value_cols: Sequence[str], groups: pa.Array, orderings: Sequence[pa.Array],
          arrivals: pa.Array, op: pa.Array, write: pa.Array, applied: np.ndarray, nulls_kept: bool,
          unchanged: str | None) -> tuple[pa.Table, pa.Array]:
    """fold_nulls over the `applied` records (at least one)."""
    n = rows.num_rows
    upsert_write = pc.fill_null(pc.is_in(write, _UPSERTS), False).to_numpy(zero_copy_only=False)
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
    firsts = take[run_starts]
    # A fresh run (a new key, or one deleted earlier in the batch) starts its row from its first
    # record, nulls and all; a partial one from the stored row, which the commit fills in.
    fresh = (total[runs[run_starts]] > 0) | pc.equal(write.take(pa.array(writes_at)), INSERT).to_numpy(
        zero_copy_only=False)
    first = np.zeros(len(take), bool)
    first[run_starts] = fresh
    for c in value_cols:
        values = rows.column(c).take(pa.array(take))
        valid = given(values, nulls_kept, unchanged) | (first & given(values, False, unchanged))
        last_valid = np.maximum.reduceat(np.where(valid, np.arange(len(take)), -1), run_starts)
        # A column no record of the run gives: a partial run's write keeps it as it has it (the
        # commit keeps the stored value); a fresh run's first record held `unchanged`, whose
        # value is not known (UnchangedValueError below).
        source = np.where(last_valid >= 0, take[np.maximum(last_valid, 0)], np.where(fresh, firsts, writes_at))
        index = np.arange(n)
        index[writes_at] = source
        i = rows.schema.get_field_index(c)
        rows = rows.set_column(i, rows.schema.field(i), rows.column(c).take(pa.array(index)))
    return rows, partial_out


def _mark_unchanged(rows: pa.Table, value_cols: Sequence[str], groups: pa.Array, write: pa.Array,
                    partial: pa.Array, unchanged: str, key_cols: Sequence[str]) -> pa.Table:
    """The upsert writes' `unchanged` string values as UNCHANGED; UnchangedValueError for a
    write with one and no stored row (an insert, or not partial)."""
    for c, i, marked, lost in _unchanged_writes(rows, value_cols, write, partial, unchanged):
        if pc.any(lost).as_py():
            at = pc.index(lost, True).as_py()
            key = {k: rows.column(k)[at].as_py() for k in key_cols} if key_cols else groups[at].as_py()
            raise UnchangedValueError(
                f"column {c!r} of the record for key {key!r} holds unchanged_value {unchanged!r} (the "
                f"source did not send it), and the table has no stored row to keep it from: the key is new to the "
                f"table, or was deleted earlier in the batch. Capture the column whole at the source (PostgreSQL: "
                f"ALTER TABLE ... REPLICA IDENTITY FULL), or set unsent_values = 'quarantine'; nothing was written")
        rows = rows.set_column(i, rows.schema.field(i), pc.if_else(marked, UNCHANGED, rows.column(c)))
    return rows


def _unchanged_writes(rows: pa.Table, value_cols: Sequence[str], write: pa.Array, partial: pa.Array,
                      unchanged: str):
    """Per string value column holding `unchanged` in some upsert write: its name, index, the
    writes holding it, and those of them without a stored row to keep it from."""
    upsert = pc.fill_null(pc.is_in(write, _UPSERTS), False)
    resolvable = pc.fill_null(pc.and_(pc.equal(write, UPDATE), partial), False)
    for c in value_cols:
        i = rows.schema.get_field_index(c)
        if not is_text(rows.schema.field(i)):
            continue
        marked = pc.fill_null(pc.and_(upsert, pc.equal(rows.column(c), unchanged)), False)
        if pc.any(marked).as_py():
            yield c, i, marked, pc.and_(marked, pc.invert(resolvable))


def unsent_records(rows: pa.Table, value_cols: Sequence[str], groups: pa.Array, orderings: Sequence[pa.Array],
                   arrivals: pa.Array, op: pa.Array, write: pa.Array, *, nulls_kept: bool, unchanged: str,
                   key_cols: Sequence[str]) -> tuple[np.ndarray, list[str]] | None:
    """The records fold_nulls would fail on, to set aside instead (None: none): of each key
    whose write keeps `unchanged` with no stored row to take it from, the records holding
    `unchanged`; and a reason for each, naming the key and the column. The rest, tagged again
    without them, fold: no record of those keys is left to hold it."""
    if not has_unchanged(rows.select(list(value_cols)), unchanged):
        return None
    applied = np.flatnonzero(pc.is_in(op, _APPLIED).to_numpy(zero_copy_only=False))
    if len(applied) == 0:
        return None
    folded, partial = _fold(rows, value_cols, groups, orderings, arrivals, op, write, applied, nulls_kept, unchanged)
    lost_groups, columns = set(), {}
    for c, _, _, lost in _unchanged_writes(folded, value_cols, write, partial, unchanged):
        for g in groups.filter(lost).to_pylist():
            lost_groups.add(g)
            columns.setdefault(g, c)
    if not lost_groups:
        return None
    held = unchanged_rows(rows.select(list(value_cols)), unchanged)
    aside = pc.and_(held, pc.is_in(groups, pa.array(sorted(lost_groups), groups.type))).to_numpy(zero_copy_only=False)
    at = np.flatnonzero(aside)
    named = groups.take(pa.array(at)).to_pylist()
    keys_ = rows.select(list(key_cols)).take(pa.array(at)).to_pylist() if key_cols else named
    reasons = [f"unsent value: column {columns[g]!r} holds unchanged_value {unchanged!r} (the source did not send "
               f"it), and no stored row of key {k!r} is there to keep it from (the key is new to the table, or "
               f"deleted earlier in the batch)" for g, k in zip(named, keys_)]
    return aside, reasons


def fill_from_stored(rows: pa.Table, row_pids: pa.Array, stored: pa.Table, stored_pids: pa.Array,
                     key_cols: Sequence[str], value_cols: Sequence[str], *, nulls_kept: pa.Array | None = None
                     ) -> pa.Table:
    """`rows` with their null (where `nulls_kept`, default all) or UNCHANGED `value_cols` taken
    from the `stored` row of the same key in the partition `row_pids` names (global scope: a
    moved key's new row keeps what its old row held)."""
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
    nulls_kept = pa.array(np.ones(rows.num_rows, bool)) if nulls_kept is None else nulls_kept
    for c in value_cols:
        i = rows.schema.get_field_index(c)
        field, values = rows.schema.field(i), rows.column(c)
        kept = stored.column(c).cast(field.type).take(take)
        values = pc.if_else(nulls_kept, pc.coalesce(values, kept), values)
        if is_text(field):
            values = pc.if_else(pc.fill_null(pc.equal(values, UNCHANGED), False), kept, values)
        rows = rows.set_column(i, field, values)
    return rows
