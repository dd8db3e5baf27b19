"""SCD type 2 history of keys, a pure function of each key's set of change events.

A key's events in sequence order make its history. A run of upserts whose tracked columns
agree is one version: it starts at the run's first event and ends at the event after its
last one (the next version's start, or the delete that closed it), open while none came.
The version shows the run's last event, so a change of untracked columns only updates it.
At one sequence a delete beats an upsert, and of two upserts the one with the greater
values is kept (column by column, nulls lowest; nested columns do not take part), so no
arrival order or batching changes the result.

The history keeps every event it was built from: each version holds its run's last event
and, in RUN_EVENTS, the run's earlier ones (their sequence and untracked values: the tracked
ones are the version's); a delete that closed no version is `free`. With `fill_nulls`
(ignore_null_updates) an upsert's nulls take the key's previous values, in sequence order
and not across a delete; RUN_EVENTS then keeps every value as it came, and FILLED names the
shown event's filled columns, so a late event refills what follows it. `events_of` gives the
event set back, so a batch rebuilds a key's history from what is stored plus its own events:
`build(concat(events_of(h), batch))` is the history of all the events, in whatever order
and batches they came.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

START_AT = "__START_AT"
END_AT = "__END_AT"
RUN_EVENTS = "__RUN_EVENTS"
# With `fill_nulls`: the columns of a version's shown event whose null took the previous value.
FILLED = "__FILLED"
HISTORY_COLUMNS = (START_AT, END_AT, RUN_EVENTS, FILLED)


@dataclass(frozen=True)
class HistoryColumns:
    """The columns of an events table: the key, the ordering (the sequence, one or more
    columns compared in order), the delete flag and the stored values, of which `tracked`
    open a new version when they change (an ordering column tracked: every event opens one)."""

    key: tuple[str, ...]
    ordering: tuple[str, ...]
    delete: str
    values: tuple[str, ...]
    tracked: tuple[str, ...]
    # An upsert's null values take the key's previous ones (in sequence order, not across a
    # delete): ignore_null_updates. The events keep their nulls, so late events refill.
    fill_nulls: bool = False

    def __post_init__(self):
        unknown = [c for c in self.tracked if c not in self.values and c not in self.ordering]
        if unknown:
            raise ValueError(f"tracked columns {unknown} are not among the values {list(self.values)} or the "
                             f"ordering {list(self.ordering)}")

    @property
    def event_columns(self) -> list[str]:
        return [*self.key, *self.ordering, self.delete, *self.values]

    @property
    def untracked(self) -> list[str]:
        return [c for c in self.values if c not in self.tracked]

    @property
    def run_values(self) -> list[str]:
        """The values RUN_EVENTS keeps of a run's earlier events: those the version does not
        show (untracked; all of them, as they came, when nulls are filled)."""
        return list(self.values) if self.fill_nulls else self.untracked


@dataclass(frozen=True)
class History:
    """`versions`: key, values, the ordering of the event shown, START_AT and END_AT (typed
    like the ordering: the value, or a struct of the columns when there are several) and
    RUN_EVENTS; `free`: deletes that closed no version (the columns of the events table)."""

    versions: pa.Table
    free: pa.Table


def collapse(events: pa.Table, cols: HistoryColumns) -> pa.Table:
    """One event per key and sequence (a delete, else the upsert with the greatest values),
    sorted by key and sequence; a delete's values are null."""
    events = events.select(cols.event_columns)
    sortable = [c for c in cols.values if not pa.types.is_nested(events.schema.field(c).type)]
    order = pc.sort_indices(events, sort_keys=[
        *[(c, "ascending", "at_end") for c in (*cols.key, *cols.ordering)], (cols.delete, "descending", "at_end"),
        *[(c, "descending", "at_end") for c in sortable]])
    events = events.take(order)
    events = events.filter(pa.array(_changes(events, [*cols.key, *cols.ordering])))
    deletes = events.column(cols.delete)
    for c in cols.values:
        i = events.schema.get_field_index(c)
        events = events.set_column(i, c, pc.if_else(deletes, pa.nulls(len(events), events.schema.field(c).type),
                                                    events.column(c)))
    return events


def build(events: pa.Table, cols: HistoryColumns) -> History:
    """The history of the keys of `events` (any number of events per key, in any order)."""
    raw = collapse(events, cols)
    n = raw.num_rows
    new_key = _changes(raw, cols.key)
    delete = np.asarray(raw.column(cols.delete).to_numpy(zero_copy_only=False), bool)
    after_delete = np.ones(n, bool)
    after_delete[1:] = delete[:-1]
    events = _filled(raw, cols.values, new_key | after_delete) if cols.fill_nulls else raw
    opens = ~delete & (new_key | after_delete | _changes(events, cols.tracked))
    next_same_key = np.zeros(n, bool)
    next_same_key[:-1] = ~new_key[1:]
    continued = np.zeros(n, bool)  # the next event extends this one's run
    continued[:-1] = ~delete[1:] & ~opens[1:]
    tails = np.flatnonzero(~delete & ~continued)
    hidden = np.flatnonzero(~delete & continued)
    opener = np.maximum.accumulate(np.where(opens, np.arange(n), 0))
    after = pa.array(tails + 1, mask=~next_same_key[tails], type=pa.int64())
    versions = events.take(tails).select([*cols.key, *cols.values, *cols.ordering])
    versions = versions.append_column(START_AT, _sequence(events.take(opener[tails]), cols.ordering))
    versions = versions.append_column(END_AT, _sequence(events.take(after), cols.ordering))
    # A hidden event belongs to the version of the next tail (events are in run order).
    counts = np.bincount(np.searchsorted(tails, hidden), minlength=len(tails))
    offsets = pa.array(np.concatenate([[0], np.cumsum(counts)]), pa.int32())
    run = raw.take(hidden).select([*cols.ordering, *cols.run_values])
    runs = pa.ListArray.from_arrays(offsets, pa.StructArray.from_arrays(
        [c.combine_chunks() for c in run.columns], fields=list(run.schema)))
    versions = versions.append_column(RUN_EVENTS, runs)
    if cols.fill_nulls:
        versions = versions.append_column(FILLED, _filled_names(raw.take(tails), versions, cols.values))
    return History(versions, raw.filter(pa.array(delete & (new_key | after_delete))))


def _filled(events: pa.Table, columns: Sequence[str], starts: np.ndarray) -> pa.Table:
    """`events` with each null of `columns` taking the value before it, within the segments
    `starts` opens (a key's events up to a delete)."""
    positions = np.arange(events.num_rows)
    for c in columns:
        column = events.column(c).combine_chunks()
        valid = np.asarray(pc.is_valid(column).to_numpy(zero_copy_only=False), bool)
        source = np.maximum.accumulate(np.where(valid | starts, positions, 0))
        events = events.set_column(events.schema.get_field_index(c), c, column.take(pa.array(source)))
    return events


def _filled_names(raw: pa.Table, shown: pa.Table, columns: Sequence[str]) -> pa.Array:
    """Per row: the `columns` null in `raw` and set in `shown`."""
    filled = np.zeros((raw.num_rows, len(columns)), bool)
    for i, c in enumerate(columns):
        filled[:, i] = pc.and_(pc.is_null(raw.column(c)), pc.is_valid(shown.column(c))).to_numpy(zero_copy_only=False)
    rows, at = np.nonzero(filled)
    offsets = np.concatenate([[0], np.cumsum(np.bincount(rows, minlength=raw.num_rows))])
    return pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), pa.array([columns[i] for i in at], pa.string()))


def history_fields(schema: pa.Schema, cols: HistoryColumns) -> list[pa.Field]:
    """START_AT and END_AT (the ordering column's type, or a struct of the ordering columns)
    and RUN_EVENTS (a list of the ordering and untracked values) for a table whose other
    columns are `schema`."""
    if len(cols.ordering) == 1:
        sequence = schema.field(cols.ordering[0]).type
    else:
        sequence = pa.struct([schema.field(c) for c in cols.ordering])
    run = pa.list_(pa.struct([schema.field(c) for c in (*cols.ordering, *cols.run_values)]))
    fields = [pa.field(START_AT, sequence), pa.field(END_AT, sequence), pa.field(RUN_EVENTS, run)]
    return [*fields, pa.field(FILLED, pa.list_(pa.string()))] if cols.fill_nulls else fields


def events_schema(schema: pa.Schema, cols: HistoryColumns) -> pa.Schema:
    """The events table's schema for a table of `schema`."""
    return pa.schema([*(schema.field(c) for c in (*cols.key, *cols.ordering)), pa.field(cols.delete, pa.bool_()),
                      *(schema.field(c) for c in cols.values)])


def events_of(history: History, cols: HistoryColumns) -> pa.Table:
    """The events `history` was built from (collapsed): each version's shown event and its
    run's earlier ones, the deletes that closed a version and the free deletes."""
    versions = history.versions
    schema = history.free.schema
    shown = versions.select([*cols.key, *cols.ordering, *cols.values])
    if cols.fill_nulls:  # the event as it came: its filled values null again
        filled = versions.column(FILLED).combine_chunks()
        rows = pc.list_parent_indices(filled).to_numpy(zero_copy_only=False)
        names = filled.flatten().to_numpy(zero_copy_only=False)
        for c in cols.values:
            came_null = np.zeros(len(shown), bool)
            came_null[rows[names == c]] = True
            shown = shown.set_column(shown.schema.get_field_index(c), c, pc.if_else(
                pa.array(came_null), pa.nulls(len(shown), shown.schema.field(c).type), shown.column(c)))
    shown = shown.append_column(cols.delete, pa.array(np.zeros(len(shown), bool)))
    runs = versions.column(RUN_EVENTS).combine_chunks()
    earlier = pa.Table.from_struct_array(runs.flatten())
    owner = versions.take(pc.list_parent_indices(runs))
    for c in [*cols.key, *(c for c in cols.tracked if c not in cols.run_values and c not in cols.ordering)]:
        earlier = earlier.append_column(c, owner.column(c))
    earlier = earlier.append_column(cols.delete, pa.array(np.zeros(len(earlier), bool)))
    # A version that ends where none of the key's versions starts was closed by a delete.
    ends = _with_sequence(versions.select(list(cols.key)), versions.column(END_AT), cols.ordering)
    ends = ends.filter(pc.is_valid(versions.column(END_AT)))
    starts = _with_sequence(versions.select(list(cols.key)), versions.column(START_AT), cols.ordering)
    closing = ends.join(starts, keys=[*cols.key, *cols.ordering], join_type="left anti")
    closing = closing.append_column(cols.delete, pa.array(np.ones(len(closing), bool)))
    for c in cols.values:
        closing = closing.append_column(c, pa.nulls(len(closing), schema.field(c).type))
    parts = [t.select(cols.event_columns).cast(schema) for t in (shown, earlier, closing, history.free)]
    return collapse(pa.concat_tables(parts), cols)


def _sequence(rows: pa.Table, ordering: Sequence[str]) -> pa.Array:
    """The ordering of `rows` as one column: the value, or a struct of the columns."""
    if len(ordering) == 1:
        return rows.column(ordering[0]).combine_chunks()
    columns = [rows.column(c).combine_chunks() for c in ordering]
    valid = pc.is_valid(columns[0])  # a null sequence (no next event) is a null struct
    return pa.StructArray.from_arrays(columns, names=list(ordering), mask=pc.invert(valid))


def _with_sequence(rows: pa.Table, sequence: pa.ChunkedArray, ordering: Sequence[str]) -> pa.Table:
    """`rows` with the ordering columns of a START_AT or END_AT column."""
    sequence = sequence.combine_chunks()
    if len(ordering) == 1:
        return rows.append_column(ordering[0], sequence)
    for i, c in enumerate(ordering):
        rows = rows.append_column(c, pc.struct_field(sequence, i))
    return rows


def _changes(rows: pa.Table, columns: Sequence[str]) -> np.ndarray:
    """Per row: whether any of `columns` differs from the row before (nulls equal to nulls;
    the first row always differs)."""
    n = rows.num_rows
    differs = np.zeros(n, bool)
    if n:
        differs[0] = True
    for c in columns:
        column = rows.column(c).combine_chunks()
        differs[1:] |= _differs(column[1:], column[:-1])
    return differs


def _differs(a: pa.Array, b: pa.Array) -> np.ndarray:
    try:
        same = pc.fill_null(pc.equal(a, b), False)
    except pa.ArrowNotImplementedError:  # nested values: compared in Python
        return np.array([x != y for x, y in zip(a.to_pylist(), b.to_pylist())], bool)
    both_null = pc.and_(pc.is_null(a), pc.is_null(b))
    return ~np.asarray(pc.or_(same, both_null).to_numpy(zero_copy_only=False), bool)
