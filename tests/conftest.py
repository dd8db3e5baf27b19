import pytest


@pytest.fixture(scope="session")
def spark():
    """One local SparkSession for every integration test (starting one takes ~10 s), with
    Delta's Spark engine: tests read the sink's tables with it."""
    from jobs.spark_session import spark_session

    session = spark_session(
        "sink-tests",
        master="local[2]",
        conf={
            "spark.sql.shuffle.partitions": "2",
            "spark.default.parallelism": "2",
            "spark.ui.enabled": "false",
            "spark.sql.streaming.schemaInference": "false",
        },
        delta=True,
    )
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()
