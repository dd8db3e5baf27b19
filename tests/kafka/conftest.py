import shutil
import tempfile
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def kafka_broker(tmp_path_factory):
    """One KRaft broker for the session's Kafka tests (each uses topics of its own)."""
    from tests.cdc_stack import KafkaBroker

    broker = KafkaBroker.start(tmp_path_factory.mktemp("kafka-broker"))
    yield broker
    broker.stop()


@pytest.fixture(scope="session")
def postgres():
    """PostgreSQL with logical decoding, for the session's Debezium captures."""
    from tests.cdc_stack import Postgres

    directory = Path(tempfile.mkdtemp(prefix="sink-postgres-"))
    server = Postgres.start(directory)
    yield server
    server.stop()
    shutil.rmtree(directory)
