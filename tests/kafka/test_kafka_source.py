"""The ready job on Kafka topics of a real broker: JSON records and Debezium envelopes produced
with a Kafka client, read by Spark's Kafka connector, equal to the oracle."""

import base64
import datetime as dt
import json
import re
import subprocess
import sys
import time
from decimal import Decimal
from pathlib import Path

import pytest
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient, NewTopic
from deltalake import DeltaTable
from prometheus_client import REGISTRY

import jobs.upsert_stream
from jobs import kafka_source
from jobs.envelopes import UNAVAILABLE_VALUE
from jobs.supervisor import TablesFailedError
from jobs.upsert_stream import run
from sink import UpsertSink
from tests.oracle import expected_rows, random_batches

pytestmark = pytest.mark.spark

MALFORMED = b"{not json"


def create_topic(broker, name: str, partitions: int) -> None:
    admin = AdminClient({"bootstrap.servers": broker.bootstrap_servers})
    for future in admin.create_topics([NewTopic(name, num_partitions=partitions, replication_factor=1)]).values():
        future.result(timeout=60)


def produce(broker, topic: str, messages: list[tuple[str | None, bytes | None]]) -> list[tuple[int, int]]:
    """Each (key, value) in order, acknowledged by the broker; their (partition, offset)."""
    producer = Producer({"bootstrap.servers": broker.bootstrap_servers, "enable.idempotence": True})
    placed = [None] * len(messages)

    def delivered(i, err, msg):
        assert err is None, err
        placed[i] = (msg.partition(), msg.offset())

    for i, (key, value) in enumerate(messages):
        producer.produce(topic, key=key, value=value, on_delivery=lambda err, msg, i=i: delivered(i, err, msg))
        producer.poll(0)
    assert producer.flush(60) == 0
    return placed


def job_config(tmp_path: Path, broker, topic: str, *, source: str, sink: str = "") -> Path:
    conf = tmp_path / "sink.toml"
    conf.write_text(f"""
[sink]
table_uri = "data/table"
key = ["id"]
delete_when = "op = 'd'"
checkpoint_dir = "data/checkpoint"
index_dir = "data/index"
metrics_port = 0
{sink}

[source]
format = "kafka"
bootstrap_servers = "{broker.bootstrap_servers}"
topics = ["{topic}"]
{source}
""")
    return conf


def table_rows(uri: str, columns: list[str]) -> list[dict]:
    rows = DeltaTable(uri).to_pyarrow_table(columns=columns).to_pylist()
    return sorted(rows, key=lambda r: (r["dt"], r["id"]))


def quarantined(uri: str) -> list[tuple[str, str]]:
    rows = DeltaTable(f"{uri}_quarantine").to_pyarrow_table(columns=["_corrupt_record", "_quarantine_reason"])
    return sorted((r["_corrupt_record"] or "", r["_quarantine_reason"]) for r in rows.to_pylist())


class RestartingBroker(UpsertSink):
    """A sink that restarts the broker once, after its batch `AFTER`: the query's next batch
    reads from a broker that went away and came back."""

    AFTER = 1
    broker = None

    def __call__(self, df, batch_id):
        super().__call__(df, batch_id)
        if batch_id == self.AFTER and self.broker.process.poll() is None:
            self.broker.stop()
            self.broker.run()


def test_json_records_from_kafka_equal_the_oracle_through_restarts_a_broker_restart_and_a_replay(
        spark, kafka_broker, tmp_path, monkeypatch):
    """Records keyed by their id, so a key's records share a partition and its offsets give
    their arrival: among equal orderings the later one wins. Tombstones (null values) are not
    records; a message that is not JSON is quarantined with its topic, partition and offset."""
    topic = "json-events"
    create_topic(kafka_broker, topic, partitions=3)
    batches = random_batches(21, batches=4, per_batch=300)
    conf = job_config(tmp_path, kafka_broker, topic, sink='ordering = "ts"\npartition_by = ["dt"]',
                      source='schema = "id STRING, dt STRING, ts BIGINT, op STRING, v STRING"\n'
                             "max_offsets_per_trigger = 250")
    uri = str(tmp_path / "data" / "table")

    def send(events):
        messages = [(e.id, json.dumps(e._asdict()).encode()) for e in events]
        messages += [(e.id, None) for e in events[:5] if e.op == "d"]  # as Debezium follows a delete
        return produce(kafka_broker, topic, messages)

    for events in batches[:2]:
        send(events)
    (malformed_at,) = produce(kafka_broker, topic, [("k1", MALFORMED)])
    monkeypatch.setattr(RestartingBroker, "broker", kafka_broker)
    monkeypatch.setattr(jobs.upsert_stream, "UpsertSink", RestartingBroker)
    (first,) = run(str(conf), once=True)
    assert len(first.reports) >= 3  # 1200+ offsets, 250 a batch at most: the broker restarted mid-stream
    assert table_rows(uri, ["id", "dt", "ts", "op", "v"]) == expected_rows(batches[:2])
    partition, offset = malformed_at
    corrupt = f"kafka topic {topic} partition {partition} offset {offset}: {MALFORMED.decode()}"
    bad = [e for b in batches[:2] for e in b if e.id is None]
    assert quarantined(uri) == sorted([(corrupt, next(r for c, r in quarantined(uri) if c == corrupt)),
                                       *(("", "null key column id") for _ in bad)])
    assert next(r for c, r in quarantined(uri) if c == corrupt).startswith("corrupt record")

    monkeypatch.undo()
    for events in batches[2:]:
        send(events)
    (second,) = run(str(conf), once=True)  # a restart: the query goes on from its checkpoint
    assert second.reports[0].batch_id == first.reports[-1].batch_id + 1
    assert table_rows(uri, ["id", "dt", "ts", "op", "v"]) == expected_rows(batches)
    # Every offset consumed: no partition behind.
    assert [REGISTRY.get_sample_value("upsert_sink_kafka_lag", {"sink": second.writer_id, "topic": topic,
                                                                 "partition": str(p)}) for p in range(3)] == [0] * 3

    # The last batch ran but its commit was not recorded (a crash between the two): Spark runs
    # it again on the next start, with the same offsets; the sink skips what the table has.
    last = second.reports[-1].batch_id
    commits = Path(tmp_path, "data", "checkpoint", "commits")
    for name in (str(last), f".{last}.crc"):
        (commits / name).unlink()
    (replay,) = run(str(conf), once=True)
    assert [(r.batch_id, r.mode) for r in replay.reports] == [(last, "skipped")]
    assert table_rows(uri, ["id", "dt", "ts", "op", "v"]) == expected_rows(batches)


def test_lag_is_the_newest_offset_minus_where_the_batch_ended_per_topic_partition():
    end = json.dumps({"orders": {"0": 120, "1": 80}})
    latest = json.dumps({"orders": {"0": 150, "1": 80, "2": 7}})
    assert kafka_source.lag(end, latest) == {("orders", 0): 30, ("orders", 1): 0, ("orders", 2): 7}
    assert kafka_source.lag(None, latest) == kafka_source.lag(end, "null") == {}
    # A restart's first batch replays the planned range: Spark asks for no newest offset, and
    # a listener's progress says "None" (PySpark's str of a Java null).
    assert kafka_source.lag(end, "None") == {}


def debezium_event(op: str, row: dict, lsn: int, *, before: dict | None = None) -> bytes:
    """A Debezium change event of PostgreSQL as the JSON converter writes it with its schema
    (the schema abridged: the job reads the payload)."""
    payload = {"before": before if op in ("u", "d") else None, "after": None if op == "d" else row, "op": op,
               "ts_ms": 1_700_000_000_000 + lsn, "source": {"lsn": lsn, "snapshot": "true" if op == "r" else "false"}}
    return json.dumps({"schema": {"type": "struct", "optional": False, "name": "cdc.Envelope"},
                       "payload": payload}).encode()


def test_debezium_envelopes_order_by_lsn_and_snapshot_reads_never_overwrite_newer_changes(
        spark, kafka_broker, tmp_path):
    """Snapshot reads (op r) sent after the change events of the same rows, as when a
    connector's snapshot overlaps the stream: the lower LSN loses. A delete's tombstone is
    no record; a message without the converter's wrapper is quarantined. An update carrying
    Debezium's placeholder for an unchanged TOAST value keeps the stored value and applies the
    rest (its LSN)."""
    topic = "produced.public.orders"
    create_topic(kafka_broker, topic, partitions=2)
    rows = {i: {"id": f"o{i}", "dt": f"2025-01-0{1 + i % 3}", "v": f"v{i}"} for i in range(12)}
    messages = []
    for i, row in rows.items():  # creates at lsn 100+i, then an update of every other row
        messages.append((row["id"], debezium_event("c", row, 100 + i)))
    for i in range(0, 12, 2):
        messages.append((rows[i]["id"], debezium_event("u", {**rows[i], "v": f"new{i}"}, 200 + i, before=rows[i])))
    for i in (3, 7):  # deletes (the default replica identity: `before` holds the key) and their tombstones
        messages += [(rows[i]["id"], debezium_event("d", {}, 300 + i, before={"id": rows[i]["id"],
                                                                                "dt": rows[i]["dt"]})),
                     (rows[i]["id"], None)]
    for row in rows.values():  # a snapshot of the rows as they were at LSN 150: older than what came since
        messages.append((row["id"], debezium_event("r", row, 150)))
    messages.append(("o0", json.dumps({"op": "c", "after": rows[0]}).encode()))  # no wrapper
    messages.append(("o1", debezium_event("u", {**rows[1], "v": UNAVAILABLE_VALUE}, 400)))
    # A primary key change's create under the default replica identity: no stored value to keep.
    messages.append(("o99", debezium_event("c", {"id": "o99", "dt": "2025-01-01", "v": UNAVAILABLE_VALUE}, 401)))
    # An update holding it for a key the table never held (its create came before the offsets
    # read): set aside, the rest of the batch applied.
    messages.append(("o77", debezium_event("u", {"id": "o77", "dt": "2025-01-02", "v": UNAVAILABLE_VALUE}, 402)))
    produce(kafka_broker, topic, messages)
    conf = job_config(tmp_path, kafka_broker, topic, sink='ordering = "lsn"\npartition_by = ["dt"]',
                      source='schema = "op STRING, ts_ms BIGINT, source STRUCT<lsn: BIGINT>, '
                             'before STRUCT<id: STRING, dt: STRING, v: STRING>, '
                             'after STRUCT<id: STRING, dt: STRING, v: STRING>"\n'
                             'envelope = "debezium"\nvalue_format = "json-with-schema"')
    started = time.time()
    (sink,) = run(str(conf), once=True)
    ended = time.time()
    uri = str(tmp_path / "data" / "table")
    # Freshness from the envelope's ts_ms (1_700_000_000_000 + lsn): the oldest record is the
    # create at LSN 100, committed between the run's start and end.
    (report,) = sink.reports
    oldest = 1_700_000_000_100 / 1000
    assert started - oldest <= report.freshness["1"] <= ended - oldest
    assert report.freshness["1"] >= report.freshness["0.99"] >= report.freshness["0.5"]
    assert REGISTRY.get_sample_value("upsert_sink_freshness_seconds", {"sink": sink.writer_id, "quantile": "1"}) \
        == report.freshness["1"]
    assert f"freshness_s=p50:{report.freshness['0.5']}" in report.summary()
    expected = [{"id": r["id"], "dt": r["dt"], "v": f"new{i}" if i % 2 == 0 else r["v"],
                 "lsn": 200 + i if i % 2 == 0 else 400 if i == 1 else 150} for i, r in rows.items() if i not in (3, 7)]
    assert table_rows(uri, ["id", "dt", "v", "lsn"]) == sorted(expected, key=lambda r: (r["dt"], r["id"]))
    (unavailable, unsent, unwrapped) = sorted(quarantined(uri), key=lambda cr: (cr[0], cr[1]))
    assert unwrapped[0].startswith(f"kafka topic {topic} partition ") and unwrapped[1].startswith("corrupt record")
    assert unavailable == ("", "quarantine_when: op IN ('c', 'r') AND (" + " OR ".join(
        f"`{c}` = '{UNAVAILABLE_VALUE}'" for c in ("id", "dt", "v")) + ")")
    assert unsent == ("", f"unsent value: column 'v' holds unchanged_value '{UNAVAILABLE_VALUE}' (the source did "
                          "not send it), and no stored row of key {'id': 'o77'} is there to keep it from (the key is "
                          "new to the table, or deleted earlier in the batch)")


def test_a_topic_deleted_under_the_job_fails_it_clearly_and_leaves_the_table_as_it_was(
        spark, kafka_broker, tmp_path):
    """fail_on_data_loss (the default): offsets the query has not read are gone with the topic,
    so the query fails with Spark's data-loss error instead of skipping them (and the table
    stops at once: max_restarts = 0)."""
    topic = "deleted-events"
    create_topic(kafka_broker, topic, partitions=1)
    (events,) = random_batches(5, batches=1, per_batch=50, bad_share=0)
    produce(kafka_broker, topic, [(e.id, json.dumps(e._asdict()).encode()) for e in events])
    conf = job_config(tmp_path, kafka_broker, topic, sink='ordering = "ts"\npartition_by = ["dt"]',
                      source='schema = "id STRING, dt STRING, ts BIGINT, op STRING, v STRING"')
    conf.write_text(conf.read_text() + "\n[job]\nmax_restarts = 0\n")
    run(str(conf), once=True)
    uri = str(tmp_path / "data" / "table")
    before = table_rows(uri, ["id", "dt", "ts", "op", "v"])
    assert before == expected_rows([events])
    admin = AdminClient({"bootstrap.servers": kafka_broker.bootstrap_servers})
    admin.delete_topics([topic])[topic].result(timeout=60)
    create_topic(kafka_broker, topic, partitions=1)  # recreated: its offsets start over, below the checkpoint's
    produce(kafka_broker, topic, [("late", json.dumps({**events[0]._asdict(), "id": "late"}).encode())])
    with pytest.raises(TablesFailedError, match=r"(?i)stopped after 1 failures in a row: .*(data (may have been )?"
                                                r"lost|failOnDataLoss)"):
        run(str(conf), once=True)
    assert table_rows(uri, ["id", "dt", "ts", "op", "v"]) == before


def test_the_key_from_the_message_key_and_a_record_of_another_tables_schema_quarantined(
        spark, kafka_broker, tmp_path):
    """key_schema: the value carries no id, the message key does (as JSON). A record of
    another table's schema parses to nulls and is quarantined for its null key, not written."""
    topic = "keyed-events"
    create_topic(kafka_broker, topic, partitions=2)
    (events,) = random_batches(9, batches=1, per_batch=200, bad_share=0)
    messages = [(json.dumps({"id": e.id}).encode(), json.dumps({k: v for k, v in e._asdict().items() if k != "id"})
                 .encode()) for e in events]
    messages.append((None, json.dumps({"sku": "x-1", "qty": 3}).encode()))
    produce(kafka_broker, topic, messages)
    conf = job_config(tmp_path, kafka_broker, topic, sink='ordering = "ts"\npartition_by = ["dt"]',
                      source='schema = "dt STRING, ts BIGINT, op STRING, v STRING"\nkey_schema = "id STRING"')
    run(str(conf), once=True)
    uri = str(tmp_path / "data" / "table")
    assert table_rows(uri, ["id", "dt", "ts", "op", "v"]) == expected_rows([events])
    assert quarantined(uri) == [("", "null key column id")]


def test_debezium_envelopes_without_the_converters_wrapper(spark, kafka_broker, tmp_path):
    """value.converter.schemas.enable = false: the value is the envelope itself."""
    topic = "unwrapped.public.orders"
    create_topic(kafka_broker, topic, partitions=1)
    rows = [{"id": f"o{i}", "dt": "2025-01-01", "v": f"v{i}"} for i in range(5)]
    messages = [(r["id"], json.loads(debezium_event("c", r, 10 + i))["payload"]) for i, r in enumerate(rows)]
    messages.append(("o1", json.loads(debezium_event("u", {**rows[1], "v": "new"}, 20, before=rows[1]))["payload"]))
    produce(kafka_broker, topic, [(k, json.dumps(p).encode()) for k, p in messages])
    conf = job_config(tmp_path, kafka_broker, topic, sink='ordering = "lsn"\npartition_by = ["dt"]',
                      source='schema = "op STRING, ts_ms BIGINT, source STRUCT<lsn: BIGINT>, '
                             'before STRUCT<id: STRING, dt: STRING, v: STRING>, '
                             'after STRUCT<id: STRING, dt: STRING, v: STRING>"\nenvelope = "debezium"')
    run(str(conf), once=True)
    expected = [{**r, "v": "new" if r["id"] == "o1" else r["v"]} for r in rows]
    assert table_rows(str(tmp_path / "data" / "table"), ["id", "dt", "v"]) == expected


def test_the_job_through_spark_connect_logs_its_kafka_lag(kafka_broker, tmp_path):
    """--remote local[2]: a query listener would run on the Connect server, away from the job's
    metrics, so the job reads its query's progress itself; the last batch's lag is logged."""
    topic = "connect-events"
    create_topic(kafka_broker, topic, partitions=2)
    (events,) = random_batches(9, batches=1, per_batch=200, bad_share=0)
    produce(kafka_broker, topic, [(e.id, json.dumps(e._asdict()).encode()) for e in events])
    conf = job_config(tmp_path, kafka_broker, topic, sink='ordering = "ts"\npartition_by = ["dt"]',
                      source='schema = "id STRING, dt STRING, ts BIGINT, op STRING, v STRING"\n'
                             'max_offsets_per_trigger = 100')
    job = [sys.executable, "-m", "jobs.upsert_stream", "--config", str(conf), "--once", "--remote", "local[2]"]
    done = subprocess.run(job, cwd=Path(__file__).resolve().parent.parent.parent, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert re.search(rf"kafka lag \S+ after batch \d+: 0 offsets behind \({topic}\[0\]=0, {topic}\[1\]=0\)",
                     done.stderr), done.stderr[-3000:]
    assert table_rows(str(tmp_path / "data" / "table"), ["id", "dt", "ts", "op", "v"]) == expected_rows([events])


def connect_event(topic: str, row: dict, lsn: int, fields: list[dict]) -> bytes:
    """A Debezium create as the JSON converter writes it, with its full Connect schema."""
    value = {"type": "struct", "optional": True, "name": f"{topic}.Value", "fields": fields}
    envelope = {"type": "struct", "name": f"{topic}.Envelope", "fields": [
        {**value, "field": "before"}, {**value, "field": "after"}, {"type": "string", "field": "op"},
        {"type": "struct", "field": "source", "fields": [{"type": "int64", "field": "lsn"}]}]}
    payload = {"before": None, "after": row, "op": "c", "source": {"lsn": lsn}}
    return json.dumps({"schema": envelope, "payload": payload}).encode()


def connect_key(topic: str, key: int) -> bytes:
    schema = {"type": "struct", "name": f"{topic}.Key", "fields": [{"type": "int32", "field": "id"}]}
    return json.dumps({"schema": schema, "payload": {"id": key}}).encode()


def test_a_value_that_does_not_decode_and_another_tables_message_are_quarantined_and_the_rest_applied(
        spark, kafka_broker, tmp_path):
    """No schema and no key in the config: Debezium creates whose amounts are Connect Decimals;
    one amount's bytes are not base64, one message carries another table's schema (and a
    field of its own). Both go to quarantine with their reason; every other row is written,
    decoded, and the other table's field never reaches this one."""
    topic = "produced.public.items"
    create_topic(kafka_broker, topic, partitions=2)
    fields = [{"type": "int32", "field": "id"}, {"type": "bytes", "name": "org.apache.kafka.connect.data.Decimal",
                                                 "parameters": {"scale": "2", "connect.decimal.precision": "9"},
                                                 "field": "amount"},
              {"type": "int32", "name": "io.debezium.time.Date", "field": "day"}]
    rows = [{"id": i, "amount": base64.b64encode((i * 1001 - 5000).to_bytes(4, "big", signed=True)).decode(),
             "day": i - 3} for i in range(8)]
    messages = [(connect_key(topic, r["id"]), connect_event(topic, r, 10 + r["id"], fields)) for r in rows]
    messages.append((connect_key(topic, 50), connect_event(topic, {"id": 50, "amount": "not base64!", "day": 1}, 60,
                                                           fields)))
    other = "produced.public.other"
    messages.append((connect_key(other, 51), connect_event(other, {"id": 51, "sku": "x"}, 61,
                                                           [{"type": "int32", "field": "id"},
                                                            {"type": "string", "field": "sku"}])))
    produce(kafka_broker, topic, messages)
    conf = job_config(tmp_path, kafka_broker, topic, sink='ordering = "lsn"',
                      source='envelope = "debezium"\nvalue_format = "json-with-schema"')
    conf.write_text(conf.read_text().replace('key = ["id"]\n', ""))
    (sink,) = run(str(conf), once=True)
    assert sink.config.key == ["id"]
    uri = str(tmp_path / "data" / "table")
    table = DeltaTable(uri)
    assert "sku" not in [f.name for f in table.schema().fields]
    got = sorted(table.to_pyarrow_table(columns=["id", "amount", "day"]).to_pylist(), key=lambda r: r["id"])
    assert got == [{"id": i, "amount": Decimal(i * 1001 - 5000).scaleb(-2), "day": dt.date(1970, 1, 1)
                    + dt.timedelta(days=i - 3)} for i in range(8)]
    reasons = sorted(r for _, r in quarantined(uri))
    decimal = "bytes org.apache.kafka.connect.data.Decimal(connect.decimal.precision=9, scale=2)"
    assert reasons == [f"corrupt record: cannot decode column after.amount ({decimal}) value not base64!",
                       f"corrupt record: cannot decode message: its Connect schema {other}.Envelope is of another "
                       f"table than {topic}.Envelope"]
