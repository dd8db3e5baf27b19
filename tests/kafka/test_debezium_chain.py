"""The whole chain with real components: DML on PostgreSQL, captured by Debezium's connector
(pgoutput) in Kafka Connect, streamed by the ready job from Kafka into Delta. At quiescence the
Delta table equals `SELECT * FROM` the PostgreSQL table, column by column."""

import random
import time

import psycopg
import pytest
from confluent_kafka import Consumer
from deltalake import DeltaTable

from jobs.upsert_stream import run
from tests.cdc_stack import Debezium
from tests.kafka.test_kafka_source import job_config

pytestmark = pytest.mark.spark

TABLE = "orders"
TOPIC = f"cdc.public.{TABLE}"
SENTINEL = -1  # the workload's last row: once its event is in Kafka, so are all before it
COLUMNS = ["id", "note", "amount"]


def random_workload(conn, rng: random.Random, statements: int, first_id: int) -> None:
    """Inserts, updates, deletes and primary key changes, alone or several in one transaction."""
    next_id = first_id
    for _ in range(statements):
        with conn.transaction():
            for _ in range(rng.choice([1, 1, 1, 3])):
                ids = [r[0] for r in conn.execute(f"SELECT id FROM {TABLE} WHERE id >= 0")]
                kind = rng.random()
                if kind < 0.35 or not ids:
                    conn.execute(f"INSERT INTO {TABLE} VALUES (%s, %s, %s)",
                                 (next_id, f"n{next_id}", rng.randrange(10_000) / 100))
                    next_id += 1
                elif kind < 0.75:
                    conn.execute(f"UPDATE {TABLE} SET note = %s, amount = amount + 1 WHERE id = %s",
                                 (f"u{rng.randrange(1000)}", rng.choice(ids)))
                elif kind < 0.9:
                    conn.execute(f"DELETE FROM {TABLE} WHERE id = %s", (rng.choice(ids),))
                else:  # a new primary key: Debezium sends a delete of the old key and a create of the new
                    conn.execute(f"UPDATE {TABLE} SET id = %s WHERE id = %s", (next_id, rng.choice(ids)))
                    next_id += 1


def wait_for_sentinel(bootstrap_servers: str, timeout_s: float = 180) -> None:
    """Until the sentinel row's create is in the topic (bounded by the capture's own pace)."""
    consumer = Consumer({"bootstrap.servers": bootstrap_servers, "group.id": f"sentinel-{time.time_ns()}",
                         "auto.offset.reset": "earliest"})
    consumer.subscribe([TOPIC])
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            message = consumer.poll(1.0)
            if message is not None and message.error() is None and message.key() and \
                    b'"payload":{"id":%d}' % SENTINEL in message.key():
                return
        raise TimeoutError(f"the sentinel row's event did not reach {TOPIC} within {timeout_s} s")
    finally:
        consumer.close()


def test_postgres_through_debezium_and_kafka_equals_the_source_table(spark, kafka_broker, postgres, tmp_path):
    rng = random.Random(54)
    conn = psycopg.connect(postgres.dsn, autocommit=True)
    conn.execute(f"CREATE TABLE {TABLE} (id INT PRIMARY KEY, note TEXT, amount NUMERIC(10, 2))")
    random_workload(conn, rng, statements=80, first_id=0)  # rows there before the connector: its snapshot reads
    debezium = Debezium.start(tmp_path / "connect", kafka_broker, postgres, tables=[f"public.{TABLE}"])
    try:
        random_workload(conn, rng, statements=120, first_id=1000)
        conn.execute(f"INSERT INTO {TABLE} VALUES (%s, 'sentinel', 0)", (SENTINEL,))
        wait_for_sentinel(kafka_broker.bootstrap_servers)
    finally:
        debezium.stop()
    row = "id INT, note STRING, amount STRING"
    conf = job_config(tmp_path, kafka_broker, TOPIC, sink='ordering = "lsn"\npartition_by = []',
                      source=f'schema = "op STRING, ts_ms BIGINT, source STRUCT<lsn: BIGINT>, '
                             f'before STRUCT<{row}>, after STRUCT<{row}>"\n'
                             'envelope = "debezium"\nvalue_format = "json-with-schema"')
    run(str(conf), once=True)
    delta = DeltaTable(str(tmp_path / "data" / "table")).to_pyarrow_table(columns=COLUMNS).to_pylist()
    source = [{"id": i, "note": n, "amount": str(a)} for i, n, a in conn.execute(f"SELECT * FROM {TABLE}")]
    assert sorted(delta, key=lambda r: r["id"]) == sorted(source, key=lambda r: r["id"])
    # Rows from before the connector (snapshot reads) and from after it, live at the end.
    assert any(r["id"] < 1000 for r in source) and any(r["id"] >= 1000 for r in source)
