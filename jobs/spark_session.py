"""A SparkSession with the settings the sink expects (used by the job, the demo and tests)."""

from __future__ import annotations

import os
import sys
import warnings

from pyspark.sql import SparkSession

from sink.errors import DeltaJarsError
from sink.lakehouse import spark_delta


def spark_session(app_name: str, master: str | None = None, conf: dict[str, str] | None = None, *,
                  delta: bool = False, remote: str | None = None) -> SparkSession:
    """Get or create the session. Workers run this interpreter (they need pyarrow);
    timestamps are UTC so Arrow hand-offs to delta-rs carry no local offset. `delta`: with
    Delta's Spark engine (its package, SQL extension and catalog: sink.lakehouse.spark_delta).
    `remote`: a Spark Connect session instead, to `sc://host:port`, or to a Connect server
    this process starts on a local master (`local[2]`)."""
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    builder = SparkSession.builder.appName(app_name)
    if remote:
        builder = builder.remote(remote)
    elif master:
        builder = builder.master(master)
    settings = {
        "spark.sql.session.timeZone": "UTC",
        "spark.pyspark.python": os.environ["PYSPARK_PYTHON"],
        "spark.sql.execution.arrow.pyspark.enabled": "true",
        "spark.ui.showConsoleProgress": "false",
    }
    if delta:
        settings.update(spark_delta.session_conf())
    settings.update(conf or {})
    for key, value in settings.items():
        builder = builder.config(key, value)
    try:
        with warnings.catch_warnings():
            if remote and remote.startswith("local"):
                # The local server started with every setting; the client then sets them again
                # as session settings, which Spark refuses (with a warning) for static ones.
                warnings.filterwarnings("ignore", message="Failed to set", category=UserWarning)
            return builder.getOrCreate()
    except Exception as e:
        if delta and not spark_delta.local_jar().exists():
            raise DeltaJarsError(
                f"Spark could not start with Delta's package {spark_delta.package()}, which is not in ~/.m2 "
                f"either: fetch it with `make delta-jars` (runs `{spark_delta.fetch_command()}`)") from e
        raise
