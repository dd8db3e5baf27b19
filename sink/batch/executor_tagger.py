"""Tagging on the executors (`tag_on = "executors"`, or "auto" under a cluster master): one
Spark job routes the records by shard and tags each shard in a task (`mapInArrow` over
sink.tagging.executor.tag_batches); where the table allows it, writing tasks after the tagging ones
write the batch's files, and only what the commit needs comes back to the driver."""

from __future__ import annotations

import dataclasses
import logging
from functools import partial

import pyarrow as pa
from pyspark import StorageLevel
from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from sink import columns as C
from sink import keys
from sink.batch.side_tables import SideTables
from sink.batch.state import BatchState
from sink.config import SinkConfig
from sink.delta_log.schema import with_added
from sink.lakehouse.engines.delta_rs import COMMIT_KINDS
from sink.lakehouse.engines.engine import DeltaEngine
from sink.lakehouse.engines.update_modes import MERGE_ON_READ
from sink.library_errors import partition_load_failure, spark_aborted_a_rerun
from sink.ops import metrics
from sink.routing import sql_string
from sink.session import SessionKind
from sink.tagging.classify import DELETE, INSERT, UPDATE
from sink.tagging.executor import tag_batches
from sink.tagging.history_writes import HistoryBatch
from sink.tagging.release import Replicas, release_executor_replicas
from sink.tagging.task_context import TaskContext
from sink.tagging.writing import INSERT_SPLIT, WriteContext, write_batches

log = logging.getLogger(__name__)

# A lost executor's tasks that Spark would not re-run alone: the job runs again, this many times.
JOB_RERUNS = 2
# The writing task a copy of a tagged row goes to (`ExecutorTagger._writing`).
_COPY = "__sink_copy"


class ExecutorTagger:
    """Tags in Spark tasks; other executors may tag a shard's next batch, so each task writes
    its shard's index entries to the writer's changelog, which they catch up from."""

    on_driver = False

    def __init__(self, config: SinkConfig, target: DeltaEngine, side_tables: SideTables, writer_id: str,
                 history_batch, session: SessionKind):
        self._config = config
        self._target = target
        self._side_tables = side_tables
        self._writer_id = writer_id
        self._history_batch = history_batch  # (schema, ctx) -> HistoryBatch, for history tables' writing tasks
        self._session = session
        self.changelog_uri = config.resolved_changelog_uri
        # The replicas of the table the executors keep, released when the stream ends (`close`).
        self._replicas: Replicas | None = None
        self._cached: DataFrame | None = None  # the last batch's writes left on the executors

    def writes_files(self, target: DeltaEngine) -> bool:
        """Executors write the batch's files where the table allows (else the driver commits
        from the records: a MERGE, or a global-scope history table's rebuild, whose keys'
        versions span partitions)."""
        cfg = self._config
        if cfg.scd_type == 2:
            return cfg.scope == "partitioned" and target.history_update_mode() == "rewrite"
        return target.update_mode() in ("rewrite", MERGE_ON_READ)

    def leaves_writes_on_executors(self, target: DeltaEngine) -> bool:
        """Where the executors do not write the files, the MERGE (Spark's, or delta-rs' in a
        Spark task) reads the writes where they were tagged (a history table's rebuild still
        runs on the driver)."""
        return self._config.scd_type == 1 and target.merges_on_executors() and not self.writes_files(target)

    def tag(self, state: BatchState, tombstones_due: bool) -> tuple[pa.Table, bool]:
        """The tagging job's output: tagged records and stats rows; with `ctx.write_files`, the
        writing tasks' file rows in place of the writes. The tombstones are left to the side
        tables phase."""
        ctx, prepared = state.ctx, state.prepared
        self._replicas = Replicas.of(ctx)
        self._uncache()  # an earlier attempt's
        release = None
        try:
            with state.report.timed("tag"):
                job = prepared.repartition(ctx.num_shards, F.expr(keys.spark_route_expr(ctx.num_shards))).mapInArrow(
                    partial(tag_batches, ctx), state.out_schema)
                if ctx.write_files:
                    snapshot, release = self._session.share(self._target.stored_files())
                    job = self._writing(job, ctx, state, snapshot)
                if ctx.merge_source:
                    return self._leave_writes(job, state), False
                return self._run(job, state), False
        except Exception as e:
            failure = partition_load_failure(e, ctx.batch_id)
            if failure is None:
                raise
            # A task that failed its partition loads fails the batch; the message names them.
            metrics.LOAD_FAILURES.labels(self._writer_id).inc()
            raise failure from e
        finally:
            if release is not None:
                release()

    def _leave_writes(self, job: DataFrame, state: BatchState) -> pa.Table:
        """Run the tagging job once, its output cached on the executors; the rows without a
        write come back (stats, quarantined records, delete records for the tombstones), the
        writes stay, as the MERGE's source (`state.merge_source`)."""
        self._cached = job.persist(StorageLevel.MEMORY_AND_DISK)
        output = self._run(self._cached.where(F.col(C.WRITE).isNull()), state)
        state.merge_source = self._cached.where(F.col(C.WRITE).isNotNull())
        return output

    def _uncache(self) -> None:
        if self._cached is not None:
            self._cached.unpersist()
            self._cached = None

    def after_commit(self, state: BatchState) -> None:
        self._uncache()
        if state.report.mode in COMMIT_KINDS:
            with state.report.timed("changelog"):
                self._side_tables.sweep_changelog(self.changelog_uri, state.ctx.table_version)

    def close(self) -> None:
        self._uncache()
        if self._replicas is not None:
            release_executor_replicas(self._session, self._replicas)
            self._replicas = None

    def _run(self, job: DataFrame, state: BatchState) -> pa.Table:
        """The job's output. A lost executor normally costs its tasks, which Spark runs again;
        when Spark will not (it aborts the job as it cannot roll back the job's last stage: seen
        when an executor dies inside a writing task after other writing tasks finished), the job
        runs again, up to JOB_RERUNS times. Tagging tasks run again tag the same (staged entries
        of their batch are cleared first); files of the aborted job are never committed."""
        for rerun in range(JOB_RERUNS + 1):
            try:
                return job.toArrow()
            except Exception as e:
                if rerun == JOB_RERUNS or not spark_aborted_a_rerun(e):
                    raise
                state.report.jobs_rerun += 1
                log.warning("batch %s: Spark aborted the tagging job after losing an executor (%s); running it "
                            "again", state.batch_id, spark_aborted_a_rerun(e))

    def _writing(self, tagging: DataFrame, ctx: TaskContext, state: BatchState, snapshot) -> DataFrame:
        """The writing tasks after the tagging ones: each partition's writes in one task, which
        rewrites its files (`snapshot`: the broadcast files of the version tagged against)."""
        cfg = self._config
        schema = with_added(self._target.arrow_schema(), state.added)
        history: HistoryBatch | None = self._history_batch(schema, ctx) if cfg.scd_type == 2 else None
        wctx = WriteContext(
            table_uri=cfg.table_uri, schema=schema,
            key_cols=tuple(cfg.key), ordering=tuple(cfg.ordering_columns), partition_by=tuple(cfg.partition_by),
            incoming_wins_ties=cfg.incoming_wins_ties, partial=cfg.ignore_null_updates,
            output_schema=ctx.output_schema, files=snapshot, table_version=ctx.table_version, history=history,
            merge_on_read=self._target.update_mode() == MERGE_ON_READ,
            rewrite_marked_share=self._target.rewrite_marked_share,
            change_data=self._target.change_data_feed(), column_mapping=self._target.column_mapping(),
            identity=self._target.written_identity(), tasks=ctx.num_shards, layout=self._target.file_layout(),
        )
        wctx = dataclasses.replace(wctx, shares=not cfg.partition_by and history is None and not wctx.change_data
                                   and not wctx.identity and ctx.num_shards > 1)
        if wctx.shares:  # every write to each task, the other rows to one, by their key
            writes = F.expr(f"{C.WRITE} IN ({', '.join(sql_string(w) for w in (INSERT, UPDATE, DELETE))})")
            tasks = F.when(writes, F.sequence(F.lit(0), F.lit(ctx.num_shards - 1))).otherwise(
                F.array(F.expr(f"CAST(pmod(xxhash64({C.KEY}), {ctx.num_shards}) AS INT)")))
            copies = tagging.withColumn(_COPY, F.explode(tasks))
            return copies.repartition(ctx.num_shards, F.expr(keys.spark_copies_route_expr(_COPY, ctx.num_shards))
                                      ).drop(_COPY).mapInArrow(partial(write_batches, wctx), state.out_schema)
        route = keys.spark_write_route_expr(cfg.partition_by, f"{C.WRITE} = {sql_string(INSERT)}", ctx.num_shards,
                                            INSERT_SPLIT)
        return tagging.repartition(ctx.num_shards, F.expr(route)).mapInArrow(partial(write_batches, wctx),
                                                                             state.out_schema)
