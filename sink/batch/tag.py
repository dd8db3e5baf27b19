"""The tag phase: the batch's task context, its tagging by the tagger the sink chose at its
first batch (sink.batch.driver_tagger, sink.batch.executor_tagger), and the tagging output
split into records, the tasks' stats and the files they wrote."""

from __future__ import annotations

import logging
from typing import Protocol

import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql.pandas.types import to_arrow_schema

from sink import columns as C
from sink.batch.other_writers import OtherWriters
from sink.batch.state import BatchState, TaggedBatch
from sink.config import SinkConfig
from sink.delta_log.features import append_only
from sink.lakehouse.engines.engine import DeltaEngine
from sink.ops.report import BatchReport
from sink.tagging.task_context import TaskContext, task_context
from sink.tagging.task_stats import TaskStats
from sink.tagging.writing import FILE_OP, read_written

log = logging.getLogger(__name__)


class Tagger(Protocol):
    on_driver: bool
    changelog_uri: str | None  # the index changelog its tasks write (None: none kept)

    def writes_files(self, target: DeltaEngine) -> bool:
        """Whether its tasks write the batch's files (into `target`, as it is now)."""

    def leaves_writes_on_executors(self, target: DeltaEngine) -> bool:
        """Whether the batch's writes stay where its tasks tagged them, as the source of
        `target`'s MERGE (`BatchState.merge_source`)."""

    def tag(self, state: BatchState, tombstones_due: bool) -> tuple[pa.Table, bool]:
        """The tagging output (records, stats rows, file rows), and whether the batch's
        tombstones were written beside it."""

    def after_commit(self, state: BatchState) -> None: ...

    def close(self) -> None:
        """Let go of the replicas it keeps open (the stream has ended)."""


class TagPhase:
    def __init__(self, config: SinkConfig, target: DeltaEngine, tagger: Tagger, writer_id: str, instance: str,
                 other_writers: OtherWriters):
        self._config = config
        self._target = target
        self.tagger = tagger
        self._writer_id = writer_id
        self._instance = instance
        self._other_writers = other_writers

    def run(self, state: BatchState) -> None:
        report = state.report
        if state.ctx is None:  # the table was refreshed by the checks, or after a conflict
            with report.timed("other_writers"):
                # Before any replica catches up to this version: what they reload must hold it.
                state.other_writers_seen = self._other_writers.follow(self._target.table)
            with report.timed("prepare"):
                state.ctx = self._context(state)
        due = state.attempt == 0 and bool(self._config.delete_when)
        output, tombstoned = self.tagger.tag(state, tombstones_due=due)
        with report.timed("split"):
            state.tagged = read_tags(output, report)
            _log_keys_in_other_partition(report)
        if state.attempt == 0:
            state.tombstoned = tombstoned

    def _context(self, state: BatchState) -> TaskContext:
        target = self._target
        return task_context(
            self._config, table_id=target.table_id(), table_version=target.version(), writer_id=self._writer_id,
            batch_id=state.batch_id, num_shards=state.num_shards,
            output_schema=to_arrow_schema(state.out_schema, timezone="UTC"), now=state.now,
            driver_local_dir=state.batch_df.sparkSession.conf.get("spark.local.dir", None),
            keep_open=self.tagger.on_driver,
            changelog_uri=self.tagger.changelog_uri, file_order=state.files,
            write_files=self.tagger.writes_files(target), merge_source=self.tagger.leaves_writes_on_executors(target),
            sink_instance=self._instance, partition_log_keys=target.partition_log_keys(),
            append_only=append_only(target.table),
        )


def read_tags(tagged: pa.Table, report: BatchReport) -> TaggedBatch:
    """Split the job's output into records, stats and written files; fill the report's
    counts (the tasks counted their records: the records may not be here)."""
    op = tagged.column(C.OP)
    is_stats, is_file = pc.equal(op, C.STATS_OP), pc.equal(op, FILE_OP)
    stats_rows = [TaskStats.from_json(s) for s in tagged.filter(is_stats).column(C.STATS).to_pylist()]
    files = tagged.filter(is_file).column(C.STATS).to_pylist()
    records = tagged.filter(pc.invert(pc.or_(is_stats, is_file)))
    report.add_task_stats(stats_rows)
    if report.keys_in_several_partitions:
        example = next(s.several_partitions_example for s in stats_rows if s.several_partitions_example)
        log.warning("batch %s: %s key(s) have records in several partitions, each kept as its own row "
                    "(scope = 'partitioned'), e.g. key %r in %s; if a key should live in one partition "
                    "only, that needs scope = 'global'", report.batch_id, report.keys_in_several_partitions,
                    *example)
    shards = sorted({int(s) for st in stats_rows for s in st.shard_ids})
    partitions = pa.array(sorted({p for st in stats_rows for p in st.pids}), pa.string())
    changed = sorted({p for st in stats_rows for p in st.changed_pids})
    return TaggedBatch(records, partitions, shards, read_written(files) if files else None, changed)


def _log_keys_in_other_partition(report: BatchReport) -> None:
    if report.keys_in_other_partition:
        key, own, stored = report.other_partition_example
        log.warning("batch %s: %s of %s new key(s) checked are already stored in another partition and "
                    "get a second row (scope = 'partitioned'), e.g. key %r arriving in %s, stored in %s; "
                    "if a key should live in one partition only, that needs scope = 'global'",
                    report.batch_id, report.keys_in_other_partition, report.keys_checked_in_other_partitions,
                    key, own, stored)
