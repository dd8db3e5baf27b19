"""Tagging in the driver process (`tag_on = "driver"`, or "auto" under a local master): the
batch is collected, and each shard's tagging runs in a thread here against the replicas this
process keeps open between batches. Between batches the replicas catch up with the commit in
the background, so a batch's tagging finds only its lookups left."""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

from sink import columns as C
from sink import keys
from sink.batch.side_tables import SideTables
from sink.batch.state import BatchState
from sink.config import SinkConfig
from sink.index.registry import close_kept_open, is_kept_open
from sink.index.spec import replica_path
from sink.lakehouse.engines import open_tables
from sink.lakehouse.engines.delta_rs import COMMIT_KINDS
from sink.library_errors import first_line
from sink.tagging import executor
from sink.tagging.placement import unplaced_deletes
from sink.tagging.task_context import TaskContext
from sink.tagging.task_stats import TaskStats

log = logging.getLogger(__name__)

# The collect reads Spark's Arrow stream through a Python socket, taking the GIL for every
# chunk, while the replicas catch up in a thread beside it; at CPython's default switch
# interval (5 ms) each read waits that long behind the catch-up. Measured on a 100k-record
# batch beside a busy thread: 0.13 s alone, 0.24 s at 5 ms, 0.16 s at 0.5 ms.
COLLECT_SWITCH_INTERVAL_S = 0.0005


class DriverTagger:
    """Collects the batch and tags it in this process."""

    on_driver = True

    def __init__(self, config: SinkConfig, side_tables: SideTables):
        self._config = config
        self._side_tables = side_tables
        # Every shard's replica lives here: no other process needs the changelog, but a
        # replica restored from a snapshot (another process's) catches up through it.
        self.changelog_uri = config.resolved_changelog_uri if config.index.replica_snapshot_every_versions else None
        self._kept_open_dir: Path | None = None

    def writes_files(self, target) -> bool:
        return False  # the driver holds the records: it commits from them

    def leaves_writes_on_executors(self, target) -> bool:
        return False

    def tag(self, state: BatchState, tombstones_due: bool) -> tuple[pa.Table, bool]:
        """The tagged records and the tasks' stats rows; whether the batch's tombstones were
        written beside the tagging (when no delete needs the index to place it). The replicas
        catch up while Spark runs the batch's job (this thread only waits for its output);
        the tombstone table's write runs while this thread tags."""
        ctx, report = state.ctx, state.report
        self._kept_open_dir = kept_open_dir(ctx)
        with ThreadPoolExecutor(max_workers=2) as pool:
            with report.timed("collect"), switch_interval(COLLECT_SWITCH_INTERVAL_S):
                ahead = pool.submit(caught_up_kept_open, ctx)
                records = state.prepared.toArrow()
                records = records.append_column(C.KEY, keys.encode_keys(records, self._config.key))
            deletes = deletes_before_tagging(records, self._config) if tombstones_due else None
            written = (pool.submit(self._side_tables.append_tombstones, deletes, state.batch_id, state.now)
                       if deletes is not None and deletes.num_rows else None)
            with report.timed("tag"):
                caught_up = ahead.result()
                tagged = tag_locally(ctx, records, os.cpu_count() or 1)
                if written is not None:
                    written.result()
        return pa.concat_tables([tagged, *(executor.stats_table(ctx, s) for s in caught_up)]), deletes is not None

    def after_commit(self, state: BatchState) -> None:
        """The replicas promote this batch's entries while Spark records it and plans the next:
        measured, the next collect took 0.025 s less without that catch-up beside it."""
        if state.report.mode in COMMIT_KINDS:
            catch_up_after_commit(dataclasses.replace(state.ctx, table_version=state.report.table_version))
            if self.changelog_uri is not None:
                with state.report.timed("changelog"):
                    self._side_tables.sweep_changelog(self.changelog_uri, state.ctx.table_version)

    def close(self) -> None:
        if self._kept_open_dir is not None:
            wait_caught_up(self._kept_open_dir)
            close_kept_open(under=self._kept_open_dir)


def deletes_before_tagging(records: pa.Table, cfg: SinkConfig) -> pa.Table | None:
    """The valid delete records of a collected batch, as its tombstones take them, when tagging
    cannot change them: None when a delete names no partition in partitioned scope (the index
    places it, sink.tagging.placement)."""
    deletes = records.filter(pc.and_(records.column(C.DELETE), pc.is_null(records.column(C.REASON))))
    if cfg.scope == "partitioned" and unplaced_deletes(deletes, cfg.partition_by, deletes.column(C.DELETE)).any():
        return None
    return deletes


@contextmanager
def switch_interval(seconds: float) -> Iterator[None]:
    """CPython's thread switch interval set to `seconds` inside the block (it is per process)."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(seconds)
    try:
        yield
    finally:
        sys.setswitchinterval(before)


def tag_locally(ctx: TaskContext, records: pa.Table, threads: int) -> pa.Table:
    """The tagging tasks run in this process instead of Spark's, one thread per shard."""
    shards = pc.unique(records.column(C.SHARD)).to_pylist() if records.num_rows else []

    def one(shard) -> pa.Table:
        rows = records.filter(pc.equal(records.column(C.SHARD), shard)) if shard is not None else records
        return pa.Table.from_batches(list(executor.tag_batches(ctx, iter(rows.to_batches()))), schema=ctx.output_schema)

    if threads <= 1 or len(shards) <= 1:
        return pa.concat_tables([one(s) for s in shards or [None]])
    with ThreadPoolExecutor(max_workers=min(threads, len(shards))) as pool:
        return pa.concat_tables(list(pool.map(one, shards)))


def catch_up_kept_open(ctx: TaskContext) -> TaskStats:
    """Tagging in this process: bring the shard replicas it keeps open to the batch's table
    version, as each shard's tagging would do first (promote the last batch's staged entries,
    apply other writers' commits). The sink runs it after each commit (`catch_up_after_commit`),
    and for what is left while it collects the next batch's records, which leaves the tagging
    only the lookups. A replica that fails here is left to its shard's tagging, which repairs
    it or reports the error. Returns what it did, as a tagging task's stats (no shard tagged)."""
    stats = TaskStats()
    for shard in range(ctx.num_shards):
        path = replica_path(ctx.index_root(), ctx.table_id, shard, ctx.num_shards)
        if not is_kept_open(path):
            continue
        try:
            # Not flushed: the shard's tagging flushes it when due (FLUSH_EVERY_S), and a flush
            # here would compete with Spark's job for the CPU.
            with (executor.use_replica(ctx, path, flush=False, shard=shard) as replica,
                  executor.LazySource(ctx, shard) as source):
                executor.prepare_replica(ctx, replica, source, shard, stats)
        except Exception as e:
            log.info("replica %s not caught up ahead of tagging (%s); its tagging catches it up",
                     path, first_line(e))
    return stats


# Driver tagging: catch-ups of the kept-open replicas to a batch's commit, started once it
# committed and run while Spark records the batch and plans the next, so that the next batch's
# collect runs without one beside it. Per table's replicas, in the order started; one thread
# for the process, so two never run on one replica (a sink restarted in the process finds
# the last one's pending and waits for it).
_BETWEEN = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sink-catch-up")
_PENDING: dict[Path, list[Future]] = {}
_PENDING_LOCK = threading.Lock()


def catch_up_after_commit(ctx: TaskContext) -> None:
    """Start bringing the replicas this process keeps open for `ctx`'s table to
    `ctx.table_version` (the batch's commit) in the background."""
    with _PENDING_LOCK:
        _PENDING.setdefault(kept_open_dir(ctx), []).append(_BETWEEN.submit(_after_commit, ctx))


def _after_commit(ctx: TaskContext) -> TaskStats:
    """`catch_up_kept_open`, then the tables kept open for the replicas' reads brought to the
    commit too: a batch's loads and reads of few keys then skip reading the log (5-8 ms)."""
    stats = catch_up_kept_open(ctx)
    open_tables.bring_forward(ctx.table.table_uri, ctx.sink_instance, ctx.table_version)
    open_tables.bring_forward(ctx.tombstone_uri, ctx.sink_instance)
    return stats


def caught_up_kept_open(ctx: TaskContext) -> list[TaskStats]:
    """The kept-open replicas of `ctx`'s table brought to its version: the catch-ups started
    after earlier commits finish first (their work counts in this batch), then the rest
    (other writers' commits since). The stats of each, as tagging tasks' stats."""
    return [*wait_caught_up(kept_open_dir(ctx)), catch_up_kept_open(ctx)]


def wait_caught_up(under: Path) -> list[TaskStats]:
    """Wait for the catch-ups started for the replicas under `under` (`kept_open_dir`); their stats."""
    with _PENDING_LOCK:
        pending = _PENDING.pop(under, [])
    return [f.result() for f in pending]


def kept_open_dir(ctx: TaskContext) -> Path:
    """Where the replicas of `ctx`'s table are (kept open by driver tagging)."""
    return Path(ctx.index_root()) / ctx.table_id
