import os

import pytest

from tests.engines import SMALL_TABLES_CONF

# SINK_SPARK=connect: the run's session is a Spark Connect one (`remote("local[2]")`), and only
# the tests marked `connect` run; `@pytest.mark.connect(split="x")` takes only the cases whose
# parameters have those values. A process holds one kind of session, so `make test` runs the
# suite twice: classic (everything) and Connect (the `connect` tests).
CONNECT = os.environ.get("SINK_SPARK") == "connect"

SESSION_CONF = {
    "spark.sql.shuffle.partitions": "2",
    "spark.default.parallelism": "2",
    "spark.ui.enabled": "false",
    "spark.sql.streaming.schemaInference": "false",
    **SMALL_TABLES_CONF,
}


def pytest_collection_modifyitems(config, items):
    if not CONNECT:
        return
    selected = [item for item in items if runs_under_connect(item)]
    config.hook.pytest_deselected(items=[item for item in items if item not in selected])
    items[:] = selected


def runs_under_connect(item) -> bool:
    marker = item.get_closest_marker("connect")
    if marker is None:
        return False
    params = getattr(item, "callspec", None)
    return all(params is not None and params.params.get(k) == v for k, v in marker.kwargs.items())


@pytest.fixture(scope="session")
def spark():
    """One SparkSession for every integration test (starting one takes ~10 s), with Delta's
    Spark engine (tests read the sink's tables with it). Connect: a local Connect server on
    local[2], with Delta's package, extension and catalog, which this process talks to as a
    client."""
    from jobs.spark_session import spark_session

    if CONNECT:
        from sink.session import is_connect

        session = spark_session("sink-connect-tests", remote="local[2]", conf=SESSION_CONF, delta=True)
        assert is_connect(session)
    else:
        session = spark_session("sink-tests", master="local[2]", conf=SESSION_CONF, delta=True)
        session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()
