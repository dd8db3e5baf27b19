"""From a history batch's tagged records to what its commit writes (sink.lakehouse.commit.versions):
every valid record is an event; a key the index holds is read where the index places it.
Shared by the driver's commit and the executors' writing tasks."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc
from deltalake import DeltaTable

from sink import columns as C
from sink import keys
from sink.history import HistoryColumns, events_schema
from sink.index import history_locations
from sink.lakehouse.commit.versions import PID_COLUMN, HistoryWrites, count_true, free_deletes
from sink.lakehouse.commit.writes import conform
from sink.tagging.classify import DELETE, INSERT, UPDATE


@dataclass(frozen=True)
class HistoryBatch:
    """What a history batch's commit needs that its tagged records do not say."""

    schema: pa.Schema  # the table's, with the columns the batch adds
    cols: HistoryColumns
    key_cols: tuple[str, ...]
    partition_by: tuple[str, ...]
    scope: str
    tombstone_uri: str
    tombstone_ttl_seconds: int | None
    now: float  # the batch's clock (the tombstone TTL)


def history_writes(valid: pa.Table, batch: HistoryBatch,
                   table: Callable[[], DeltaTable]) -> tuple[HistoryWrites, dict[str, int]]:
    """The writes of a history batch's `valid` tagged records (`table`: the table at the
    version they were tagged against, opened only when stored deletes are read), and their
    counts: upserts of keys new to the table (insert), of keys it holds (update), deletes."""
    pids = keys.partition_ids(valid, batch.partition_by)
    located = batch.scope == "global"
    groups = valid.column(C.KEY) if located else pc.binary_join_element_wise(pids, valid.column(C.KEY), "\x00")
    known = pc.is_in(groups, value_set=groups.filter(pc.fill_null(valid.column(C.HIT), False)))
    upserts = pc.invert(valid.column(C.DELETE))
    counts = {INSERT: count_true(pc.and_(upserts, pc.invert(known))), UPDATE: count_true(pc.and_(upserts, known)),
              DELETE: count_true(valid.column(C.DELETE))}
    # Where the table may hold the known keys: their partition, or in global scope every
    # partition the index lists for them (sink.index.history_locations).
    probes = valid.filter(known).select(list(batch.key_cols))
    if located:
        lists = pc.split_pattern(valid.column(C.STORED_AT).filter(known), history_locations.SEPARATOR)
        probes = probes.take(pc.list_parent_indices(lists))
        reads = probes.append_column(PID_COLUMN, pc.list_flatten(lists))
        reads = reads.filter(pc.not_equal(reads.column(PID_COLUMN), ""))
        # Deletes that named no partition are kept in the tombstone table's null partition.
        nowhere = [keys.null_partition_id(batch.partition_by)] if batch.partition_by and probes.num_rows else []
        tombstone_pids = [*pc.unique(reads.column(PID_COLUMN)).to_pylist(), *nowhere]
    else:
        reads = probes.append_column(PID_COLUMN, pids.filter(known))
        tombstone_pids = pc.unique(reads.column(PID_COLUMN)).to_pylist()
    free = free_deletes(table, batch.tombstone_uri, tombstone_pids, batch.cols, batch.schema,
                        batch.tombstone_ttl_seconds, batch.now)
    events = conform(valid, events_schema(batch.schema, batch.cols))
    return HistoryWrites(events, reads, free, batch.schema, batch.cols, list(batch.key_cols),
                         list(batch.partition_by)), counts
