"""The commit of a batch, by one of three paths behind one interface, under the retry policy
(sink.batch.retry):

- `RecordsCommit`: the driver holds the batch's writes; the target appends them (inserts
  only), rewrites the files the index located, or MERGEs (sink.lakehouse.engines.delta_rs);
- `WrittenCommit`: Spark's writing tasks wrote the batch's files; the driver commits them as
  Add/Remove actions;
- `SourceCommit`: the writes stayed where the executors tagged them; Spark's MERGE (or append)
  reads them there, or delta-rs' in one Spark task;
- `HistoryCommit`: a history table (scd_type = 2) rebuilt for the keys the batch names."""

from __future__ import annotations

from functools import partial
from typing import Protocol

import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql import functions as F

from sink import columns as C
from sink import keys
from sink.batch.other_writers import OtherWriters
from sink.batch.retry import CommitRetries
from sink.batch.state import BatchState
from sink.config import SinkConfig
from sink.delta_log.predicates import quote_ident
from sink.delta_log.reading import (
    NUM_SHARDS_PROPERTY,
    OTHER_WRITERS_SEEN_PROPERTY,
    READ_VERSION_PROPERTY,
    SHARDS_PROPERTY,
)
from sink.delta_log.schema import pending, with_added
from sink.history import HistoryColumns
from sink.lakehouse.engines.delta_rs import PARTIAL_COLUMN, WRITE_COLUMN, CommitFailedError, rows_in
from sink.lakehouse.engines.engine import DeltaEngine
from sink.tagging.classify import DELETE, INSERT, UPDATE
from sink.tagging.history_writes import HistoryBatch, history_writes
from sink.tagging.moves import keep_stored_values, placed
from sink.tagging.outcomes import record_partitions
from sink.tagging.task_context import TaskContext


class Committer(Protocol):
    def commit(self, state: BatchState) -> None:
        """Commit the batch (one Delta version, carrying its app transaction) and record the
        outcome in its report; CommitFailedError when another writer's commit landed first."""


class RecordsCommit:
    def __init__(self, config: SinkConfig, target: DeltaEngine, writer_id: str):
        self._config, self._target, self._writer_id = config, target, writer_id

    def commit(self, state: BatchState) -> None:
        cfg, records, report = self._config, state.tagged.records, state.report
        writes = records.filter(pc.is_valid(records.column(C.WRITE)))
        if cfg.scope == "global":
            writes = placed(writes, record_partitions(writes, cfg.partition_by, cfg.scope), cfg.partition_by)
            if cfg.keeps_stored_values:
                writes = keep_stored_values(writes, partial(rows_in, self._target.table),
                                            self._target.arrow_schema().names, cfg.key, cfg.partition_by,
                                            cfg.ordering_columns)
        if writes.num_rows == 0:
            report.mode = "none"
            report.table_version = self._target.version()
            return
        rows = writes.select(C.stream_columns(writes.column_names)).append_column(WRITE_COLUMN, writes.column(C.WRITE))
        if cfg.ignore_null_updates:
            rows = rows.append_column(PARTIAL_COLUMN, writes.column(C.PARTIAL))
        report.record(self._target.commit(
            rows, key_cols=cfg.key, ordering=cfg.ordering_columns, app_id=self._writer_id, batch_id=state.batch_id,
            custom_metadata=commit_metadata(state), incoming_wins_ties=cfg.incoming_wins_ties,
            added_columns=state.added,
        ))


class WrittenCommit:
    def __init__(self, target: DeltaEngine, writer_id: str):
        self._target, self._writer_id = target, writer_id

    def commit(self, state: BatchState) -> None:
        written, report = state.tagged.written, state.report
        if written.history is not None:  # a history table's tasks counted its events
            h = written.history
            report.record_history(h["ops"], h["versions_written"], h["versions_replaced"], h["changes"])
        if not any(report.ops[o] for o in (INSERT, UPDATE, DELETE, "delete_missing")):
            report.mode = "none"
            report.table_version = self._target.version()
            return
        report.write_seconds = written.seconds
        report.write_tasks = len(written.task_seconds)
        report.write_busiest_share = max(written.task_seconds) / written.seconds if written.seconds else 0.0
        report.record(self._target.commit_written(written.rewrite, self._writer_id, state.batch_id,
                                                  commit_metadata(state), state.added, written.partitions_changed))


class SourceCommit:
    def __init__(self, config: SinkConfig, target: DeltaEngine, writer_id: str):
        self._config, self._target, self._writer_id = config, target, writer_id

    def commit(self, state: BatchState) -> None:
        cfg, report = self._config, state.report
        if not any(report.ops[o] for o in (INSERT, UPDATE, DELETE, "delete_missing")):
            report.mode = "none"
            report.table_version = self._target.version()
            return
        filled = self._target.filled_columns()
        columns = C.distinct([c for c in self._target.arrow_schema().names if c not in filled],
                             [f.name for f in state.added])
        source = state.merge_source.select(*(F.col(quote_ident(c)) for c in columns),
                                           F.col(C.WRITE).alias(WRITE_COLUMN),
                                           *([F.coalesce(F.col(C.PARTIAL), F.lit(False)).alias(PARTIAL_COLUMN)]
                                             if cfg.ignore_null_updates else []))
        report.record(self._target.commit_source(
            source, [keys.partition_values(p) for p in state.tagged.changed_partitions], report.ops[UPDATE],
            key_cols=cfg.key, ordering=cfg.ordering_columns, partial=cfg.ignore_null_updates,
            incoming_wins_ties=cfg.incoming_wins_ties, app_id=self._writer_id, batch_id=state.batch_id,
            custom_metadata=commit_metadata(state), added_columns=state.added,
            unchanged=cfg.unchanged_value is not None))


class HistoryCommit:
    """Every valid record is an event of its key's history; keys the index holds are rebuilt
    with what the table keeps of them (a column added since reads as nulls), new keys from
    the batch alone."""

    def __init__(self, target: DeltaEngine, writer_id: str, history_batch):
        self._target, self._writer_id, self._history_batch = target, writer_id, history_batch

    def commit(self, state: BatchState) -> None:
        records, report = state.tagged.records, state.report
        present = self._target.arrow_schema()
        added = pending(state.added, present)
        batch = self._history_batch(with_added(present, added), state.ctx)
        writes, counts = history_writes(records.filter(pc.is_null(records.column(C.REASON))), batch,
                                        lambda: self._target.table)
        outcome, done = self._target.commit_history(writes, self._writer_id, state.batch_id,
                                                    commit_metadata(state), added)
        report.record(outcome)
        report.record_history(counts, done.versions_written, done.versions_replaced, done.changes)


class CommitPhase:
    """Commits the batch; after a conflict, commits again or has it tagged again (`retag`), as
    the retry policy says."""

    def __init__(self, config: SinkConfig, target: DeltaEngine, writer_id: str, retag, history_batch,
                 other_writers: OtherWriters):
        self._config = config
        self._target = target
        self._other_writers = other_writers
        self._retag = retag  # (state) -> None: the tag phase, run again
        self._records = RecordsCommit(config, target, writer_id)
        self._written = WrittenCommit(target, writer_id)
        self._source = SourceCommit(config, target, writer_id)
        self._history = HistoryCommit(target, writer_id, history_batch)

    def committer(self, state: BatchState) -> Committer:
        """The path of this batch: the files its tasks wrote, the writes they left on the
        executors, else its records (a history table's rebuilt from them)."""
        if state.tagged.written is not None:
            return self._written
        if state.merge_source is not None:
            return self._source
        return self._history if self._config.scd_type == 2 else self._records

    def run(self, state: BatchState) -> None:
        cfg, report = self._config, state.report
        retries = CommitRetries(max_retries=cfg.max_commit_retries, table_uri=cfg.table_uri, scope=cfg.scope)
        for attempt in retries.attempts:
            state.attempt = attempt
            if state.ctx is None:
                self._retag(state)
            snapshot = self._target.version()
            try:
                with report.timed("commit"):
                    self.committer(state).commit(state)
                break
            except CommitFailedError as e:
                self._target.refresh()
                landed = self._target.commits_since(snapshot)
                # Recorded before the batch commits on top of them, or is tagged against them.
                state.other_writers_seen = self._other_writers.follow(self._target.table)
                retry = retries.after_conflict(batch_id=state.batch_id, attempt=attempt, landed=landed,
                                               batch_partitions=state.tagged.partitions.to_pylist(), error=e)
                report.retries += 1
                if retry == "tag_again":
                    state.ctx = None
        report.records_in = sum(report.ops.values())


def history_batch(config: SinkConfig, history_columns, schema: pa.Schema, ctx: TaskContext) -> HistoryBatch:
    """What a history table's writes need: `history_columns(schema)` gives its columns."""
    columns: HistoryColumns = history_columns(schema)
    return HistoryBatch(schema, columns, tuple(config.key), tuple(config.partition_by), config.scope,
                        config.resolved_tombstone_uri, config.tombstone_ttl_seconds, ctx.now)


def commit_metadata(state: BatchState) -> dict[str, str]:
    """What the commit records of the batch: its shards, their number, the version it read."""
    ctx = state.ctx
    return {SHARDS_PROPERTY: ",".join(map(str, state.tagged.shards)), NUM_SHARDS_PROPERTY: str(ctx.num_shards),
            READ_VERSION_PROPERTY: str(ctx.table_version), OTHER_WRITERS_SEEN_PROPERTY: str(state.other_writers_seen)}
