"""A SparkSession with the settings the sink expects (used by the job, the demo and tests)."""

from __future__ import annotations

import os
import sys
import warnings

from pyspark.sql import SparkSession

from jobs import kafka_source
from sink.errors import DeltaJarsError
from sink.lakehouse.engines import spark_delta


def session_settings(*, delta: bool, remote: str | None, kafka: bool = False) -> dict[str, str]:
    """What `spark_session` sets: runtime settings always; the static ones (workers'
    interpreter, progress bar, Delta's package, extension and catalog, Spark's Kafka
    connector) where this process starts Spark, a server at `sc://` having its own."""
    settings = {"spark.sql.session.timeZone": "UTC", "spark.sql.execution.arrow.pyspark.enabled": "true"}
    if remote and remote.startswith("sc://"):
        return settings
    settings.update({"spark.pyspark.python": os.environ.get("PYSPARK_PYTHON", sys.executable),
                     "spark.ui.showConsoleProgress": "false"})
    settings.update(spark_delta.session_conf() if delta else {})
    if kafka:
        packages = [settings.get("spark.jars.packages"), kafka_source.package()]
        settings["spark.jars.packages"] = ",".join(p for p in packages if p)
    return settings


def spark_session(app_name: str, master: str | None = None, conf: dict[str, str] | None = None, *,
                  delta: bool = False, remote: str | None = None, kafka: bool = False) -> SparkSession:
    """Get or create the session. Workers run this interpreter (they need pyarrow);
    timestamps are UTC so Arrow hand-offs to delta-rs carry no local offset. `delta`: with
    Delta's Spark engine (its package, SQL extension and catalog: sink.lakehouse.engines.spark_delta).
    `remote`: a Spark Connect session instead, to `sc://host:port`, or to a Connect server
    this process starts on a local master (`local[2]`). `kafka`: with Spark's Kafka connector
    (`jobs.kafka_source.package()`, fetched by `make kafka-jars`). A server at `sc://` has Delta's
    engine from its own start (docs: Spark Connect): the client sets none of its static
    settings, which the server would refuse (CANNOT_MODIFY_CONFIG warnings)."""
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    builder = SparkSession.builder.appName(app_name)
    if remote:
        builder = builder.remote(remote)
    elif master:
        builder = builder.master(master)
    settings = {**session_settings(delta=delta, remote=remote, kafka=kafka), **(conf or {})}
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
