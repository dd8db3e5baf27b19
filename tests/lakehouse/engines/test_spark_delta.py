from importlib import metadata
from pathlib import Path

from sink.lakehouse.engines import spark_delta


def test_the_package_follows_the_installed_pyspark_and_delta_spark():
    spark = ".".join(metadata.version("pyspark").split(".")[:2])
    assert spark_delta.package() == f"io.delta:delta-spark_{spark}_2.13:{metadata.version('delta-spark')}"
    assert spark_delta.fetch_command() == f"mvn -q dependency:get -Dartifact={spark_delta.package()}"


def test_the_jar_is_where_maven_keeps_it(tmp_path):
    _, artifact, version = spark_delta.package().split(":")
    jar = Path("io", "delta", artifact, version, f"{artifact}-{version}.jar")
    assert spark_delta.local_jar(tmp_path) == tmp_path / jar
    assert spark_delta.local_jar() == Path.home() / ".m2" / "repository" / jar


def test_a_session_gets_the_package_the_extension_and_the_catalog():
    assert spark_delta.session_conf() == {
        "spark.jars.packages": spark_delta.package(),
        "spark.jars.excludes": ",".join(spark_delta.SPARK_PROVIDED),
        "spark.sql.extensions": "io.delta.sql.DeltaSparkSessionExtension",
        "spark.sql.catalog.spark_catalog": "org.apache.spark.sql.delta.catalog.DeltaCatalog",
    }


def test_spark_submit_gets_the_same_as_arguments():
    conf = spark_delta.session_conf()
    assert spark_delta.submit_args() == [
        "--packages", conf["spark.jars.packages"],
        "--conf", f"spark.jars.excludes={conf['spark.jars.excludes']}",
        "--conf", "spark.sql.extensions=io.delta.sql.DeltaSparkSessionExtension",
        "--conf", "spark.sql.catalog.spark_catalog=org.apache.spark.sql.delta.catalog.DeltaCatalog",
    ]
