"""The whole chain with real components: DML on PostgreSQL, captured by Debezium's connector
(pgoutput) in Kafka Connect, streamed by the ready job from Kafka into Delta, a table per
topic in one job. At quiescence each Delta table equals `SELECT * FROM` its PostgreSQL table,
column by column."""

import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import psycopg
import pytest
from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition
from deltalake import DeltaTable

from jobs.envelopes import UNAVAILABLE_VALUE
from jobs.upsert_stream import run
from tests.cdc_stack import Debezium

pytestmark = pytest.mark.spark

ROOT = Path(__file__).resolve().parent.parent.parent

# Per table: its PostgreSQL columns, its Spark schema in Debezium's JSON (NUMERIC as text:
# decimal.handling.mode = string), random values for its non-key columns; updates set the first
# two. Orders' `big` is TOASTed (12 kB of random hex, stored out of line) and no update sets
# it: under the default replica identity Debezium sends its placeholder instead, and the table
# keeps the stored value (unchanged_value). Its keys never change: a primary key change's
# create carries the placeholder too, for a value no consumer has under the new key (the job
# quarantines it: tests/kafka/test_kafka_source.py).
TABLES = {
    "orders": ("id INT PRIMARY KEY, note TEXT, amount NUMERIC(10, 2), big TEXT",
               "id INT, note STRING, amount STRING, big STRING",
               lambda rng: (f"n{rng.randrange(1000)}", rng.randrange(10_000) / 100, rng.randbytes(6400).hex())),
    # `tier` is added to PostgreSQL's table mid-stream (Debezium's schema change): named in the
    # job's schema from the start (null in the events before), or found in the messages.
    "customers": ("id INT PRIMARY KEY, name TEXT, city TEXT", "id INT, name STRING, city STRING, tier STRING",
                  lambda rng: (f"c{rng.randrange(1000)}", rng.choice(["Oslo", "Lyon", None]))),
}
def column_names(table: str) -> list[str]:
    return [c.split()[0] for c in TABLES[table][1].split(", ")]


SENTINEL = -1  # each table's last row: once its event is in Kafka, so are all before it


def random_workload(conn, rng: random.Random, statements: int, first_id: int) -> None:
    """Inserts, updates, deletes and primary key changes over both tables, alone or several in
    one transaction (which may span both tables)."""
    next_id = first_id
    for _ in range(statements):
        with conn.transaction():
            for _ in range(rng.choice([1, 1, 1, 3])):
                table = rng.choice(list(TABLES))
                values = TABLES[table][2](rng)
                ids = [r[0] for r in conn.execute(f"SELECT id FROM {table} WHERE id >= 0")]
                kind = rng.random()
                if kind < 0.35 or not ids:
                    conn.execute(f"INSERT INTO {table} VALUES (%s{', %s' * len(values)})", (next_id, *values))
                    next_id += 1
                elif kind < 0.75:
                    columns = column_names(table)[1:]
                    conn.execute(f"UPDATE {table} SET {columns[0]} = %s, {columns[1]} = %s WHERE id = %s",
                                 (*values[:2], rng.choice(ids)))
                elif kind < 0.9:
                    conn.execute(f"DELETE FROM {table} WHERE id = %s", (rng.choice(ids),))
                elif table != "orders":  # a new key: Debezium sends a delete of the old key, a create of the new
                    conn.execute(f"UPDATE {table} SET id = %s WHERE id = %s", (next_id, rng.choice(ids)))
                    next_id += 1


def wait_for_sentinels(bootstrap_servers: str, topics: list[str], timeout_s: float = 180) -> Counter:
    """Until every table's sentinel row is in its topic (bounded by the capture's own pace);
    how many of each topic's messages carry Debezium's placeholder for an unchanged value."""
    consumer = Consumer({"bootstrap.servers": bootstrap_servers, "group.id": "sentinels"})
    waiting = set(topics)
    deadline = time.monotonic() + timeout_s
    try:
        while True:  # the topics appear with the connector's first events
            known = consumer.list_topics(timeout=10).topics
            if all(t in known for t in topics) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        consumer.assign([TopicPartition(t, p, OFFSET_BEGINNING) for t in topics for p in known[t].partitions])
        placeholders = Counter()
        while waiting and time.monotonic() < deadline:
            message = consumer.poll(1.0)
            if message is None or message.error() is not None:
                continue
            if message.value() and UNAVAILABLE_VALUE.encode() in message.value():
                placeholders[message.topic()] += 1
            if message.key() and b'"payload":{"id":%d}' % SENTINEL in message.key():
                waiting.discard(message.topic())
        assert not waiting, f"the sentinel rows' events did not reach {sorted(waiting)} within {timeout_s} s"
        return placeholders
    finally:
        consumer.close()


ADDED_MID_STREAM = ", tier STRING"


def job_config(tmp_path, bootstrap_servers: str, *, sink: str = "", source: str = "",
               schema_from_messages: bool = False) -> str:
    """One [[sink]] per table, each reading its own topic with its own schema (without the
    column added mid-stream, which the messages then bring, under `schema_from_messages`)."""
    sinks = "".join(f"""
[[sink]]
table_uri = "data/{table}"
key = ["id"]
ordering = "lsn"
delete_when = "op = 'd'"
checkpoint_dir = "data/{table}_checkpoint"
index_dir = "data/index"
metrics_port = 0
{sink}

[sink.source]
topics = ["cdc.public.{table}"]
schema = "op STRING, ts_ms BIGINT, source STRUCT<lsn: BIGINT>, before STRUCT<{row}>, after STRUCT<{row}>"
""" for table, row in ((t, r.replace(ADDED_MID_STREAM, "") if schema_from_messages else r)
                       for t, (_, r, _) in TABLES.items()))
    conf = tmp_path / "sink.toml"
    conf.write_text(sinks + f"""
[source]
format = "kafka"
bootstrap_servers = "{bootstrap_servers}"
schema = "op STRING"
envelope = "debezium"
value_format = "json-with-schema"
schema_from_messages = {str(schema_from_messages).lower()}
{source}
""")
    return str(conf)


@pytest.fixture(scope="module")
def captured(kafka_broker, postgres, tmp_path_factory) -> dict[str, list[dict]]:
    """The workload run once on PostgreSQL and captured by Debezium into the topics, which each
    test streams into tables of its own; PostgreSQL's tables at quiescence, per table."""
    rng = random.Random(54)
    conn = psycopg.connect(postgres.dsn, autocommit=True)
    for table, (columns, _, _) in TABLES.items():
        conn.execute(f"CREATE TABLE {table} ({columns})")
    random_workload(conn, rng, statements=120, first_id=0)  # rows there before the connector: its snapshot
    debezium = Debezium.start(tmp_path_factory.mktemp("connect"), kafka_broker, postgres,
                              tables=[f"public.{table}" for table in TABLES])
    try:
        random_workload(conn, rng, statements=100, first_id=1000)
        conn.execute("ALTER TABLE customers ADD COLUMN tier TEXT")
        conn.execute("UPDATE customers SET tier = 'gold' WHERE id IN (SELECT id FROM customers ORDER BY id LIMIT 10)")
        conn.execute("INSERT INTO customers VALUES (1900, 'new', 'Oslo', 'silver')")
        random_workload(conn, rng, statements=100, first_id=2000)
        for table in TABLES:
            conn.execute(f"INSERT INTO {table} (id) VALUES (%s)", (SENTINEL,))
        placeholders = wait_for_sentinels(kafka_broker.bootstrap_servers, [f"cdc.public.{table}" for table in TABLES])
    finally:
        debezium.stop()
    tables = {}
    for table in TABLES:
        names = column_names(table)
        tables[table] = [dict(zip(names, (v if v is None or isinstance(v, int | str) else str(v) for v in row)))
                         for row in conn.execute(f"SELECT {', '.join(names)} FROM {table}")]
        # Rows from before the connector (snapshot reads) and from after it, live at the end.
        assert any(r["id"] < 1000 for r in tables[table]) and any(r["id"] >= 1000 for r in tables[table])
    assert any(r["tier"] for r in tables["customers"])  # the added column holds values the stream must carry
    assert placeholders["cdc.public.orders"] > 0  # updates left `big` unchanged, and Debezium said so
    conn.close()
    return tables


def assert_tables_equal(tmp_path, captured: dict[str, list[dict]]) -> None:
    for table, source in captured.items():
        delta = DeltaTable(str(tmp_path / "data" / table)).to_pyarrow_table(columns=column_names(table)).to_pylist()
        assert sorted(delta, key=lambda r: r["id"]) == sorted(source, key=lambda r: r["id"]), table
        assert not (tmp_path / "data" / f"{table}_quarantine").exists(), table  # no placeholder, nothing malformed


def test_postgres_through_debezium_and_kafka_equals_the_source_tables(spark, kafka_broker, captured, tmp_path):
    """The column added mid-stream is not in the job's schema: the messages bring it."""
    conf = job_config(tmp_path, kafka_broker.bootstrap_servers, schema_from_messages=True)
    assert "tier" not in Path(conf).read_text()
    sinks = run(conf, once=True)  # one Spark start-up
    assert len(sinks) == len(TABLES)
    assert_tables_equal(tmp_path, captured)


def job_process(conf: str, *args: str) -> list[str]:
    return [sys.executable, "-m", "jobs.upsert_stream", "--config", conf, *args]


def test_a_job_sigkilled_in_the_middle_of_the_stream_goes_on_exactly_after_a_restart(
        spark, kafka_broker, captured, tmp_path):
    """The job in a process of its own, a few dozen offsets a batch, SIGKILLed once a few of
    its batches committed; the restarted job goes on from its checkpoints."""
    conf = job_config(tmp_path, kafka_broker.bootstrap_servers, source="max_offsets_per_trigger = 40")
    log = tmp_path / "job.log"
    with open(log, "w") as out:
        job = subprocess.Popen(job_process(conf, "--trigger-seconds", "1"), cwd=ROOT, stdout=out,
                               stderr=subprocess.STDOUT)
    orders = tmp_path / "data" / "orders"
    deadline = time.monotonic() + 300
    try:
        while not (orders / "_delta_log").exists() or DeltaTable(str(orders)).version() < 3:
            assert job.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
    finally:
        job.send_signal(signal.SIGKILL)
        job.wait(timeout=60)
    assert DeltaTable(str(orders)).to_pyarrow_table().num_rows < len(captured["orders"])  # killed mid-stream
    run(conf, once=True)
    assert_tables_equal(tmp_path, captured)


def test_two_executors_stream_the_capture_exactly(kafka_broker, captured, tmp_path):
    """Spark's local-cluster: two executor JVMs tag and write the tables' batches."""
    import pyspark

    conf = job_config(tmp_path, kafka_broker.bootstrap_servers, sink='tag_on = "executors"\nnum_shards = 2',
                      source="max_offsets_per_trigger = 200")
    env = {**os.environ, "SPARK_HOME": os.path.dirname(pyspark.__file__), "PYSPARK_PYTHON": sys.executable}
    done = subprocess.run(job_process(conf, "--once", "--master", "local-cluster[2,1,1024]"), cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert_tables_equal(tmp_path, captured)
