"""UpsertSink: the driver-side orchestration of one micro-batch, as a pipeline of phases over
one `BatchState` (sink.batch): checks, prepare, tag, side tables, commit, metrics."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from pyspark.sql import DataFrame, SparkSession

from sink import freshness
from sink.batch.checks import Checks
from sink.batch.commit import CommitPhase, history_batch
from sink.batch.driver_tagger import DriverTagger
from sink.batch.executor_tagger import ExecutorTagger
from sink.batch.other_writers import OtherWriters
from sink.batch.prepare import PreparePhase, num_shards
from sink.batch.side_tables import SideTables
from sink.batch.state import BatchState
from sink.batch.tag import TagPhase
from sink.config import SinkConfig
from sink.lakehouse.commit import file_cache
from sink.lakehouse.engines import open_tables
from sink.lakehouse.engines.engine import delta_engine
from sink.ops import metrics
from sink.ops.report import BatchReport
from sink.session import SessionKind, is_connect, session_kind
from sink.tagging.outcomes import OUTCOMES
from sink.tagging.release import Replicas, release_executor_replicas

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Pipeline:
    """The phases that depend on where tagging runs, chosen at the sink's first batch."""

    session: SessionKind
    prepare: PreparePhase
    tag: TagPhase
    commit: CommitPhase


class UpsertSink:
    """`writeStream.foreachBatch(UpsertSink(cfg))`: exactly-once upserts into a Delta table."""

    def __init__(self, config: SinkConfig, clock: Callable[[], float] = time.time):
        """`clock` gives the time used for partition access times and TTLs (tests inject one)."""
        self.config = config.as_stored()  # the ordering columns except_columns names, under their hidden names
        self._clock = clock
        self.writer_id = config.resolved_writer_id
        self.reports: list[BatchReport] = []
        self._target = delta_engine(config)
        self._instance = uuid.uuid4().hex  # tables kept open for this object (sink.lakehouse.engines.open_tables)
        self._checks = Checks(self.config, config, self._target, self.writer_id)
        self._side_tables = SideTables(self.config, config, self.writer_id, self._instance)
        self._other_writers = OtherWriters(self.config, self.writer_id)
        self._pipeline: Pipeline | None = None
        file_cache.WRITTEN.resize(config.file_cache_bytes)
        file_cache.PROBED.resize(config.probe_cache_bytes)
        if not _connect_client():  # else the server's foreachBatch worker serves them (`_pipeline_for`)
            self._serve_metrics()

    def validate(self, df: DataFrame) -> None:
        """Check the stream against the config and, when the table exists, against the
        table's schema; the job calls it before starting the query."""
        self._target.attach(df.sparkSession)
        self._checks.validate(df)

    def close(self) -> None:
        """Close the replicas this sink's tagging keeps open between batches (the next batch
        reopens them): the driver's, or with executor tagging the executors' Python workers'
        (a Spark job asks them to checkpoint and let go). Call it once the query has ended,
        before Spark stops: replicas of workers killed by the stop are rebuilt next run.
        Under Spark Connect this object is the client's copy, which saw no batch (the server's
        foreachBatch worker ran one of its own, and closes its replicas as Spark ends it): it
        asks the executors when they tag."""
        if self._pipeline is not None:
            self._pipeline.tag.tagger.close()
        else:
            self._release_from_connect_client()
        open_tables.forget(self._instance)

    def _serve_metrics(self) -> None:
        metrics.serve(self.config.metrics_port)
        metrics.start(self.writer_id, OUTCOMES)

    def _release_from_connect_client(self) -> None:
        spark = _connect_client()
        if spark is None or not self._target.exists():
            return
        session = session_kind(spark)
        if not self.config.tags_on_driver(session.master()):
            replicas = Replicas(self._target.table_id(), self.config.index_dir, spark.conf.get("spark.local.dir", None))
            release_executor_replicas(session, replicas)

    def __call__(self, batch_df: DataFrame, batch_id: int) -> None:
        started = time.perf_counter()
        state = BatchState(batch_df, batch_id, BatchReport(batch_id), now=self._clock())
        # The first batch of a new replica loads its hot window: say so before the wait.
        log.info("batch %s started%s", batch_id, "" if self.reports else
                 " (the first batch of this process: replicas are opened, bootstrapped if new)")
        with state.report.timed("checks"):
            # The batch's session: Spark gives each query's batches a session of its own.
            self._target.attach(batch_df.sparkSession)
            pipeline = self._pipeline_for(batch_df)
            self._checks.run(state)
        if state.replayed:
            state.num_shards = num_shards(self.config, pipeline.session)
            self._side_tables.replayed(state)
            state.report.mode = "skipped"
            state.report.table_version = self._target.version()
        else:
            pipeline.prepare.run(state)
            pipeline.tag.run(state)
            self._side_tables.run(state)
            pipeline.commit.run(state)
            pipeline.tag.tagger.after_commit(state)
        self._publish(state.report, started)

    def _pipeline_for(self, batch_df: DataFrame) -> Pipeline:
        """The phases, chosen once: by the kind of session (classic or Spark Connect), and
        where tagging runs by the session's master."""
        if self._pipeline is None:
            cfg = self.config
            session = session_kind(batch_df.sparkSession)
            session.host_foreach_batch()
            self._serve_metrics()  # in the process that runs the batches, which publishes them
            on_driver = cfg.tags_on_driver(session.master())
            history = partial(history_batch, cfg, self._checks.history_columns)
            tagger = (DriverTagger(cfg, self._side_tables) if on_driver else
                      ExecutorTagger(cfg, self._target, self._side_tables, self.writer_id, history, session))
            tag = TagPhase(cfg, self._target, tagger, self.writer_id, self._instance, self._other_writers)
            self._pipeline = Pipeline(session, PreparePhase(cfg, session, on_driver), tag,
                                      CommitPhase(cfg, self._target, self.writer_id, tag.run, history,
                                                  self._other_writers))
            log.info("tagging on the %s (tag_on = %r, %s session)", "driver" if on_driver else "executors",
                     cfg.tag_on, session.name)
        return self._pipeline

    def _publish(self, report: BatchReport, started: float) -> None:
        report.total_seconds = time.perf_counter() - started
        if report.mode not in ("skipped", "none"):  # now: the commit's time, as near as the driver sees it
            report.freshness = freshness.freshness(report.source_times, round(time.time() * 1000))
        with report.timed("metrics"):
            metrics.publish(self.writer_id, report)
        metrics.observe_phase(self.writer_id, "metrics", report.phases["metrics"])
        self.reports.append(report)
        if report.verify_mismatches:
            log.error("batch %s: the index disagreed with the table on %s of %s key(s) checked (verify_fraction), "
                      "e.g. %s; those partitions were reloaded before the batch was tagged. The index drifted from "
                      "the table: please report it with this line", report.batch_id, report.verify_mismatches,
                      report.verified_keys, "; ".join(report.verify_examples[:3]))
        log.info("upsert batch %s", report.summary())


def _connect_client() -> SparkSession | None:
    """This process's Spark Connect session, if it is a Connect client (None: classic, or no
    session yet). A sink made here is pickled to the server, whose foreachBatch worker runs it."""
    spark = SparkSession.getActiveSession()
    return spark if spark is not None and is_connect(spark) else None
