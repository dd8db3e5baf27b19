"""The kinds of Spark session the sink runs under, chosen once per sink from the batch's
session: a classic one (py4j reaches Spark's JVM) or a Spark Connect one (only the Connect
protocol: no SparkContext, no JVM plan). Every call that depends on the kind goes through a
`SessionKind`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal, Protocol

from pyspark.sql import DataFrame, SparkSession


class Shared(Protocol):
    """A value every task of one job reads (a broadcast, or the value in the task's closure)."""

    def release(self) -> None: ...


class SessionKind(Protocol):
    name: Literal["classic", "connect"]
    spark: SparkSession
    # SQL for a record's input file: what `sink.arrival` orders by.
    file_column: str

    def master(self) -> str: ...

    def default_parallelism(self) -> int: ...

    def executor_count(self) -> int: ...

    def batch_file_order(self, batch_df: DataFrame) -> tuple[int, ...] | None:
        """The batch's input files oldest first (hashes of `file_column`), or None: each task
        orders the files of its records itself (`sink.arrival.path_order`)."""

    def stream_sources(self, df: DataFrame) -> list[tuple[str, dict[str, str]]]:
        """(format, options) of each streaming file source `df` reads; empty when unknown."""

    def share(self, value: Any) -> tuple[Any, Callable[[], None]]:
        """`value` as the tasks of one job read it (`getattr(v, "value", v)`), and its release."""

    def set_log_level(self, level: str) -> None: ...

    def host_foreach_batch(self) -> None:
        """Ready the process that runs the foreachBatch function for how the session ends it."""


def is_connect(spark: SparkSession) -> bool:
    return type(spark).__module__.startswith("pyspark.sql.connect.")


def session_kind(spark: SparkSession) -> SessionKind:
    if is_connect(spark):
        from sink.session.connect import ConnectSession
        return ConnectSession(spark)
    from sink.session.classic import ClassicSession
    return ClassicSession(spark)


def cores_of_master(master: str, cpu_count: int) -> int | None:
    """The cores a local or local-cluster master runs tasks on (None: the master does not say):
    what SparkContext.defaultParallelism gives under it."""
    if master == "local":
        return 1
    if master.startswith("local-cluster[") and master.endswith("]"):
        executors, cores, _memory = master[len("local-cluster["):-1].split(",")
        return int(executors) * int(cores)
    if master.startswith("local[") and master.endswith("]"):
        threads = master[len("local["):-1].split(",")[0]  # local[N, maxFailures]
        return cpu_count if threads == "*" else int(threads)
    return None


def executors_of_master(master: str) -> int | None:
    """The executors a local or local-cluster master has (the driver's own under local)."""
    if master == "local" or master.startswith("local["):
        return 1
    if master.startswith("local-cluster["):
        return int(master[len("local-cluster["):].split(",")[0])
    return None
