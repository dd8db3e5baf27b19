"""MERGE commit: delta-rs matches the batch's rows to the table's on key and partition, its
scan pruned to the partitions holding updated or deleted keys (a history table's versions
also on START_AT)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import pyarrow as pa
import pyarrow.compute as pc
from deltalake import CommitProperties, DeltaTable

from sink.history import START_AT
from sink.lakehouse.predicates import merge_predicate, quote_ident
from sink.lakehouse.versions import ACTION_COLUMN, HistoryMerge
from sink.lakehouse.writes import PARTIAL_COLUMN, WRITE_COLUMN, Writes
from sink.ordering import newer_sql


def commit(table: DeltaTable, writes: Writes, partitions: Sequence[Mapping[str, str]]) -> int:
    """`partitions`: those holding the batch's updated or deleted keys (the scan's pruning).
    Returns how many updates the MERGE left alone: no-ops (the stored row already holds exactly
    the new values, e.g. an event delivered again with its ordering), which match no update
    clause and rewrite no file; or, should a replica be behind, rows the ordering guard kept."""
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
        partial_values = {c: f"coalesce({v}, t.{c})" for c, v in columns.items()}
        merge = merge.when_matched_update(
            updates=partial_values,
            predicate=f"{w} <> 'delete' AND s.{quote_ident(PARTIAL_COLUMN)} AND {newer} AND {_differs(partial_values)}")
        whole = f"{w} <> 'delete' AND NOT s.{quote_ident(PARTIAL_COLUMN)}"
    else:
        whole = f"{w} <> 'delete'"
    metrics = (
        merge.when_matched_update(updates=columns, predicate=f"{whole} AND {newer} AND {_differs(columns)}")
        .when_not_matched_insert(updates=columns, predicate=f"{w} <> 'delete'")
        .execute()
    )
    updates = pc.sum(pc.cast(pc.equal(rows.column(WRITE_COLUMN), "update"), "int64")).as_py() or 0
    return max(0, updates - metrics.get("num_target_rows_updated", 0))


def _differs(values: Mapping[str, str]) -> str:
    """SQL: the row the update would write differs from the stored one in some column."""
    return "NOT (" + " AND ".join(f"(t.{c} IS NOT DISTINCT FROM {v})" for c, v in values.items()) + ")"



def commit_history(table: DeltaTable, merge: HistoryMerge, key_cols: Sequence[str], partition_by: Sequence[str],
                   schema: pa.Schema, props: CommitProperties) -> None:
    """A history table's MERGE (sink.lakehouse.versions.merge_rows): versions match on key,
    partition and START_AT; "drop" rows delete, "keep" rows update or insert."""
    types = {f.name: f.type for f in schema}
    start = quote_ident(START_AT)
    predicate = f"{merge_predicate(key_cols, partition_by, merge.partitions, types)} AND t.{start} = s.{start}"
    columns = {quote_ident(f.name): f"s.{quote_ident(f.name)}" for f in schema}
    action = f"s.{quote_ident(ACTION_COLUMN)}"
    (table.merge(merge.source, predicate, source_alias="s", target_alias="t", commit_properties=props)
     .when_matched_delete(predicate=f"{action} = 'drop'")
     .when_matched_update(updates=columns, predicate=f"{action} = 'keep'")
     .when_not_matched_insert(updates=columns, predicate=f"{action} = 'keep'")
     .execute())
