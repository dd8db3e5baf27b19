"""The end of a stream: the replicas executors' Python workers keep open, checkpointed and
closed before Spark stops, so that the executors' stop leaves them clean."""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Iterator
from functools import partial
from pathlib import Path

from pyspark.sql import SparkSession

from sink.errors import ReplicaLockedError
from sink.index import holder
from sink.index.registry import close_kept_open
from sink.index.replica import ShardReplica
from sink.library_errors import first_line
from sink.task_context import TaskContext

log = logging.getLogger(__name__)

# Rounds of release tasks; each round runs twice as many tasks as the last.
RELEASE_ROUNDS = 3


def executor_count(spark: SparkSession) -> int:
    """The executors the application has (the driver's own one under a local master)."""
    try:
        registered = spark.sparkContext._jsc.sc().getExecutorMemoryStatus().size()  # the driver counts too
    except Exception as e:  # no JVM to ask (Spark Connect): one round of tasks
        log.debug("cannot count the executors (%s)", e)
        return 1
    return max(registered - 1, 1)


def release_executor_replicas(spark: SparkSession, ctx: TaskContext) -> None:
    """Run `release_replicas` on every executor: tasks, two per executor at first, land where
    the scheduler offers cores; a round that missed an executor is followed by a larger one.
    Best effort: a replica not released costs a rebuild, so a failure is logged, not raised."""
    executors = executor_count(spark)
    seen: set[str] = set()
    tasks = 2 * executors
    for _ in range(RELEASE_ROUNDS):
        rdd = spark.sparkContext.parallelize(range(tasks), tasks)
        try:
            seen.update(rdd.mapPartitions(partial(release_replicas, ctx)).collect())
        except Exception as e:
            log.warning("the executors' replicas were not released (%s); those left dirty are rebuilt",
                        first_line(e))
            return
        if len(seen) >= executors:
            return
        tasks *= 2
    log.warning("released the replicas of %d of %d executors; the others' are rebuilt if left dirty", len(seen),
                executors)


def release_replicas(ctx: TaskContext, _rows) -> Iterator[str]:
    """A task of the job a stream's end runs (`UpsertSink.close`): the replicas of `ctx`'s
    table on this executor checkpointed and closed, whichever of its Python workers keeps
    them, so that Spark's stop leaves them clean (a worker killed first leaves its replicas
    dirty, rebuilt by the next run). Yields which executor it ran on: its Python workers'
    parent (the executor's worker daemon) on this host."""
    table_dir = Path(ctx.index_root()) / ctx.table_id
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
    yield f"{socket.gethostname()}:{os.getppid()}"
