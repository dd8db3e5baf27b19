"""The whole chain with real components: DML on PostgreSQL, captured by Debezium's connector
(pgoutput) in Kafka Connect **at its defaults** (precise decimals, adaptive time precision,
the JSON converter with schemas, the default replica identity), streamed by the ready job from
Kafka into Delta, a table per topic in one job. At quiescence each Delta table equals
`SELECT * FROM` its PostgreSQL table, column by column, typed (NUMERIC as decimals, dates as
dates, instants as instants, JSON as the same document)."""

import datetime as dt
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from decimal import ROUND_HALF_UP, Decimal
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
UTC = dt.UTC


def amount(rng: random.Random) -> Decimal:
    """A NUMERIC(18, 6) value, up to its 18 digits, either sign."""
    return Decimal(rng.randrange(-(10**18) + 1, 10**18)).scaleb(-6) if rng.random() < 0.5 else \
        Decimal(rng.randrange(-10**7, 10**7)).scaleb(-rng.randrange(0, 7))


def instant(rng: random.Random) -> dt.datetime:
    return dt.datetime(1950, 1, 1, tzinfo=UTC) + dt.timedelta(microseconds=rng.randrange(0, 3 * 10**15))


# Per table: its PostgreSQL columns, its key, random values for its other columns; updates set
# two of `updated` at random. Orders' `big` is TOASTed (12 kB of random hex, stored out of
# line) and no update sets it: under the default replica identity Debezium sends its
# placeholder instead, and the table keeps the stored value; a key change's create carries it
# too, and takes the old key's value (jobs.key_changes). Customers have a composite key.
TABLES = {
    "orders": {
        "ddl": "id INT PRIMARY KEY, note TEXT, amount NUMERIC(18, 6), placed DATE, at TIMESTAMPTZ, paid BOOLEAN, "
               "doc JSONB, tags TEXT[], seen TIMESTAMP, big TEXT",
        "key": ["id"],
        "values": lambda rng: {
            "note": f"n{rng.randrange(1000)}", "amount": amount(rng),
            "placed": dt.date(1903, 1, 1) + dt.timedelta(days=rng.randrange(0, 60_000)), "at": instant(rng),
            "paid": rng.choice([True, False, None]), "doc": json.dumps({"k": rng.randrange(9), "l": [1, None, "x"]}),
            "tags": rng.choice([None, [], ["a", None, f"t{rng.randrange(9)}"]]),
            "seen": instant(rng).replace(tzinfo=None), "big": rng.randbytes(6400).hex()},
        "updated": ["note", "amount", "placed", "at", "paid", "doc", "tags"],
    },
    # `tier` and `risk` are added to PostgreSQL's table mid-stream (Debezium's schema change):
    # the messages bring them.
    "customers": {
        "ddl": "region TEXT, id INT, name TEXT, city TEXT, PRIMARY KEY (region, id)",
        "key": ["region", "id"],
        "values": lambda rng: {"name": f"c{rng.randrange(1000)}", "city": rng.choice(["Oslo", "Lyon", None])},
        "updated": ["name", "city"],
    },
}
ADDED = {"customers": ["tier", "risk"]}
SENTINEL = -1  # each table's last row: once its event is in Kafka, so are all before it


def key_of(table: str, rng: random.Random, next_id: int) -> dict:
    return {"id": next_id} if table == "orders" else {"region": rng.choice(["eu", "us"]), "id": next_id}


def random_workload(conn, rng: random.Random, statements: int, first_id: int) -> None:
    """Inserts, updates, deletes and primary key changes over both tables, alone or several in
    one transaction (which may span both tables)."""
    next_id = first_id
    for _ in range(statements):
        with conn.transaction():
            for _ in range(rng.choice([1, 1, 1, 3])):
                table = rng.choice(list(TABLES))
                spec = TABLES[table]
                keys = [dict(zip(spec["key"], r)) for r in conn.execute(
                    f"SELECT {', '.join(spec['key'])} FROM {table} WHERE id >= 0")]
                kind = rng.random()
                if kind < 0.35 or not keys:
                    row = {**key_of(table, rng, next_id), **spec["values"](rng)}
                    conn.execute(f"INSERT INTO {table} ({', '.join(row)}) VALUES ({', '.join(['%s'] * len(row))})",
                                 list(row.values()))
                    next_id += 1
                    continue
                where = " AND ".join(f"{k} = %s" for k in spec["key"])
                key = rng.choice(keys)
                if kind < 0.75:
                    values = spec["values"](rng)
                    columns = rng.sample(spec["updated"], 2)
                    conn.execute(f"UPDATE {table} SET {', '.join(f'{c} = %s' for c in columns)} WHERE {where}",
                                 [*(values[c] for c in columns), *key.values()])
                elif kind < 0.9:
                    conn.execute(f"DELETE FROM {table} WHERE {where}", list(key.values()))
                else:  # a new key: Debezium sends a delete of the old key, a create of the new
                    moved = key_of(table, rng, next_id)
                    conn.execute(f"UPDATE {table} SET {', '.join(f'{k} = %s' for k in moved)} WHERE {where}",
                                 [*moved.values(), *key.values()])
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
            if message.key() and json.loads(message.key())["payload"]["id"] == SENTINEL:
                waiting.discard(message.topic())
        assert not waiting, f"the sentinel rows' events did not reach {sorted(waiting)} within {timeout_s} s"
        return placeholders
    finally:
        consumer.close()


def wait_for_offsets(conn, slots: list[str], lsn: str, timeout_s: float = 120) -> None:
    """Until Debezium has committed its offsets up to `lsn` on every slot (it confirms a
    position to PostgreSQL once Connect stored its offsets)."""
    deadline = time.monotonic() + timeout_s
    query = "SELECT bool_and(confirmed_flush_lsn >= %s::pg_lsn) FROM pg_replication_slots WHERE slot_name = ANY(%s)"
    while not conn.execute(query, (lsn, slots)).fetchone()[0]:
        assert time.monotonic() < deadline, f"Debezium's offsets did not pass {lsn} within {timeout_s} s"
        time.sleep(0.2)


# The connectors capturing the workload: Debezium at its defaults, and with the other two
# decimal.handling.mode values (their topics under their own prefix).
CAPTURES = {"cdc": {}, "cdcstr": {"decimal.handling.mode": "string"}, "cdcdbl": {"decimal.handling.mode": "double"}}


MIRROR = """
[mirror]
table_uri = "data/{table}"
ordering = "lsn"
delete_when = "op = 'd'"
index_dir = "data/index"
metrics_port = 0
"""


def job_config(tmp_path, bootstrap_servers: str, *, prefix: str = "cdc", sink: str = "", source: str = "",
               declared: dict[str, str] | None = None, mirror: bool = False) -> str:
    """One [[sink]] per table, each reading its own topic; `mirror`: instead, one `[mirror]`
    making a table of each topic of the capture, as a user mirrors a database. Without
    `declared` the config names no column and no key: the key comes from the message keys'
    Connect schema, every column from the values'. `declared`, per table: the key's and these
    columns' types."""
    types = {"id": "INT", "region": "STRING"}
    tables = MIRROR if mirror else ""
    for table, spec in {} if mirror else TABLES.items():
        given = ""
        if declared is not None:
            row = ", ".join([*(f"{k}: {types[k]}" for k in spec["key"]), *filter(None, [declared.get(table)])])
            given = (f'schema = "op STRING, ts_ms BIGINT, source STRUCT<lsn: BIGINT>, before STRUCT<{row}>, '
                     f'after STRUCT<{row}>"')
        tables += f"""
[[sink]]
table_uri = "data/{table}"
{f"key = {json.dumps(spec['key'])}" if declared is not None else ""}
ordering = "lsn"
delete_when = "op = 'd'"
checkpoint_dir = "data/{table}_checkpoint"
index_dir = "data/index"
metrics_port = 0
{sink}

[sink.source]
topics = ["{prefix}.public.{table}"]
{given}
"""
    pattern = f'subscribe_pattern = "{prefix}\\\\.public\\\\..*"' if mirror else ""
    conf = tmp_path / "sink.toml"
    conf.write_text(tables + f"""
[source]
format = "kafka"
bootstrap_servers = "{bootstrap_servers}"
envelope = "debezium"
value_format = "json-with-schema"
{pattern}
{source}
""")
    return str(conf)


@pytest.fixture(scope="module")
def captured(kafka_broker, postgres, tmp_path_factory) -> dict[str, list[dict]]:
    """The workload run once on PostgreSQL and captured by Debezium into the topics (its worker
    killed and restarted once on the way), which each test streams into tables of its own;
    PostgreSQL's tables at quiescence (`SELECT *`, as psycopg types them), per table."""
    rng = random.Random(54)
    conn = psycopg.connect(postgres.dsn, autocommit=True)
    for table, spec in TABLES.items():
        conn.execute(f"CREATE TABLE {table} ({spec['ddl']})")
    random_workload(conn, rng, statements=120, first_id=0)  # rows there before the connector: its snapshot
    connect = tmp_path_factory.mktemp("connect")
    tables = [f"public.{table}" for table in TABLES]
    debezium = Debezium.start(connect, kafka_broker, postgres, tables=tables, captures=CAPTURES)
    try:
        random_workload(conn, rng, statements=100, first_id=1000)
        committed = conn.execute("SELECT pg_current_wal_lsn()").fetchone()[0]
        conn.execute("ALTER TABLE customers ADD COLUMN tier TEXT, ADD COLUMN risk NUMERIC(5, 2)")
        conn.execute("UPDATE customers SET tier = 'gold', risk = -12.5 WHERE id IN "
                     "(SELECT id FROM customers ORDER BY id LIMIT 10)")
        conn.execute("INSERT INTO customers VALUES ('eu', 1900, 'new', 'Oslo', 'silver', 999.99)")
        # The Connect worker killed once its offsets passed the workload (before that, a restart
        # snapshots again, and Debezium sends no delete for a row gone in between: a loss at
        # the source no sink sees), the changes after them maybe not: sent again after the
        # restart. Changes made while it is down; restarted from its offsets.
        wait_for_offsets(conn, debezium.slots, committed)
        debezium.process.kill()
        debezium.process.wait(timeout=60)
        random_workload(conn, rng, statements=50, first_id=2000)
        debezium = Debezium.start(connect, kafka_broker, postgres, tables=tables, captures=CAPTURES)
        random_workload(conn, rng, statements=50, first_id=2500)
        conn.execute(f"INSERT INTO orders (id) VALUES ({SENTINEL})")
        conn.execute(f"INSERT INTO customers (region, id) VALUES ('eu', {SENTINEL})")
        topics = [f"{prefix}.public.{table}" for prefix in CAPTURES for table in TABLES]
        placeholders = wait_for_sentinels(kafka_broker.bootstrap_servers, topics)
    finally:
        debezium.stop()
    tables = {}
    for table in TABLES:
        cursor = conn.execute(f"SELECT * FROM {table}")
        names = [d.name for d in cursor.description]
        tables[table] = [dict(zip(names, row)) for row in cursor]
        # Rows from before the connector (snapshot reads) and from after it, live at the end.
        assert any(r["id"] < 1000 for r in tables[table]) and any(r["id"] >= 1000 for r in tables[table])
    assert any(r["tier"] for r in tables["customers"])  # the added columns hold values the stream must carry
    assert any(r["amount"] is not None and len(r["amount"].as_tuple().digits) > 15 for r in tables["orders"])
    assert placeholders["cdc.public.orders"] > 0  # updates and key changes left `big` unchanged, Debezium said so
    conn.close()
    return tables


def typed(value, column: str):
    """A Delta value as PostgreSQL's compares: JSON text as its document."""
    return json.loads(value) if column == "doc" and value is not None else value


def sort_key(table: str):
    return lambda r: tuple(r[k] for k in TABLES[table]["key"])


def assert_tables_equal(tmp_path, captured: dict[str, list[dict]], decimals=lambda v: v) -> None:
    """Each Delta table equals PostgreSQL's, typed; `decimals`: what the capture's mode makes of
    a NUMERIC value."""
    for table, source in captured.items():
        delta = DeltaTable(str(tmp_path / "data" / table)).to_pyarrow_table(columns=list(source[0])).to_pylist()
        got = [{c: typed(v, c) for c, v in r.items()} for r in delta]
        expected = [{c: decimals(v) if isinstance(v, Decimal) else v for c, v in r.items()} for r in source]
        assert sorted(got, key=sort_key(table)) == sorted(expected, key=sort_key(table)), table
        assert not (tmp_path / "data" / f"{table}_quarantine").exists(), table  # no placeholder, nothing malformed


def test_postgres_through_debezium_at_its_defaults_equals_the_source_tables_typed(
        spark, kafka_broker, captured, tmp_path):
    """One `[mirror]` makes a table of each topic of the capture; the config names no column
    and no key: each table's key comes from its message keys' Connect schema (the primary key),
    every column, the two added mid-stream among them, from the values', decoded."""
    conf = job_config(tmp_path, kafka_broker.bootstrap_servers, mirror=True)
    assert "schema =" not in Path(conf).read_text() and "key =" not in Path(conf).read_text()
    sinks = run(conf, once=True)  # one Spark start-up
    assert {s.config.table_uri: s.config.key for s in sinks} == {
        str(tmp_path / "data" / table): spec["key"] for table, spec in TABLES.items()}
    schema = {f.name: f.type.type for f in DeltaTable(str(tmp_path / "data" / "orders")).schema().fields}
    assert (schema["amount"], schema["placed"], schema["at"], schema["seen"]) == (
        "decimal(18,6)", "date", "timestamp", "timestamp_ntz")
    assert_tables_equal(tmp_path, captured)


@pytest.mark.parametrize(("prefix", "decimals"), [
    ("cdcstr", lambda v: v),
    # A double holds 15-17 significant digits: the double's shortest text at the column's scale.
    ("cdcdbl", lambda v: Decimal(repr(float(v))).quantize(Decimal(1).scaleb(v.as_tuple().exponent), ROUND_HALF_UP))])
def test_the_other_decimal_modes_give_the_same_values_where_the_numeric_columns_are_declared(
        spark, kafka_broker, captured, tmp_path, prefix, decimals):
    """decimal.handling.mode = string and double send NUMERIC as text and as a double, with no
    logical type saying it was one: the column's type is declared, as a table the sink already
    holds declares it."""
    conf = job_config(tmp_path, kafka_broker.bootstrap_servers, prefix=prefix,
                      declared={"orders": "amount: DECIMAL(18, 6)", "customers": "risk: DECIMAL(5, 2)"})
    run(conf, once=True)
    assert_tables_equal(tmp_path, captured, decimals)


def job_process(conf: str, *args: str) -> list[str]:
    return [sys.executable, "-m", "jobs.upsert_stream", "--config", conf, *args]


def test_a_job_sigkilled_after_a_column_arrived_goes_on_exactly_after_a_restart(
        spark, kafka_broker, captured, tmp_path):
    """The job in a process of its own, a few dozen offsets a batch, SIGKILLed once it has added
    the columns that arrived at the source to the Delta table; the restarted job reads them
    from the table (its schema does not name them) and goes on from its checkpoints. A
    mirror's tables, as a user mirrors a database."""
    conf = job_config(tmp_path, kafka_broker.bootstrap_servers, source="max_offsets_per_trigger = 40", mirror=True)
    log = tmp_path / "job.log"
    with open(log, "w") as out:
        job = subprocess.Popen(job_process(conf, "--trigger-seconds", "1"), cwd=ROOT, stdout=out,
                               stderr=subprocess.STDOUT)
    customers = tmp_path / "data" / "customers"
    deadline = time.monotonic() + 300

    def added() -> bool:
        if not (customers / "_delta_log").exists():
            return False
        return {"tier", "risk"} <= {f.name for f in DeltaTable(str(customers)).schema().fields}

    try:
        while not added():
            assert job.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
    finally:
        job.send_signal(signal.SIGKILL)
        job.wait(timeout=60)
    killed_at = DeltaTable(str(customers)).version()
    run(conf, once=True)
    assert DeltaTable(str(customers)).version() > killed_at  # killed mid-stream: the restart had changes to add
    assert_tables_equal(tmp_path, captured)


def test_two_executors_stream_the_capture_exactly(kafka_broker, captured, tmp_path):
    """Spark's local-cluster: two executor JVMs tag and write the tables' batches."""
    import pyspark

    conf = job_config(tmp_path, kafka_broker.bootstrap_servers, sink='tag_on = "executors"\nnum_shards = 2',
                      source="max_offsets_per_trigger = 200", declared={})
    env = {**os.environ, "SPARK_HOME": os.path.dirname(pyspark.__file__), "PYSPARK_PYTHON": sys.executable}
    done = subprocess.run(job_process(conf, "--once", "--master", "local-cluster[2,1,1024]"), cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert_tables_equal(tmp_path, captured)
