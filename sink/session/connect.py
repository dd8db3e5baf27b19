"""A Spark Connect session: the sink speaks only the Connect protocol. The master and the
parallelism come from the session's conf, a shared value travels in the tasks' closure, the
batch's input files are read from its records (each task orders its own by modification time)
and the stream's sources from the client's own plan."""

from __future__ import annotations

import logging
import os
import sys
from typing import Any, Literal

from pyspark.sql import DataFrame, SparkSession

from sink.errors import ConfigError
from sink.index.registry import close_kept_open_on_sigterm
from sink.session import cores_of_master, executors_of_master

log = logging.getLogger(__name__)


class ConnectSession:
    name: Literal["connect"] = "connect"
    # The path itself: no plan tells the files' modification times, the tasks read them.
    file_column = "input_file_name()"

    def __init__(self, spark: SparkSession):
        self.spark = spark

    def master(self) -> str:
        return self.spark.conf.get("spark.master", "") or ""

    def default_parallelism(self) -> int:
        configured = self.spark.conf.get("spark.default.parallelism", None)
        if configured:
            return int(configured)
        # The Connect server runs on the driver, whose cores a local master names.
        cores = cores_of_master(self.master(), os.cpu_count() or 1)
        if cores is None:
            raise ConfigError(
                f"num_shards is not set and, under Spark Connect, the session tells neither "
                f"spark.default.parallelism nor the cores of its master {self.master()!r}: set num_shards "
                "(the cores the cluster tags on) or the session's spark.default.parallelism")
        return cores

    def executor_count(self) -> int:
        counted = executors_of_master(self.master())
        if counted is not None:
            return counted
        return int(self.spark.conf.get("spark.executor.instances", "1") or 1)

    def batch_file_order(self, batch_df: DataFrame) -> None:
        return None

    def stream_sources(self, df: DataFrame) -> list[tuple[str, dict[str, str]]]:
        from pyspark.sql.connect.plan import DataSource, LogicalPlan

        found: list[tuple[str, dict[str, str]]] = []
        seen: set[int] = set()

        def walk(node: LogicalPlan) -> None:
            if id(node) in seen:
                return
            seen.add(id(node))
            if isinstance(node, DataSource) and node._is_streaming and node._format:
                found.append((node._format, dict(node._options or {})))
            for value in vars(node).values():  # _child, a join's sides, a union's other side, ...
                for child in value if isinstance(value, list | tuple) else (value,):
                    if isinstance(child, LogicalPlan):
                        walk(child)

        plan = getattr(df, "_plan", None)
        if plan is not None:
            walk(plan)
        return found

    def share(self, value: Any):
        return value, lambda: None

    def set_log_level(self, level: str) -> None:
        # The server's log level is the server's to set (its log4j2 configuration).
        log.debug("under Spark Connect the server's log level stays as configured (not %s)", level)

    def host_foreach_batch(self) -> None:
        """The server's foreachBatch worker, which Spark ends with SIGTERM when the query stops,
        and which the client's `close` cannot reach: the replicas it keeps close on the signal.
        Its Python logging is unconfigured (warnings only): the sink's INFO lines, the batch
        line among them, go to its stderr, which the server's log shows."""
        close_kept_open_on_sigterm()
        log_to_stderr()


LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def log_to_stderr() -> None:
    """The sink's loggers at INFO on stderr, unless this process configured logging itself."""
    sink_log = logging.getLogger("sink")
    if sink_log.handlers or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    sink_log.addHandler(handler)
    sink_log.setLevel(logging.INFO)
