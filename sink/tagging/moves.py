"""Global scope: each write aimed at the row it changes, wherever the record says it goes."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pyarrow as pa
import pyarrow.compute as pc

from sink import columns as C
from sink import keys
from sink.lakehouse.commit.unchanged import unchanged_rows
from sink.tagging.classify import DELETE, INSERT, UPDATE
from sink.tagging.partial import fill_from_stored

# (partition ids, columns) -> those columns of the table's rows in those partitions.
ReadRows = Callable[[Sequence[str], Sequence[str]], pa.Table]


def placed(writes: pa.Table, own: pa.Array, partition_cols: Sequence[str]) -> pa.Table:
    """Each write aimed at the row it changes. A delete takes the partition of the row the
    index located (its record may name none or another); a move becomes an insert where the
    record says plus a delete of the stored row (with the record's ordering, which the
    commit's ordering guard checks). `own`: each write's record's partition id."""
    if not partition_cols or writes.num_rows == 0:
        return writes
    write, stored = writes.column(C.WRITE), writes.column(C.STORED_AT)
    deleting = pc.fill_null(pc.equal(write, DELETE), False)
    moving = pc.fill_null(pc.and_(pc.equal(write, UPDATE), pc.not_equal(stored, own)), False)
    if not (pc.any(deleting).as_py() or pc.any(moving).as_py()):
        return writes
    staying = writes.filter(pc.invert(pc.or_(deleting, moving)))
    deletes = _at_stored(writes.filter(deleting), partition_cols)
    moved = writes.filter(moving)
    moved_out = _at_stored(moved, partition_cols)
    moved_out = moved_out.set_column(moved_out.schema.get_field_index(C.WRITE), C.WRITE,
                                     pa.array([DELETE] * moved.num_rows, pa.string()))
    moved_in = moved.set_column(moved.schema.get_field_index(C.WRITE), C.WRITE,
                                pa.array([INSERT] * moved.num_rows, pa.string()))
    return pa.concat_tables([staying, deletes, moved_out, moved_in])


def keep_stored_values(writes: pa.Table, read_rows: ReadRows, table_columns: Sequence[str],
                       key_cols: Sequence[str], partition_cols: Sequence[str],
                       ordering: Sequence[str]) -> pa.Table:
    """Partial updates (`placed` writes): a moved key's new row (an insert in its new
    partition) takes the stored row's values where its own are null (PARTIAL) or UNCHANGED,
    read from the rows it replaces."""
    nulls_kept = pc.fill_null(writes.column(C.PARTIAL), False)
    moved_in = pc.fill_null(pc.and_(pc.equal(writes.column(C.WRITE), INSERT), pc.is_valid(writes.column(C.STORED_AT))),
                            False)
    moved_in = pc.and_(moved_in, pc.or_(nulls_kept, unchanged_rows(writes)))
    if not pc.any(moved_in).as_py():
        return writes
    keys_only = {*key_cols, *partition_cols, *ordering}
    values = [c for c in table_columns if c not in keys_only and c in writes.column_names]
    moving = writes.filter(moved_in)
    stored = read_rows(pc.unique(moving.column(C.STORED_AT)).to_pylist(), C.distinct(key_cols, partition_cols, values))
    filled = fill_from_stored(moving, moving.column(C.STORED_AT), stored,
                              keys.partition_ids(stored, partition_cols), key_cols, values,
                              nulls_kept=nulls_kept.filter(moved_in))
    return pa.concat_tables([writes.filter(pc.invert(moved_in)), filled])


def _at_stored(rows: pa.Table, partition_cols: Sequence[str]) -> pa.Table:
    """`rows` with their partition columns set to the partition in STORED_AT."""
    return keys.with_partition_values(rows, rows.column(C.STORED_AT).combine_chunks(), partition_cols)
