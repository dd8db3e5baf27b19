"""MERGE commit: delta-rs matches the batch's rows to the table's on key and partition, its
scan pruned to the partitions holding updated or deleted keys."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import pyarrow.compute as pc
from deltalake import DeltaTable

from sink.lakehouse.predicates import merge_predicate, quote_ident
from sink.lakehouse.writes import PARTIAL_COLUMN, WRITE_COLUMN, Writes
from sink.ordering import newer_sql


def commit(table: DeltaTable, writes: Writes, partitions: Sequence[Mapping[str, str]]) -> None:
    """`partitions`: those holding the batch's updated or deleted keys (the scan's pruning)."""
    schema = writes.schema
    rows = writes.rows
    types = {f.name: f.type for f in schema}
    source = writes.table_rows().append_column(WRITE_COLUMN, rows.column(WRITE_COLUMN))
    if writes.partial:
        source = source.append_column(PARTIAL_COLUMN, pc.fill_null(rows.column(PARTIAL_COLUMN), False))
    predicate = merge_predicate(writes.key_cols, writes.partition_by, partitions, types)
    columns = {quote_ident(f.name): f"s.{quote_ident(f.name)}" for f in schema}
    w = f"s.{quote_ident(WRITE_COLUMN)}"
    # Guard on ordering too: the index already decided, this keeps a stale
    # replica from ever overwriting a newer row.
    newer = newer_sql(writes.ordering, quote_ident, writes.incoming_wins_ties)
    merge = (table.merge(source, predicate, source_alias="s", target_alias="t", commit_properties=writes.props)
             .when_matched_delete(predicate=f"{w} = 'delete' AND {newer}"))
    if writes.partial:  # the first matching clause applies: partial updates keep stored values
        merge = merge.when_matched_update(
            updates={c: f"coalesce({v}, t.{c})" for c, v in columns.items()},
            predicate=f"{w} <> 'delete' AND s.{quote_ident(PARTIAL_COLUMN)} AND {newer}")
    (
        merge.when_matched_update(updates=columns, predicate=f"{w} <> 'delete' AND {newer}")
        .when_not_matched_insert(updates=columns, predicate=f"{w} <> 'delete'")
        .execute()
    )

