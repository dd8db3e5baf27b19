"""The end of a stream: the replicas executors' Python workers keep open, checkpointed and
closed before Spark stops, so that the executors' stop leaves them clean."""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import pyarrow as pa

from sink.errors import ReplicaLockedError
from sink.index import holder
from sink.index.registry import close_kept_open
from sink.index.replica import ShardReplica
from sink.library_errors import first_line
from sink.session import SessionKind
from sink.tagging.task_context import TaskContext, index_root

log = logging.getLogger(__name__)

# Rounds of release tasks; each round runs twice as many tasks as the last.
RELEASE_ROUNDS = 3
RELEASED = "executor string"  # what a release task returns: the executor it ran on


@dataclass(frozen=True)
class Replicas:
    """Which replicas a release task closes: those of one table under the index root."""

    table_id: str
    index_dir: str | None  # the config's; None: under each executor's Spark local dir
    driver_local_dir: str | None = None  # spark.local.dir as the driver sees it

    @classmethod
    def of(cls, ctx: TaskContext) -> Replicas:
        return cls(ctx.table_id, ctx.index.index_dir, ctx.driver_local_dir)

    def table_dir(self) -> Path:
        return Path(index_root(self.index_dir, self.driver_local_dir)) / self.table_id


def release_executor_replicas(session: SessionKind, replicas: Replicas) -> None:
    """Run `release_replicas` on every executor: tasks, two per executor at first, land where
    the scheduler offers cores; a round that missed an executor is followed by a larger one.
    Best effort: a replica not released costs a rebuild, so a failure is logged, not raised.
    The tasks are a `mapInArrow` over a range, which classic and Connect sessions both run."""
    executors = session.executor_count()
    seen: set[str] = set()
    tasks = 2 * executors
    for _ in range(RELEASE_ROUNDS):
        job = session.spark.range(0, tasks, 1, tasks).mapInArrow(partial(release_task, replicas), RELEASED)
        try:
            seen.update(job.toArrow().column("executor").to_pylist())
        except Exception as e:
            log.warning("the executors' replicas were not released (%s); those left dirty are rebuilt",
                        first_line(e))
            return
        if len(seen) >= executors:
            return
        tasks *= 2
    log.warning("released the replicas of %d of %d executors; the others' are rebuilt if left dirty", len(seen),
                executors)


def release_task(replicas: Replicas, _batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    yield pa.RecordBatch.from_pydict({"executor": [release_replicas(replicas)]})


def release_replicas(replicas: Replicas) -> str:
    """A task of the job a stream's end runs (`UpsertSink.close`): the replicas `replicas` names
    on this executor, checkpointed and closed, whichever of its Python workers keeps
    them, so that Spark's stop leaves them clean (a worker killed first leaves its replicas
    dirty, rebuilt by the next run). Says which executor it ran on: its Python workers'
    parent (the executor's worker daemon) on this host."""
    table_dir = replicas.table_dir()
    close_kept_open(under=table_dir)  # this worker's own
    for path in sorted(table_dir.glob("shard-*")):
        held = holder.read(path)
        if held is None or not held.alive():
            continue  # closed, or left dirty by a process that is gone (rebuilt on its next open)
        try:
            with ShardReplica.open_read_only(path) as view:
                spec = view.spec
            # The worker keeping it sees the open's release request, checkpoints it and lets go.
            ShardReplica.open(path, spec).close()
        except ReplicaLockedError as e:  # held by a process that does not let go (a driver's)
            log.warning("%s: not released; rebuilt if left dirty", e)
    return f"{socket.gethostname()}:{os.getppid()}"
