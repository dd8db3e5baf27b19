"""UpsertSink: the driver-side orchestration of one micro-batch."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.pandas.types import to_arrow_schema

from sink import columns as C
from sink import keys, metrics
from sink.arrival import batch_files, file_order
from sink.config import HIDDEN_ORDERING_PREFIX, SinkConfig
from sink.errors import (
    CommitConflictError,
    ContractMismatchError,
    PartitionLoadError,
    SchemaError,
    WriterIdReusedError,
)
from sink.executor import (
    TaskContext,
    catch_up_after_commit,
    caught_up_kept_open,
    kept_open_dir,
    stats_table,
    tag_batches,
    tag_locally,
    wait_caught_up,
)
from sink.history import HISTORY_COLUMNS, RUN_EVENTS, HistoryColumns, history_fields
from sink.history_writes import HistoryBatch, history_writes
from sink.index import changelog
from sink.index.loader import TOMBSTONE_BATCH, TOMBSTONE_DELETED_AT, TOMBSTONE_WRITER, has_change_data_feed
from sink.index.registry import close_kept_open
from sink.lakehouse import file_cache, open_tables
from sink.lakehouse.contract import Contract
from sink.lakehouse.delta_rs import (
    COMMIT_KINDS,
    PARTIAL_COLUMN,
    WRITE_COLUMN,
    CommitFailedError,
    DeltaTarget,
    append_once,
    rows_in,
)
from sink.lakehouse.log import NUM_SHARDS_PROPERTY, READ_VERSION_PROPERTY, SHARDS_PROPERTY
from sink.lakehouse.rewrite import stored_files
from sink.lakehouse.schema import added_columns, check_history_columns, pending, with_added
from sink.moves import keep_stored_values, placed
from sink.outcomes import OUTCOMES, QUARANTINED, record_partitions
from sink.placement import unplaced_deletes
from sink.prepare import prepare, sql_string, tagged_schema, validate_stream, with_hidden_ordering
from sink.release import release_executor_replicas
from sink.report import BatchReport
from sink.tagging import DELETE, INSERT, UPDATE
from sink.tombstones import latest_per_key
from sink.writing import FILE_OP, INSERT_SPLIT, WriteContext, Written, read_written, write_batches

log = logging.getLogger(__name__)

# A lost executor's tasks that Spark would not re-run alone: the job runs again, this many times.
JOB_RERUNS = 2
_ABORTED_RERUN = "Spark cannot rollback"

# The collect reads Spark's Arrow stream through a Python socket, taking the GIL for every
# chunk, while the replicas catch up in a thread beside it; at CPython's default switch
# interval (5 ms) each read waits that long behind the catch-up. Measured on a 100k-record
# batch beside a busy thread: 0.13 s alone, 0.24 s at 5 ms, 0.16 s at 0.5 ms.
COLLECT_SWITCH_INTERVAL_S = 0.0005

QUARANTINE_REASON = "_quarantine_reason"
QUARANTINE_BATCH = "_quarantine_batch_id"

@dataclass(frozen=True)
class TaggedBatch:
    """A batch's tagging job, read back on the driver."""

    # The records, tagged; when Spark tasks wrote the files, only the quarantined ones and the
    # delete records (the writes stayed on the executors).
    records: pa.Table
    partitions: pa.Array  # the partition ids the batch's records name
    shards: list[int]  # shards with records
    written: Written | None  # what the writing tasks wrote, when they did


class UpsertSink:
    """`writeStream.foreachBatch(UpsertSink(cfg))`: exactly-once upserts into a Delta table."""

    def __init__(self, config: SinkConfig, clock: Callable[[], float] = time.time):
        """`clock` gives the time used for partition access times and TTLs (tests inject one)."""
        self._stream_config = config  # as written: what the stream is checked against
        self.config = config.as_stored()
        self._clock = clock
        self.writer_id = config.resolved_writer_id
        self.reports: list[BatchReport] = []
        self._target = DeltaTarget(config.table_uri, config.partition_by, config.commit_mode)
        self._contract = Contract.of(self.config)  # where the table keeps the ordering
        self._validated = None
        self._on_driver: bool | None = None  # where tagging runs, resolved at the first batch
        self._kept_open_dir: Path | None = None  # this table's replicas kept open by driver tagging
        # Executor tagging: the session and a batch's task context, to release the executors'
        # replicas when the stream ends (`close`).
        self._executors: tuple[SparkSession, TaskContext] | None = None
        self._changelog_uri: str | None = None
        self._changelog_swept: int | None = None  # version at the last retention sweep
        self._instance = uuid.uuid4().hex  # tables kept open for this object (sink.lakehouse.open_tables)
        file_cache.WRITTEN.resize(config.file_cache_bytes)
        metrics.serve(config.metrics_port)
        metrics.start(self.writer_id, OUTCOMES)

    def close(self) -> None:
        """Close the replicas this sink's tagging keeps open between batches (the next batch
        reopens them): the driver's, or with executor tagging the executors' Python workers'
        (a Spark job asks them to checkpoint and let go). Call it once the query has ended,
        before Spark stops: replicas of workers killed by the stop are rebuilt next run."""
        if self._kept_open_dir is not None:
            wait_caught_up(self._kept_open_dir)
            close_kept_open(under=self._kept_open_dir)
        if self._executors is not None:
            release_executor_replicas(*self._executors)
            self._executors = None
        open_tables.forget(self._instance)

    def _num_shards(self, batch_df: DataFrame) -> int:
        return self.config.num_shards or batch_df.sparkSession.sparkContext.defaultParallelism

    def validate(self, df: DataFrame) -> None:
        """Check the stream against the config and, when the table exists, against the
        table's schema; the job calls it before starting the query."""
        if self._validated != df.schema:
            validate_stream(self._stream_config, df)
            if self._target.exists():
                self._added_columns(with_hidden_ordering(df, self._stream_config))
            self._validated = df.schema

    def _added_columns(self, df: DataFrame) -> list[pa.Field]:
        """The stream's columns the table lacks (added in the batch's commit); SchemaError for
        a dropped column or a type whose values a cast would change."""
        cfg = self.config
        roles = {**dict.fromkeys(cfg.key, "key"), **dict.fromkeys(cfg.partition_by, "partition_by"),
                 **dict.fromkeys(cfg.ordering_columns, "ordering")}
        table = self._target.arrow_schema()
        hidden = {c: HIDDEN_ORDERING_PREFIX + c for c in cfg.ordering_columns}
        hidden = {c: h for c, h in hidden.items() if h in table.names}
        if hidden:
            raise ContractMismatchError(
                f"{cfg.table_uri} keeps the ordering column(s) {list(hidden)} as {list(hidden.values())}: "
                "except_columns named them when the table was written; name them in except_columns again")
        check_history_columns(cfg.table_uri, table, self._history_fields(df, table) if cfg.scd_type == 2 else [])
        stored = [c for c in cfg.except_columns if c in table.names]
        if stored:
            raise SchemaError(f"except_columns {stored} are columns {cfg.table_uri} stores: the sink never leaves a "
                              "stored column empty; remove them from except_columns, or from the table first")
        # The history columns are the sink's: their type follows the contract, checked apart.
        stream, table = (pa.schema([f for f in s if f.name not in HISTORY_COLUMNS])
                         for s in (self._stored_schema(df, table.names), table))
        added = added_columns(stream, table, roles, cfg.schema_evolution)
        if cfg.scd_type == 2 and added:
            # A new untracked column (any, with ignore_null_updates) joins the run events too:
            # __RUN_EVENTS gains it as a field, null for the events stored before.
            values = pa.schema([*table, *added])
            run_events = next(f for f in history_fields(values, self._history_columns(values)) if f.name == RUN_EVENTS)
            added += pending([run_events], self._target.arrow_schema())
        return added

    def _history_fields(self, df: DataFrame, table: pa.Schema) -> list[pa.Field]:
        """scd_type = 2: the history columns this config gives `table`, from the stream's
        columns the table has (a new one is checked as an added column)."""
        stored = pa.schema([f for f in self._stored_schema(df, table.names)
                            if f.name in table.names and f.name not in HISTORY_COLUMNS])
        return history_fields(stored, self._history_columns(stored))

    def _stored_schema(self, df: DataFrame, table_columns: list[str] = ()) -> pa.Schema:
        """The stream's columns the table stores: all but `except_columns` and the corrupt-record
        column (kept where `table_columns` already has it: a table created before the sink knew it)."""
        schema = to_arrow_schema(df.schema, timezone="UTC")
        unstored = set(self.config.unstored_columns) - ({self.config.corrupt_record_column} & set(table_columns))
        stored = pa.schema([f for f in schema if f.name not in unstored])
        if self.config.scd_type != 2:
            return stored
        return pa.schema([*stored, *history_fields(stored, self._history_columns(stored))])

    def _history_columns(self, schema: pa.Schema) -> HistoryColumns:
        """scd_type = 2: the history's columns in a table of `schema`. A key's history is per
        partition in partitioned scope; in global scope the partition columns are values."""
        cfg = self.config
        fixed = {*cfg.identity_columns, *cfg.ordering_columns, *HISTORY_COLUMNS}
        values = [f.name for f in schema if f.name not in fixed]
        return HistoryColumns(key=tuple(cfg.identity_columns), ordering=tuple(cfg.ordering_columns),
                              delete=C.DELETE, values=tuple(values),
                              tracked=tuple(cfg.tracked_columns([*values, *cfg.ordering_columns])),
                              fill_nulls=cfg.ignore_null_updates)

    def __call__(self, batch_df: DataFrame, batch_id: int) -> None:
        started = time.perf_counter()
        cfg = self.config
        report = BatchReport(batch_id)
        # The first batch of a new replica loads its hot window: say so before the wait.
        log.info("batch %s started%s", batch_id, "" if self.reports else
                 " (the first batch of this process: replicas are opened, bootstrapped if new)")
        with report.timed("checks"):
            self._resolve_tag_on(batch_df)
            self.validate(batch_df)
            batch_df = with_hidden_ordering(batch_df, self._stream_config)
            self._target.open_or_create(self._stored_schema(batch_df), self._contract)
            self._target.refresh()
            self._check_contract()
            added = self._added_columns(batch_df)
            committed = self._target.transaction_version(self.writer_id)
        if added:
            log.warning("batch %s adds column(s) %s to %s (schema_evolution = 'add_columns')", batch_id,
                        [f.name for f in added], cfg.table_uri)
        if committed is not None and batch_id < committed:
            raise WriterIdReusedError(
                f"batch {batch_id} is older than batch {committed}, already committed to "
                f"{cfg.table_uri} by writer_id {self.writer_id!r}: the checkpoint is new or was "
                "reset. A new checkpoint location needs a new writer_id."
            )
        if committed is not None and batch_id == committed:
            # Replay after a crash between the Delta commit and Spark's checkpoint.
            with report.timed("tombstones"):
                self._write_tombstones(batch_df, batch_id)
            report.mode = "skipped"
            report.table_version = self._target.version()
        else:
            num_shards = self._num_shards(batch_df)
            with report.timed("prepare"):
                prepared = prepare(batch_df, cfg, num_shards, with_key=not self._on_driver)
            self._process(prepared, batch_df, batch_id, num_shards, added, report)
        report.total_seconds = time.perf_counter() - started
        with report.timed("metrics"):
            metrics.publish(self.writer_id, report)
        metrics.observe_phase(self.writer_id, "metrics", report.phases["metrics"])
        self.reports.append(report)
        log.info("upsert batch %s", report.summary())

    def _resolve_tag_on(self, batch_df: DataFrame) -> None:
        if self._on_driver is not None:
            return
        self._on_driver = self.config.tags_on_driver(batch_df.sparkSession.sparkContext.master)
        # Other executors may tag a shard's next batch: they catch up from the changelog.
        self._changelog_uri = None if self._on_driver else self.config.resolved_changelog_uri
        log.info("tagging on the %s (tag_on = %r)", "driver" if self._on_driver else "executors", self.config.tag_on)

    def _check_contract(self) -> None:
        """Refuse a table written under another key, partitioning, ordering or scope; record
        the contract on a table that has none yet (created before sinks recorded it, or by
        another tool)."""
        cfg = self.config
        partitioned_by = self._target.partition_columns()
        if partitioned_by != list(cfg.partition_by):
            raise SchemaError(f"{cfg.table_uri} is partitioned by {partitioned_by}, the config's partition_by is "
                              f"{list(cfg.partition_by)}: they must be the same")
        recorded = self._target.contract()
        if recorded is None:
            self._target.record_contract(self._contract)
        elif recorded != self._contract:
            raise ContractMismatchError(
                f"{cfg.table_uri} records another sink contract than the config (table vs config): "
                f"{'; '.join(recorded.differences(self._contract))}. Restore the config, or change the contract "
                "deliberately with `python -m sink contract --config <file> --rewrite`, which checks the table's "
                "rows against the new one and rebuilds the index."
            )

    def _process(self, prepared: DataFrame, batch_df: DataFrame, batch_id: int, num_shards: int,
                 added: list[pa.Field], report: BatchReport) -> None:
        """One Spark job per tagging: route, tag (bad records pass through as quarantined),
        collect; then quarantine, tombstones and the commit from the collected output.

        The commit lands on exactly the version it was checked against (delta-rs retries
        nothing). When another commit got there first: if it changed none of the batch's
        partitions, the tags still hold and the batch commits on top of it; otherwise the
        batch is tagged again against the new version. Bounded by max_commit_retries."""
        cfg = self.config
        out_schema = tagged_schema(batch_df.schema, len(cfg.ordering_columns))
        arrow_out = to_arrow_schema(out_schema, timezone="UTC")
        ctx = None
        now = self._clock()  # one time per batch, whatever the attempt: it stamps the batch's deletes
        with report.timed("prepare"):
            files = file_order(batch_files(batch_df))
        others: dict[str, None] = {}  # who committed in between, in order of appearance
        for attempt in range(cfg.max_commit_retries + 1):
            if ctx is None:  # the table was refreshed by the checks, or after the conflict
                with report.timed("prepare"):
                    ctx = self._task_context(batch_df, batch_id, num_shards, arrow_out, files, now)
                    if self._on_driver:
                        self._kept_open_dir = kept_open_dir(ctx)
                    else:
                        self._executors = (batch_df.sparkSession, ctx)
                tombstones = (batch_id, now) if attempt == 0 and cfg.delete_when else None
                tagged, tombstoned = self._tag(prepared, ctx, out_schema, added, report, tombstones)
                with report.timed("split"):
                    batch = self._read_tags(tagged, report)
                    self._log_keys_in_other_partition(report)
                if attempt == 0:
                    records = batch.records
                    with report.timed("quarantine"):
                        hidden = set(self._stream_config.hidden_ordering.values())
                        self._quarantine(records, [c for c in batch_df.columns if c not in hidden], batch_id)
                    self._log_without_partition(report)
                    if cfg.delete_when and not tombstoned:
                        with report.timed("tombstones"):
                            self._append_tombstones(records.filter(pc.and_(
                                records.column(C.DELETE), pc.not_equal(records.column(C.OP), QUARANTINED))),
                                batch_id, now)
            snapshot = self._target.version()
            try:
                with report.timed("commit"):
                    if cfg.scd_type == 2 and batch.written is None:
                        self._commit_history(batch.records, ctx, batch.shards, added, report)
                    elif batch.written is None:
                        self._commit(batch.records, ctx, batch.shards, added, report)
                    else:
                        self._commit_written(batch.written, ctx, batch.shards, added, report)
                if self._changelog_uri and report.mode in COMMIT_KINDS:
                    with report.timed("changelog"):
                        self._sweep_changelog(ctx.table_version)
                break
            except CommitFailedError as e:
                self._target.refresh()
                landed = self._target.commits_since(snapshot)
                others.update(dict.fromkeys(c.author() for c in landed))
                if attempt == cfg.max_commit_retries:
                    raise CommitConflictError(
                        f"batch {batch_id}: other writers kept committing to {cfg.table_uri} "
                        f"({', '.join(others) or 'unknown'}); gave up after {attempt + 1} attempts, nothing of "
                        f"this batch was written to the table. Raise max_commit_retries, or give each writer "
                        f"its own table ({e})"
                    ) from e
                report.retries += 1
                if _touches(landed, batch.partitions, cfg.scope):
                    ctx = None
                    log.warning("batch %s: %s committed to the batch's partitions first; tagging again "
                                "(attempt %s)", batch_id, ", ".join(c.author() for c in landed), attempt + 2)
                else:
                    log.info("batch %s: %s committed first, to other partitions; committing on version %s",
                             batch_id, ", ".join(c.author() for c in landed), self._target.version())
        report.records_in = sum(report.ops.values())
        if self._on_driver and report.mode in COMMIT_KINDS:
            # The replicas promote this batch's entries while Spark records it and plans the
            # next: measured, the next collect took 0.025 s less without that catch-up beside it.
            catch_up_after_commit(dataclasses.replace(ctx, table_version=report.table_version))

    def _task_context(self, batch_df: DataFrame, batch_id: int, num_shards: int, arrow_out: pa.Schema,
                      files: tuple[int, ...], now: float) -> TaskContext:
        cfg = self.config
        return TaskContext(
            table_uri=cfg.table_uri,
            tombstone_uri=cfg.resolved_tombstone_uri,
            table_id=self._target.table_id(),
            table_version=self._target.version(),
            writer_id=self.writer_id,
            batch_id=batch_id,
            key_cols=tuple(cfg.key),
            partition_cols=tuple(cfg.partition_by),
            ordering=tuple(cfg.ordering_columns),
            num_shards=num_shards,
            incoming_wins_ties=cfg.incoming_wins_ties,
            output_schema=arrow_out,
            now=now,
            index_dir=cfg.index_dir,
            driver_local_dir=batch_df.sparkSession.conf.get("spark.local.dir", None),
            bootstrap_days=cfg.bootstrap_days,
            partition_date=(tuple(cfg.partition_date) if isinstance(cfg.partition_date, list)
                            else cfg.partition_date),
            partition_date_format=cfg.partition_date_format,
            tiering_column=cfg.tiering_column,
            partition_ttl_hours=cfg.partition_ttl_hours,
            index_max_bytes=cfg.index_max_bytes,
            hot_cache_entries=cfg.hot_cache_entries,
            resident_keys=cfg.resident_keys,
            block_cache_bytes=cfg.index_block_cache_bytes,
            change_data_feed=has_change_data_feed(self._target.table),
            keep_open=self._on_driver,
            changelog_uri=self._changelog_uri,
            file_order=files,
            scope=cfg.scope,
            cross_partition_check=cfg.cross_partition_check,
            peek_max_keys=cfg.peek_max_keys,
            # A history table fills nulls in sequence order when it rebuilds (sink.history).
            ignore_null_updates=cfg.ignore_null_updates and cfg.scd_type == 1,
            tombstone_ttl_seconds=cfg.tombstone_ttl_seconds,
            deletes=cfg.delete_when is not None,
            # Executors write the batch's files where the table allows (else the driver commits
            # from the records: a MERGE, or a global-scope history table's rebuild, whose keys'
            # versions span partitions).
            write_files=(not self._on_driver and self._target.update_mode() == "rewrite"
                         and (cfg.scd_type == 1 or cfg.scope == "partitioned")),
            history=cfg.scd_type == 2,
            sink_instance=self._instance,
        )

    def _quarantine(self, records: pa.Table, columns: list[str], batch_id: int) -> None:
        bad = records.filter(pc.equal(records.column(C.OP), QUARANTINED))
        rows = bad.select(columns).append_column(QUARANTINE_REASON, bad.column(C.REASON)).append_column(
            QUARANTINE_BATCH, pa.array([batch_id] * bad.num_rows, pa.int64()))
        append_once(self.config.resolved_quarantine_uri, rows, [], self.writer_id, batch_id)

    def _tag(self, prepared: DataFrame, ctx: TaskContext, out_schema, added: list[pa.Field], report: BatchReport,
             tombstones: tuple[int, float] | None = None) -> tuple[pa.Table, bool]:
        """The tagging job's output: tagged records and stats rows; with `ctx.write_files`, the
        writing tasks' file rows in place of the writes. `tombstones` (batch id, time): the
        batch's tombstones are due; with driver tagging they are written beside the tagging when
        no delete needs the index to place it. Returns the output and whether they were."""
        if self._on_driver:
            # The replicas catch up while Spark runs the batch's job (this thread only waits for
            # its output); the tombstone table's write runs while this thread tags.
            with ThreadPoolExecutor(max_workers=2) as pool:
                with report.timed("collect"), switch_interval(COLLECT_SWITCH_INTERVAL_S):
                    ahead = pool.submit(caught_up_kept_open, ctx)
                    records = prepared.toArrow()
                    records = records.append_column(C.KEY, keys.encode_keys(records, self.config.key))
                deletes = None if tombstones is None else deletes_before_tagging(records, self.config)
                written = (pool.submit(self._append_tombstones, deletes, *tombstones)
                           if deletes is not None and deletes.num_rows else None)
                with report.timed("tag"):
                    caught_up = ahead.result()
                    tagged = tag_locally(ctx, records, os.cpu_count() or 1)
                    if written is not None:
                        written.result()
            return pa.concat_tables([tagged, *(stats_table(ctx, s) for s in caught_up)]), deletes is not None
        snapshot = None
        try:
            with report.timed("tag"):
                job = prepared.repartition(ctx.num_shards, F.expr(keys.spark_route_expr(ctx.num_shards))).mapInArrow(
                    partial(tag_batches, ctx), out_schema)
                if ctx.write_files:
                    snapshot = prepared.sparkSession.sparkContext.broadcast(
                        stored_files(self._target.table, self.config.partition_by))
                    job = self._writing(job, ctx, out_schema, added, snapshot)
                return self._run(job, ctx, report), False
        except Exception as e:
            # A task that failed its partition loads fails the batch; the message names them.
            if PartitionLoadError.__name__ not in str(e):
                raise
            metrics.LOAD_FAILURES.labels(self.writer_id).inc()
            detail = next((line for line in str(e).splitlines() if PartitionLoadError.__name__ in line), "")
            raise PartitionLoadError(f"batch {ctx.batch_id}: {detail.strip()}") from e
        finally:
            if snapshot is not None:
                snapshot.unpersist()

    def _run(self, job: DataFrame, ctx: TaskContext, report: BatchReport) -> pa.Table:
        """The job's output. A lost executor normally costs its tasks, which Spark runs again;
        when Spark will not (it aborts the job as it cannot roll back the job's last stage: seen
        when an executor dies inside a writing task after other writing tasks finished), the job
        runs again, up to JOB_RERUNS times. Tagging tasks run again tag the same (staged entries
        of their batch are cleared first); files of the aborted job are never committed."""
        for rerun in range(JOB_RERUNS + 1):
            try:
                return job.toArrow()
            except Exception as e:
                if rerun == JOB_RERUNS or not _spark_aborted_a_rerun(e):
                    raise
                report.jobs_rerun += 1
                log.warning("batch %s: Spark aborted the tagging job after losing an executor (%s); running it "
                            "again", ctx.batch_id, _spark_aborted_a_rerun(e))

    def _writing(self, tagging: DataFrame, ctx: TaskContext, out_schema, added: list[pa.Field],
                 snapshot) -> DataFrame:
        """The writing tasks after the tagging ones: each partition's writes in one task, which
        rewrites its files (`snapshot`: the broadcast files of the version tagged against)."""
        cfg = self.config
        schema = with_added(self._target.arrow_schema(), added)
        wctx = WriteContext(
            table_uri=cfg.table_uri, schema=schema,
            key_cols=tuple(cfg.key), ordering=tuple(cfg.ordering_columns), partition_by=tuple(cfg.partition_by),
            incoming_wins_ties=cfg.incoming_wins_ties, partial=cfg.ignore_null_updates,
            output_schema=ctx.output_schema, files=snapshot, table_version=ctx.table_version,
            history=self._history_batch(schema, ctx) if cfg.scd_type == 2 else None,
        )
        route = keys.spark_write_route_expr(cfg.partition_by, f"{C.WRITE} = {sql_string(INSERT)}", ctx.num_shards,
                                            INSERT_SPLIT)
        return tagging.repartition(ctx.num_shards, F.expr(route)).mapInArrow(partial(write_batches, wctx),
                                                                             out_schema)

    def _read_tags(self, tagged: pa.Table, report: BatchReport) -> TaggedBatch:
        """Split the job's output into records, stats and written files; fill the report's
        counts (the tasks counted their records: the records may not be here)."""
        op = tagged.column(C.OP)
        is_stats, is_file = pc.equal(op, C.STATS_OP), pc.equal(op, FILE_OP)
        stats_rows = [json.loads(s) for s in tagged.filter(is_stats).column(C.STATS).to_pylist()]
        files = tagged.filter(is_file).column(C.STATS).to_pylist()
        records = tagged.filter(pc.invert(pc.or_(is_stats, is_file)))
        report.add_task_stats(stats_rows)
        example = next((s["several_partitions_example"] for s in stats_rows if s.get("several_partitions_example")),
                       None)
        if report.keys_in_several_partitions:
            log.warning("batch %s: %s key(s) have records in several partitions, each kept as its own row "
                        "(scope = 'partitioned'), e.g. key %r in %s; if a key should live in one partition "
                        "only, that needs scope = 'global'", report.batch_id, report.keys_in_several_partitions,
                        *example)
        shards = sorted({int(s) for st in stats_rows for s in st["shard_ids"]})
        partitions = pa.array(sorted({p for st in stats_rows for p in st.get("pids", ())}), pa.string())
        return TaggedBatch(records, partitions, shards, read_written(files) if files else None)

    def _log_without_partition(self, report: BatchReport) -> None:
        """One warning per batch for records quarantined for want of a partition value."""
        counts = report.without_partition
        if self.config.scope == "partitioned" and counts["ambiguous"] + counts["upsert"]:
            log.warning("batch %s: %s record(s) with a null partition column (%s) went to quarantine: %s upsert(s), "
                        "which need their partition, and %s delete(s) whose key has rows in several partitions; "
                        "%s other delete(s) were located by the index. If a key lives in one partition only, "
                        "scope = 'global' locates every record by its key", report.batch_id,
                        counts["ambiguous"] + counts["upsert"], ", ".join(self.config.partition_by),
                        counts["upsert"], counts["ambiguous"], counts["located"] + counts["unknown"])

    def _log_keys_in_other_partition(self, report: BatchReport) -> None:
        if report.keys_in_other_partition:
            key, own, stored = report.other_partition_example
            log.warning("batch %s: %s of %s new key(s) checked are already stored in another partition and "
                        "get a second row (scope = 'partitioned'), e.g. key %r arriving in %s, stored in %s; "
                        "if a key should live in one partition only, that needs scope = 'global'",
                        report.batch_id, report.keys_in_other_partition, report.keys_checked_in_other_partitions,
                        key, own, stored)

    def _commit(self, records: pa.Table, ctx: TaskContext, shards: list[int], added: list[pa.Field],
                report: BatchReport) -> None:
        """Commit the batch's writes from its records here."""
        cfg = self.config
        written = pc.is_valid(records.column(C.WRITE))
        writes = records.filter(written)
        if cfg.scope == "global":
            own = record_partitions(writes, cfg.partition_by, cfg.scope)
            writes = placed(writes, own, cfg.partition_by)
            if cfg.ignore_null_updates:
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
        outcome = self._target.commit(
            rows,
            key_cols=self.config.key,
            ordering=self.config.ordering_columns,
            app_id=self.writer_id,
            batch_id=ctx.batch_id,
            custom_metadata=self._commit_metadata(ctx, shards),
            incoming_wins_ties=self.config.incoming_wins_ties,
            added_columns=added,
        )
        report.record(outcome)

    def _commit_history(self, records: pa.Table, ctx: TaskContext, shards: list[int], added: list[pa.Field],
                        report: BatchReport) -> None:
        """scd_type = 2: every valid record is an event of its key's history; keys the index
        holds are rebuilt with what the table keeps of them (a column added since reads as
        nulls), new keys from the batch alone."""
        present = self._target.arrow_schema()
        added = pending(added, present)
        batch = self._history_batch(with_added(present, added), ctx)
        writes, counts = history_writes(records.filter(pc.is_null(records.column(C.REASON))), batch,
                                        lambda: self._target.table)
        outcome, done = self._target.commit_history(writes, self.writer_id, ctx.batch_id,
                                                    self._commit_metadata(ctx, shards), added)
        report.record(outcome)
        report.record_history(counts, done.versions_written, done.versions_replaced, done.changes)

    def _history_batch(self, schema: pa.Schema, ctx: TaskContext) -> HistoryBatch:
        cfg = self.config
        return HistoryBatch(schema, self._history_columns(schema), tuple(cfg.key), tuple(cfg.partition_by), cfg.scope,
                            cfg.resolved_tombstone_uri, cfg.tombstone_ttl_seconds, ctx.now)

    def _commit_written(self, written: Written, ctx: TaskContext, shards: list[int], added: list[pa.Field],
                        report: BatchReport) -> None:
        """Commit the files the writing tasks wrote."""
        if written.history is not None:  # a history table's tasks counted its events
            h = written.history
            report.record_history(h["ops"], h["versions_written"], h["versions_replaced"], h["changes"])
        if not any(report.ops[o] for o in (INSERT, UPDATE, DELETE, "delete_missing")):
            report.mode = "none"
            report.table_version = self._target.version()
            return
        report.write_seconds = written.seconds
        outcome = self._target.commit_written(written.rewrite, self.writer_id, ctx.batch_id,
                                              self._commit_metadata(ctx, shards), added,
                                              written.partitions_changed)
        report.record(outcome)

    def _commit_metadata(self, ctx: TaskContext, shards: list[int]) -> dict[str, str]:
        return {SHARDS_PROPERTY: ",".join(map(str, shards)), NUM_SHARDS_PROPERTY: str(ctx.num_shards),
                READ_VERSION_PROPERTY: str(ctx.table_version)}

    def _sweep_changelog(self, read_version: int) -> None:
        """The changelog's retention (the tagging tasks wrote the batch's entries): entries of
        batches that read a version `changelog_retention_versions` older go."""
        retention = self.config.changelog_retention_versions
        # One listing per tenth of the window (and at the first batch) keeps the folder bounded.
        if self._changelog_swept is not None and read_version - self._changelog_swept < max(1, retention // 10):
            return
        try:
            changelog.expire(self._changelog_uri, read_version - retention)
            self._changelog_swept = read_version
        except OSError as e:
            log.warning("index changelog %s not swept (%s); the next batches try again", self._changelog_uri, e)

    def _write_tombstones(self, batch_df: DataFrame, batch_id: int) -> None:
        """On a replayed batch whose main commit is done: make sure its tombstones are too."""
        cfg = self.config
        if not cfg.delete_when:
            return
        deletes = prepare(batch_df, cfg, self._num_shards(batch_df)).filter(F.col(C.REASON).isNull() & F.col(C.DELETE))
        columns = C.distinct(cfg.key, cfg.partition_by, cfg.ordering_columns)
        self._append_tombstones(deletes.select(*columns).toArrow(), batch_id, self._clock())

    def _append_tombstones(self, deletes: pa.Table, batch_id: int, now: float) -> None:
        """The batch's valid deletes, so a reloaded partition remembers them: per key (per
        partition and key in partitioned scope) the one with the highest ordering value,
        which is all a load needs.

        A pure function of the batch's input, written before the main commit (and again on
        a replay that finds the main commit done), idempotent by app transaction. Rows name
        the writer and batch: a partition load counts them once the table holds the batch,
        so another writer reloading a partition never misses a delete that landed, and say
        when the batch ran (`now`, the stamp its index entries carry: tombstone_ttl_hours).
        """
        cfg = self.config
        deletes = latest_per_key(deletes.select(C.distinct(cfg.key, cfg.partition_by, cfg.ordering_columns)),
                                 cfg.tombstone_key, cfg.ordering_columns)
        n = deletes.num_rows
        rows = deletes.append_column(
            TOMBSTONE_WRITER, pa.array([self.writer_id] * n, pa.string())).append_column(
            TOMBSTONE_BATCH, pa.array([batch_id] * n, pa.int64())).append_column(
            TOMBSTONE_DELETED_AT, pa.array([int(now) * 1_000_000] * n, pa.timestamp("us", tz="UTC")))
        append_once(cfg.resolved_tombstone_uri, rows, cfg.partition_by, self.writer_id, batch_id,
                    schema_mode="merge", owner=f"{self._instance}/appends")


@contextmanager
def switch_interval(seconds: float) -> Iterator[None]:
    """CPython's thread switch interval set to `seconds` inside the block (it is per process)."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(seconds)
    try:
        yield
    finally:
        sys.setswitchinterval(before)


def deletes_before_tagging(records: pa.Table, cfg: SinkConfig) -> pa.Table | None:
    """The valid delete records of a collected batch, as its tombstones take them, when tagging
    cannot change them: None when a delete names no partition in partitioned scope (the index
    places it, sink.placement)."""
    deletes = records.filter(pc.and_(records.column(C.DELETE), pc.is_null(records.column(C.REASON))))
    if cfg.scope == "partitioned" and unplaced_deletes(deletes, cfg.partition_by, deletes.column(C.DELETE)).any():
        return None
    return deletes


def _spark_aborted_a_rerun(error: Exception) -> str | None:
    """Spark's reason when it aborted a job rather than re-run lost tasks (None: another failure)."""
    return next((line.strip() for line in str(error).splitlines() if _ABORTED_RERUN in line), None)


def _touches(commits, batch_partitions: pa.Array, scope: str) -> bool:
    """Whether any of these commits changed data in a partition the batch holds records of
    (in global scope, any data at all: a key may live in any partition)."""
    if scope == "global":
        return any(c.partitions is None or c.partitions for c in commits)
    ours = set(pc.unique(batch_partitions).to_pylist())
    return any(c.partitions is None or c.partitions & ours for c in commits)
