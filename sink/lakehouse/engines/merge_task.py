"""delta-rs' commit of writes that stayed on the executors (engine = "deltalake", or "auto"
where delta-rs writes, when updates commit through MERGE): one Spark task reads them through
a shuffle and runs delta-rs' MERGE (or append) there, its source streamed, so that no row of
the batch reaches the driver's process; the task reports the outcome."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import pyarrow as pa
from deltalake import DeltaTable, write_deltalake
from deltalake.exceptions import CommitFailedError
from pyspark.sql import DataFrame

from sink.delta_log.checkpoints import NO_HOOKS
from sink.lakehouse.commit.writes import PARTIAL_COLUMN, WRITE_COLUMN, commit_properties, conform
from sink.lakehouse.engines import merge
from sink.lakehouse.engines.merge_clauses import MergeClauses

# The task's one row: its TaskOutcome as JSON.
RESULT_SCHEMA = pa.schema([("outcome", pa.string())])
RESULT_DDL = "outcome string"


@dataclass(frozen=True)
class MergeTask:
    """What the task commits: the table at `version` (the one tagged against, with the
    batch's new columns), `schema` its columns, `clauses` the MERGE (None: an append of
    inserts), whether the source has PARTIAL_COLUMN, and the commit's transaction and
    metadata."""

    uri: str
    version: int
    schema: pa.Schema
    clauses: MergeClauses | None
    partial: bool
    app_id: str
    batch_id: int
    custom_metadata: Mapping[str, str]

    def source_schema(self) -> pa.Schema:
        if self.clauses is None:
            return self.schema
        written = [pa.field(WRITE_COLUMN, pa.string())] + ([pa.field(PARTIAL_COLUMN, pa.bool_())] if self.partial
                                                           else [])
        return pa.schema([*self.schema, *written])


@dataclass(frozen=True)
class TaskOutcome:
    updated: int = 0  # rows the MERGE updated
    committed_before: bool = False  # an earlier run of the task (Spark's retry) committed the batch
    conflict: str | None = None  # another writer's commit landed first: its error


def run(task: MergeTask, source: DataFrame) -> TaskOutcome:
    """Commit `source` (the columns of `task.source_schema()`) from one Spark task."""
    rows = source.repartition(1).mapInArrow(lambda batches: _commit(task, batches), RESULT_DDL).collect()
    return TaskOutcome(**json.loads(rows[0]["outcome"]))


def _commit(task: MergeTask, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    table = DeltaTable(task.uri)
    recorded = table.transaction_version(task.app_id)
    if recorded is not None and recorded >= task.batch_id:
        outcome = TaskOutcome(committed_before=True)
    else:
        table.load_as_version(task.version)
        schema = task.source_schema()
        # Spark's Arrow types can differ from the table's (large strings): cast batch by batch.
        reader = pa.RecordBatchReader.from_batches(
            schema, (b for batch in batches if batch.num_rows
                     for b in conform(pa.Table.from_batches([batch]), schema).to_batches()))
        props = commit_properties(task.app_id, task.batch_id, task.custom_metadata,
                                  "merge" if task.clauses else "append")
        try:
            if task.clauses is None:
                write_deltalake(table, reader, mode="append", commit_properties=props,
                                post_commithook_properties=NO_HOOKS)
                outcome = TaskOutcome()
            else:
                metrics = merge.run(table, reader, task.clauses, props)
                outcome = TaskOutcome(updated=metrics.get("num_target_rows_updated", 0))
        except CommitFailedError as e:
            outcome = TaskOutcome(conflict=f"{task.uri}: a commit landed after version {task.version}, which the "
                                           f"batch was tagged against ({e})")
    yield pa.RecordBatch.from_pylist([{"outcome": json.dumps(dataclasses.asdict(outcome))}], schema=RESULT_SCHEMA)
