"""A SparkSession with the settings the sink expects (used by the job, the demo and tests)."""

from __future__ import annotations

import os
import sys

from pyspark.sql import SparkSession


def spark_session(app_name: str, master: str | None = None, conf: dict[str, str] | None = None) -> SparkSession:
    """Get or create the session. Workers run this interpreter (they need pyarrow);
    timestamps are UTC so Arrow hand-offs to delta-rs carry no local offset."""
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    builder = SparkSession.builder.appName(app_name)
    if master:
        builder = builder.master(master)
    settings = {
        "spark.sql.session.timeZone": "UTC",
        "spark.pyspark.python": os.environ["PYSPARK_PYTHON"],
        "spark.sql.execution.arrow.pyspark.enabled": "true",
        "spark.ui.showConsoleProgress": "false",
    }
    settings.update(conf or {})
    for key, value in settings.items():
        builder = builder.config(key, value)
    return builder.getOrCreate()
