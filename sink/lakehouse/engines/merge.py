"""MERGE commit through delta-rs: the batch's rows matched to the table's on key and partition,
its scan pruned to the partitions holding updated or deleted keys (a history table's versions
also on START_AT). The clauses are both engines' (sink.lakehouse.engines.merge_clauses)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import pyarrow as pa
from deltalake import CommitProperties, DeltaTable

from sink.delta_log.checkpoints import NO_HOOKS
from sink.lakehouse.commit.versions import HistoryMerge
from sink.lakehouse.commit.writes import Writes
from sink.lakehouse.engines.merge_clauses import (
    MergeClauses,
    UpsertSpec,
    history_clauses,
    updates_in,
    upsert_clauses,
    upsert_source,
)


def commit(table: DeltaTable, writes: Writes, partitions: Sequence[Mapping[str, str]]) -> int:
    """`partitions`: those holding the batch's updated or deleted keys (the scan's pruning).
    Returns how many updates the MERGE left alone: no-ops (the stored row already holds exactly
    the new values, e.g. an event delivered again with its ordering), which match no update
    clause and rewrite no file; or, should a replica be behind, rows the ordering guard kept."""
    clauses = upsert_clauses(UpsertSpec.of(writes, writes.schema.names), partitions)
    metrics = run(table, upsert_source(writes), clauses, writes.props)
    return max(0, updates_in(writes.rows) - metrics.get("num_target_rows_updated", 0))


def commit_history(table: DeltaTable, merge: HistoryMerge, key_cols: Sequence[str], partition_by: Sequence[str],
                   schema: pa.Schema, props: CommitProperties) -> None:
    """A history table's MERGE (sink.lakehouse.commit.versions.merge_rows)."""
    run(table, merge.source, history_clauses(merge, key_cols, partition_by, schema, schema.names), props)


def run(table: DeltaTable, source: pa.Table | pa.RecordBatchReader, clauses: MergeClauses,
        props: CommitProperties) -> dict:
    """The MERGE of `clauses` from `source` (a reader is streamed: delta-rs' `streamed_exec`);
    its metrics."""
    merger = (table.merge(source, clauses.on, source_alias="s", target_alias="t", streamed_exec=True,
                          commit_properties=props, post_commithook_properties=NO_HOOKS)
              .when_matched_delete(predicate=clauses.delete))
    for values, condition in clauses.updates:
        merger = merger.when_matched_update(updates=dict(values), predicate=condition)
    values, condition = clauses.insert
    return merger.when_not_matched_insert(updates=dict(values), predicate=condition).execute()
