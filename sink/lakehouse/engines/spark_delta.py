"""Delta Lake's own Spark engine in a Spark session: the Maven package of the installed
`delta-spark` Python package (as `delta.pip_utils.configure_spark_with_delta_pip` names it),
and the SQL extension and catalog that package does not set.

`python -m sink.lakehouse.engines.spark_delta` prints the package; `--jar`, where Maven keeps its
jar; `--fetch-command`, the command that fetches it with its dependencies into ~/.m2, which
Spark's Ivy reads (`make delta-jars` runs it); `--submit-args`, spark-submit's arguments
for all of it (`make submit` passes them)."""

from __future__ import annotations

import argparse
import os
from importlib import metadata
from pathlib import Path

EXTENSION = "io.delta.sql.DeltaSparkSessionExtension"
CATALOG = "org.apache.spark.sql.delta.catalog.DeltaCatalog"
SCALA_VERSION = "2.13"
# Libraries Delta's dependencies (delta-kernel-defaults) name at older versions than the ones
# Spark ships in its own jars: left out of the resolution, so Spark's are the ones loaded and
# Ivy has nothing to fetch that `make delta-jars` did not.
SPARK_PROVIDED = (
    "com.fasterxml.jackson.core:jackson-databind", "com.github.luben:zstd-jni", "commons-logging:commons-logging",
    "commons-pool:commons-pool", "io.airlift:aircompressor", "org.apache.hadoop:hadoop-client-api",
    "org.apache.hadoop:hadoop-client-runtime", "org.apache.logging.log4j:log4j-api",
    "org.apache.logging.log4j:log4j-core", "org.apache.logging.log4j:log4j-slf4j2-impl",
    "org.apache.parquet:parquet-column", "org.apache.parquet:parquet-encoding", "org.apache.parquet:parquet-hadoop",
    "org.apache.parquet:parquet-jackson", "org.roaringbitmap:RoaringBitmap", "org.slf4j:slf4j-api",
    "org.xerial.snappy:snappy-java",
)


def package() -> str:
    """The Maven coordinate of Delta's jar for the installed pyspark and delta-spark."""
    spark = ".".join(metadata.version("pyspark").split(".")[:2])
    return f"io.delta:delta-spark_{spark}_{SCALA_VERSION}:{metadata.version('delta-spark')}"


def fetch_command() -> str:
    """The command that puts the package and its dependencies where Spark resolves them offline."""
    return f"mvn -q dependency:get -Dartifact={package()}"


def local_jar(repository: Path | None = None, *, coordinate: str | None = None) -> Path:
    """Where Maven keeps the package's jar, or another `coordinate`'s (in ~/.m2/repository
    unless told)."""
    group, artifact, version = (coordinate or package()).split(":")
    root = repository or Path(os.path.expanduser("~/.m2/repository"))
    return root.joinpath(*group.split("."), artifact, version, f"{artifact}-{version}.jar")


def session_conf() -> dict[str, str]:
    """What a session needs to run delta-spark: the package (less what Spark ships), the
    extension, the catalog."""
    return {"spark.jars.packages": package(), "spark.jars.excludes": ",".join(SPARK_PROVIDED),
            "spark.sql.extensions": EXTENSION, "spark.sql.catalog.spark_catalog": CATALOG}


def submit_args() -> list[str]:
    """`session_conf()` as spark-submit's arguments."""
    conf = session_conf()
    args = ["--packages", conf.pop("spark.jars.packages")]
    for key, value in conf.items():
        args += ["--conf", f"{key}={value}"]
    return args


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    shown = parser.add_mutually_exclusive_group()
    shown.add_argument("--jar", action="store_true", help="print the jar's path in ~/.m2 instead")
    shown.add_argument("--fetch-command", action="store_true", help="print the command that fetches it instead")
    shown.add_argument("--submit-args", action="store_true", help="print spark-submit's arguments for it instead")
    args = parser.parse_args()
    if args.submit_args:
        print(" ".join(submit_args()))
        return
    print(local_jar() if args.jar else fetch_command() if args.fetch_command else package())


if __name__ == "__main__":
    main()
