import os

import pytest

from tests.engines import SMALL_TABLES_CONF

# SINK_SPARK=connect: the run's session is a Spark Connect one, to a server started by the
# docs' recipe (tests/connect_server.py), and only the tests marked `connect` or
# `connect_server` run; `@pytest.mark.connect(split="x")` takes only the cases whose parameters
# have those values. A process holds one kind of session, so `make test` runs the suite twice:
# classic (all but the `connect_server` tests) and Connect.
CONNECT = os.environ.get("SINK_SPARK") == "connect"

SESSION_CONF = {
    "spark.sql.shuffle.partitions": "2",
    "spark.default.parallelism": "2",
    "spark.ui.enabled": "false",
    "spark.sql.streaming.schemaInference": "false",
    **SMALL_TABLES_CONF,
}


def pytest_collection_modifyitems(config, items):
    if CONNECT:
        selected = [item for item in items if runs_under_connect(item) or item.get_closest_marker("connect_server")]
    else:
        selected = [item for item in items if not item.get_closest_marker("connect_server")]
    config.hook.pytest_deselected(items=[item for item in items if item not in selected])
    items[:] = selected


def runs_under_connect(item) -> bool:
    marker = item.get_closest_marker("connect")
    if marker is None:
        return False
    params = getattr(item, "callspec", None)
    return all(params is not None and params.params.get(k) == v for k, v in marker.kwargs.items())


@pytest.fixture(scope="session")
def connect_server(tmp_path_factory):
    """The Connect pass's server on local[2], started as docs/spark-connect.md says, with the
    session's settings from its start (a client could set only the runtime ones)."""
    from tests.connect_server import ConnectServer

    server = ConnectServer.start(tmp_path_factory.mktemp("connect-server") / "server.log", conf=SESSION_CONF)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def spark(request):
    """One SparkSession for every integration test (starting one takes ~10 s), with Delta's
    Spark engine (tests read the sink's tables with it). Connect: a client of the
    `connect_server`, which has Delta's package, extension and catalog."""
    from jobs.spark_session import spark_session

    if CONNECT:
        from sink.session import is_connect

        server = request.getfixturevalue("connect_server")
        session = spark_session("sink-connect-tests", remote=server.url, delta=True)
        assert is_connect(session)
    else:
        session = spark_session("sink-tests", master="local[2]", conf=SESSION_CONF, delta=True, kafka=True)
        session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()
