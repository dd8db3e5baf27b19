"""The end of a stream: the replicas executors' Python workers keep open, checkpointed and
closed before Spark stops, so that the executors' stop leaves them clean."""

from __future__ import annotations

import logging
from functools import partial

from pyspark.sql import SparkSession

from sink.executor import TaskContext, release_replicas

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
                        str(e).splitlines()[0] if str(e) else type(e).__name__)
            return
        if len(seen) >= executors:
            return
        tasks *= 2
    log.warning("released the replicas of %d of %d executors; the others' are rebuilt if left dirty", len(seen),
                executors)
