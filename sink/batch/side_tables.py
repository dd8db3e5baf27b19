"""The tables beside the target that a batch writes: quarantine (bad records, with their
reason), tombstones (the batch's deletes, so a reloaded partition remembers them), and the
retention of the index changelog. Each write is idempotent by the batch's app transaction."""

from __future__ import annotations

import logging

import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql import functions as F

from sink import columns as C
from sink.batch.state import BatchState
from sink.config import SinkConfig
from sink.index import changelog
from sink.index.loader import TOMBSTONE_BATCH, TOMBSTONE_DELETED_AT, TOMBSTONE_WRITER
from sink.lakehouse.engines.delta_rs import append_once
from sink.ops.report import BatchReport
from sink.ops.tombstones import latest_per_key
from sink.routing import prepare
from sink.tagging.outcomes import QUARANTINED

log = logging.getLogger(__name__)

QUARANTINE_REASON = "_quarantine_reason"
QUARANTINE_BATCH = "_quarantine_batch_id"


class SideTables:
    """`config`: the stored config (ordering columns under their hidden names); `stream_columns`
    gives a batch's columns as the stream has them (the quarantine keeps those)."""

    def __init__(self, config: SinkConfig, stream_config: SinkConfig, writer_id: str, instance: str):
        self._config = config
        self._hidden = set(stream_config.hidden_ordering.values())
        self._writer_id = writer_id
        self._instance = instance
        self._changelog_swept: int | None = None  # version at the last retention sweep

    def run(self, state: BatchState) -> None:
        """After a batch's first tagging: its quarantined records, and its tombstones unless
        they were written beside the tagging."""
        records, report = state.tagged.records, state.report
        with report.timed("quarantine"):
            self.quarantine(records, [c for c in state.batch_df.columns if c not in self._hidden], state.batch_id)
        self._log_without_partition(report)
        if self._config.delete_when and not state.tombstoned:
            with report.timed("tombstones"):
                self.append_tombstones(records.filter(pc.and_(
                    records.column(C.DELETE), pc.not_equal(records.column(C.OP), QUARANTINED))),
                    state.batch_id, state.now)

    def replayed(self, state: BatchState) -> None:
        """A replayed batch whose main commit is done: make sure its tombstones are too."""
        cfg = self._config
        if not cfg.delete_when:
            return
        with state.report.timed("tombstones"):
            deletes = prepare(state.batch_df, cfg, state.num_shards).filter(F.col(C.REASON).isNull() & F.col(C.DELETE))
            self.append_tombstones(deletes.select(*cfg.table.tombstone_columns).toArrow(), state.batch_id, state.now)

    def quarantine(self, records: pa.Table, columns: list[str], batch_id: int) -> None:
        bad = records.filter(pc.equal(records.column(C.OP), QUARANTINED))
        rows = bad.select(columns).append_column(QUARANTINE_REASON, bad.column(C.REASON)).append_column(
            QUARANTINE_BATCH, pa.array([batch_id] * bad.num_rows, pa.int64()))
        append_once(self._config.resolved_quarantine_uri, rows, [], self._writer_id, batch_id)

    def append_tombstones(self, deletes: pa.Table, batch_id: int, now: float) -> None:
        """The batch's valid deletes, so a reloaded partition remembers them: per key (per
        partition and key in partitioned scope) the one with the highest ordering value,
        which is all a load needs.

        A pure function of the batch's input, written before the main commit (and again on
        a replay that finds the main commit done), idempotent by app transaction. Rows name
        the writer and batch: a partition load counts them once the table holds the batch,
        so another writer reloading a partition never misses a delete that landed, and say
        when the batch ran (`now`, the stamp its index entries carry: tombstone_ttl_hours).
        """
        cfg = self._config
        deletes = latest_per_key(deletes.select(cfg.table.tombstone_columns), cfg.tombstone_key, cfg.ordering_columns)
        n = deletes.num_rows
        rows = deletes.append_column(
            TOMBSTONE_WRITER, pa.array([self._writer_id] * n, pa.string())).append_column(
            TOMBSTONE_BATCH, pa.array([batch_id] * n, pa.int64())).append_column(
            TOMBSTONE_DELETED_AT, pa.array([int(now) * 1_000_000] * n, pa.timestamp("us", tz="UTC")))
        append_once(cfg.resolved_tombstone_uri, rows, cfg.partition_by, self._writer_id, batch_id,
                    schema_mode="merge", owner=f"{self._instance}/appends")

    def sweep_changelog(self, changelog_uri: str, read_version: int) -> None:
        """The changelog's retention (the tagging tasks wrote the batch's entries): entries of
        batches that read a version `changelog_retention_versions` older go."""
        retention = self._config.changelog_retention_versions
        # One listing per tenth of the window (and at the first batch) keeps the folder bounded.
        if self._changelog_swept is not None and read_version - self._changelog_swept < max(1, retention // 10):
            return
        try:
            changelog.expire(changelog_uri, read_version - retention)
            self._changelog_swept = read_version
        except OSError as e:
            log.warning("index changelog %s not swept (%s); the next batches try again", changelog_uri, e)

    def _log_without_partition(self, report: BatchReport) -> None:
        """One warning per batch for records quarantined for want of a partition value."""
        counts, cfg = report.without_partition, self._config
        if cfg.scope == "partitioned" and counts["ambiguous"] + counts["upsert"]:
            log.warning("batch %s: %s record(s) with a null partition column (%s) went to quarantine: %s upsert(s), "
                        "which need their partition, and %s delete(s) whose key has rows in several partitions; "
                        "%s other delete(s) were located by the index. If a key lives in one partition only, "
                        "scope = 'global' locates every record by its key", report.batch_id,
                        counts["ambiguous"] + counts["upsert"], ", ".join(cfg.partition_by),
                        counts["upsert"], counts["ambiguous"], counts["located"] + counts["unknown"])
