"""A classic session: py4j reaches Spark's JVM, so the batch's input files and the stream's
sources are read from Spark's plans."""

from __future__ import annotations

import logging
from typing import Any, Literal

from pyspark.sql import DataFrame, SparkSession

from sink.arrival import file_order

log = logging.getLogger(__name__)


class ClassicSession:
    name: Literal["classic"] = "classic"
    file_column = "xxhash64(input_file_name())"

    def __init__(self, spark: SparkSession):
        self.spark = spark

    def master(self) -> str:
        return self.spark.sparkContext.master

    def default_parallelism(self) -> int:
        return self.spark.sparkContext.defaultParallelism

    def executor_count(self) -> int:
        try:
            registered = self.spark.sparkContext._jsc.sc().getExecutorMemoryStatus().size()  # the driver counts too
        except Exception as e:  # Spark's internals changed: one round of tasks
            log.debug("cannot count the executors (%s)", e)
            return 1
        return max(registered - 1, 1)

    def batch_file_order(self, batch_df: DataFrame) -> tuple[int, ...]:
        return file_order(batch_files(batch_df))

    def stream_sources(self, df: DataFrame) -> list[tuple[str, dict[str, str]]]:
        found: list[tuple[str, dict[str, str]]] = []

        def walk(node) -> None:
            if node.getClass().getSimpleName() == "StreamingRelation":
                source = node.dataSource()
                options = source.options()
                keys_ = options.keys().toList()
                found.append((source.className(), {k: options.apply(k) for k in
                                                   (keys_.apply(i) for i in range(keys_.size()))}))
            children = node.children()
            for i in range(children.size()):
                walk(children.apply(i))

        try:
            walk(df._jdf.queryExecution().analyzed())
        except Exception as e:  # Spark's internals changed: nothing to warn about
            log.debug("cannot read the stream's sources (%s)", e)
            return []
        return found

    def share(self, value: Any):
        broadcast = self.spark.sparkContext.broadcast(value)
        return broadcast, broadcast.unpersist

    def set_log_level(self, level: str) -> None:
        self.spark.sparkContext.setLogLevel(level)

    def host_foreach_batch(self) -> None:
        """The driver: the sink's `close` and the process's exit close its replicas."""


def batch_files(batch_df: DataFrame) -> list[tuple[str, int]]:
    """(path, modification time in ms) of every file a foreachBatch micro-batch scans, read
    from the batch's RDD lineage (foreachBatch hands over a plan that no longer names its
    files). Empty for other DataFrames, non-file sources or when Spark's internals differ."""
    try:
        plan = batch_df._jdf.queryExecution().analyzed()
        if plan.getClass().getSimpleName() != "LogicalRDD":
            return []
        files: list[tuple[str, int]] = []
        _walk(plan.rdd(), files)
        return files
    except Exception as e:  # an internal API changed: ties fall back to scan order
        log.debug("cannot list the batch's files (%s); ties across files follow scan order", e)
        return []


def _walk(rdd, files: list[tuple[str, int]]) -> None:
    if rdd.getClass().getSimpleName() == "FileScanRDD":
        partitions = rdd.filePartitions()
        for i in range(partitions.size()):
            for f in partitions.apply(i).files():
                files.append((f.urlEncodedPath(), f.modificationTime()))
        return
    deps = rdd.dependencies()
    for i in range(deps.size()):
        dep = deps.apply(i)
        # input_file_name() is empty past a shuffle, so files behind one cannot be told apart.
        if dep.getClass().getSimpleName() != "ShuffleDependency":
            _walk(dep.rdd(), files)
