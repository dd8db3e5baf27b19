"""Debezium-shaped messages from a real Kafka broker into Delta (`python -m bench.run --kafka`).

- Messages as Debezium sends them at its defaults: a decimal as Connect's base64 bytes, a date
  as days, instants as text and microseconds, JSON, each message wrapped in its Connect schema
  (the job's config names the key only).
- Throughput: a topic holding a snapshot read of every key and then updates of random keys
  is read from its start twice, `batch_offsets` offsets a batch: by a plain Kafka-to-Delta
  append query (the same decoding, Spark's Delta writer: the pipeline's floor) and by the ready
  job's sink. Records per second of each, and the sink's share of the floor.
- Decoding: seconds per 100k messages to parse them decoded by their Connect types, against
  reading every value as sent.
- Freshness: the job runs with a processing-time trigger while a producer sends updates at
  half the sink's measured rate, each stamped with its send time as `ts_ms`; every batch's
  freshness (commit time minus `ts_ms`, sink.freshness) at the 99th percentile, against 3
  trigger intervals.
- Where the time goes: the sink's batch phases (medians over the throughput run's batches).
"""

from __future__ import annotations

import base64
import json
import random
import statistics
import threading
import time
from pathlib import Path

from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient, NewTopic

from tests.cdc_stack import KafkaBroker

TOPIC = "bench.public.orders"
PARTITIONS = 2
# The row as Debezium sends it at its defaults (precise decimals, adaptive time precision),
# with the JSON converter's schema: the job decodes each value by it (jobs.connect_types).
ROW_FIELDS = [
    {"type": "int64", "optional": False, "field": "id"},
    {"type": "string", "optional": True, "field": "note"},
    {"type": "bytes", "optional": True, "name": "org.apache.kafka.connect.data.Decimal", "version": 1,
     "parameters": {"scale": "2", "connect.decimal.precision": "12"}, "field": "amount"},
    {"type": "int32", "optional": True, "name": "io.debezium.time.Date", "version": 1, "field": "placed"},
    {"type": "string", "optional": True, "name": "io.debezium.time.ZonedTimestamp", "version": 1, "field": "at"},
    {"type": "int64", "optional": True, "name": "io.debezium.time.MicroTimestamp", "version": 1, "field": "seen"},
    {"type": "string", "optional": True, "name": "io.debezium.data.Json", "version": 1, "field": "doc"},
]
ROW_SCHEMA = {"type": "struct", "optional": True, "name": "bench.public.orders.Value", "fields": ROW_FIELDS}
ENVELOPE = {"type": "struct", "optional": False, "name": "bench.public.orders.Envelope", "fields": [
    {**ROW_SCHEMA, "field": "before"}, {**ROW_SCHEMA, "field": "after"},
    {"type": "struct", "optional": False, "name": "io.debezium.connector.postgresql.Source", "field": "source",
     "fields": [{"type": "int64", "optional": True, "field": "lsn"}]},
    {"type": "string", "optional": False, "field": "op"}, {"type": "int64", "optional": True, "field": "ts_ms"}]}
KEY_SCHEMA = {"type": "struct", "optional": False, "name": "bench.public.orders.Key",
              "fields": [{"type": "int64", "optional": False, "field": "id"}]}
WRAPPER = '{"schema":' + json.dumps(ENVELOPE, separators=(",", ":")) + ',"payload":%s}'
KEY_WRAPPER = '{"schema":' + json.dumps(KEY_SCHEMA, separators=(",", ":")) + ',"payload":{"id":%d}}'


def decimal_bytes(unscaled: int) -> str:
    """Connect's Decimal in JSON: base64 of the unscaled value's big-endian two's complement."""
    return base64.b64encode(unscaled.to_bytes(max(1, (unscaled.bit_length() + 8) // 8), "big", signed=True)).decode()


def event(op: str, key: int, lsn: int, ts_ms: int, note: str) -> bytes:
    row = {"id": key, "note": note, "amount": decimal_bytes(lsn % 10_000_000), "placed": 19_000 + lsn % 1000,
           "at": "2026-12-02T10:15:30.123456Z", "seen": 1_764_670_530_123_456 + lsn, "doc": f'{{"lsn":{lsn}}}'}
    payload = {"op": op, "ts_ms": ts_ms, "source": {"lsn": lsn}, "before": None, "after": row}
    return (WRAPPER % json.dumps(payload, separators=(",", ":"))).encode()


def message_key(key: int) -> bytes:
    return (KEY_WRAPPER % key).encode()


def producer(broker: KafkaBroker) -> Producer:
    return Producer({"bootstrap.servers": broker.bootstrap_servers, "linger.ms": 20, "batch.size": 1_000_000,
                     "compression.type": "lz4", "queue.buffering.max.messages": 1_000_000})


def send(out: Producer, messages) -> int:
    n = 0
    for key, value in messages:
        while True:
            try:
                out.produce(TOPIC, key=message_key(key), value=value)
                break
            except BufferError:  # the local queue is full: let it drain
                out.poll(0.05)
        n += 1
    out.flush(120)
    return n


def job_config(work: Path, broker: KafkaBroker, name: str, *, batch_offsets: int, trigger_seconds: int) -> Path:
    conf = work / f"{name}.toml"
    conf.write_text(f"""
[sink]
table_uri = "{work / name / 'table'}"
key = ["id"]
ordering = "lsn"
delete_when = "op = 'd'"
except_columns = ["op", "ts_ms"]
checkpoint_dir = "{work / name / 'checkpoint'}"
index_dir = "{work / name / 'index'}"
metrics_port = 0

[source]
format = "kafka"
bootstrap_servers = "{broker.bootstrap_servers}"
topics = ["{TOPIC}"]
envelope = "debezium"
value_format = "json-with-schema"
max_offsets_per_trigger = {batch_offsets}

[job]
trigger_seconds = {trigger_seconds}
""")
    return conf


class DeltaAppend:
    """What the job hands a decoded batch to, for the plain query: Spark's Delta writer appends
    it (no key, no index, no dedup: the pipeline's floor)."""

    def __init__(self, config, uri: str):
        self.config, self.uri, self.writer_id = config, uri, "plain-append"

    def __call__(self, df, batch_id: int) -> None:
        df.write.format("delta").mode("append").save(self.uri)


def plain_append(spark, conf: Path, work: Path) -> float:
    """Seconds for the plain query to append the whole topic to a Delta table, its messages
    decoded as the job decodes them (jobs.upsert_stream.DecodedPerBatch)."""
    from jobs.job_config import load_job_config
    from jobs.upsert_stream import DecodedPerBatch, kafka_stream, resolved

    cfg = load_job_config(conf)
    (sink,), (src,) = cfg.sinks, cfg.sources
    sink, schema = resolved(spark, cfg, sink, src)
    append = DeltaAppend(sink, str(work / "append" / "table"))
    started = time.perf_counter()
    query = (kafka_stream(spark, cfg, src).writeStream.foreachBatch(DecodedPerBatch(append, cfg, src, schema))
             .option("checkpointLocation", str(work / "append" / "checkpoint")).trigger(availableNow=True).start())
    query.awaitTermination()
    return time.perf_counter() - started


def decoding_cost(spark, conf: Path, messages: int) -> dict:
    """Seconds per 100k messages to parse the topic's first `messages` with their values
    decoded by their Connect types, and with every value read as sent (its wire form), the
    difference being the decoding's cost (a noop write: no Delta, no sink)."""
    from jobs import kafka_source
    from jobs.job_config import load_job_config
    from jobs.upsert_stream import resolved

    cfg = load_job_config(conf)
    (sink,), (src,) = cfg.sinks, cfg.sources
    sink, schema = resolved(spark, cfg, sink, src)
    options = {k: v for k, v in src.reader_options().items() if k not in ("startingOffsets", "maxOffsetsPerTrigger")}
    raw = spark.read.format("kafka").options(**options, startingOffsets="earliest").load().limit(messages).cache()
    raw.count()
    (group,) = kafka_source.schema_groups(kafka_source.message_schemas(raw)[0])
    seconds = {}
    for name, connect in (("decoded", group.merged), ("as_sent", None)):
        wire = schema if connect else kafka_source.wire_schema(schema, group.merged)
        frame = kafka_source.decoded(raw, wire, value_format=src.value_format, key_schema=None,
                                     corrupt_column=cfg.corrupt_record_column, connect=connect)
        runs = []
        for _ in range(3):
            started = time.perf_counter()
            frame.write.format("noop").mode("overwrite").save()
            runs.append(time.perf_counter() - started)
        seconds[name] = min(runs) * 100_000 / messages
    raw.unpersist()
    return {"messages": messages, "seconds_per_100k": {k: round(v, 3) for k, v in seconds.items()},
            "decoding_seconds_per_100k": round(seconds["decoded"] - seconds["as_sent"], 3)}


def paced(broker: KafkaBroker, keys: int, rate: float, seconds: float, first_lsn: int) -> int:
    """Updates of random keys at `rate` a second for `seconds`, each stamped with its send time."""
    out, rng = producer(broker), random.Random(7)
    sent, started, lsn = 0, time.monotonic(), first_lsn
    while (elapsed := time.monotonic() - started) < seconds:
        due = int(elapsed * rate) - sent
        now_ms = int(time.time() * 1000)
        for _ in range(due):
            lsn += 1
            key = rng.randrange(keys)
            out.produce(TOPIC, key=message_key(key), value=event("u", key, lsn, now_ms, f"p{lsn}"))
        sent += max(due, 0)
        out.poll(0)
        time.sleep(0.01)  # pacing the producer, not synchronising with the job
    out.flush(120)
    return sent


def run(spark, work: Path, *, keys: int, updates: int, batch_offsets: int, trigger_seconds: int,
        paced_seconds: int) -> dict:
    from jobs.upsert_stream import run as run_job

    broker = KafkaBroker.start(work / "broker")
    try:
        admin = AdminClient({"bootstrap.servers": broker.bootstrap_servers})
        admin.create_topics([NewTopic(TOPIC, num_partitions=PARTITIONS, replication_factor=1)])[TOPIC].result(60)
        rng, now_ms = random.Random(11), int(time.time() * 1000)
        started = time.perf_counter()
        records = send(producer(broker), ((k, event("r", k, 1, now_ms, "snapshot")) for k in range(keys)))
        records += send(producer(broker), ((k, event("u", k, 2 + i, now_ms, f"u{i}"))
                                           for i, k in enumerate(rng.randrange(keys) for _ in range(updates))))
        produce_seconds = time.perf_counter() - started
        print(f"kafka: {records:,} messages produced in {produce_seconds:.1f} s", flush=True)

        conf = job_config(work, broker, "sink", batch_offsets=batch_offsets, trigger_seconds=trigger_seconds)
        decoding = decoding_cost(spark, conf, min(records, 200_000))
        print(f"kafka: decoding {decoding['decoding_seconds_per_100k']} s per 100k messages", flush=True)
        append_seconds = plain_append(spark, conf, work)
        print(f"kafka: plain append {records / append_seconds:,.0f} records/s", flush=True)
        started = time.perf_counter()
        (sink,) = run_job(str(conf), once=True)
        sink_seconds = time.perf_counter() - started
        print(f"kafka: sink {records / sink_seconds:,.0f} records/s", flush=True)
        batches = [r for r in sink.reports if r.mode != "skipped"]
        phases = {p: round(statistics.median(r.phases[p] for r in batches), 3) for p in batches[0].phases}

        # Freshness: the job keeps running on the same checkpoint while updates arrive at half
        # the sink's rate; it is stopped once the producer is done and two more triggers ran.
        # Its batches are not capped below what a trigger interval brings (that would measure
        # the cap).
        rate = records / sink_seconds / 2
        paced_conf = job_config(work, broker, "sink", batch_offsets=max(batch_offsets, int(3 * rate * trigger_seconds)),
                                trigger_seconds=trigger_seconds)
        result: dict = {}
        job = threading.Thread(target=lambda: result.setdefault("sinks", run_job(str(paced_conf), once=False)))
        job.start()
        sent = paced(broker, keys, rate, paced_seconds, first_lsn=2 + updates)
        time.sleep(2 * trigger_seconds)  # let the last sends reach a batch: measuring, not synchronising
        for query in spark.streams.active:
            query.stop()
        job.join()
        (live,) = result["sinks"]
        p99 = [r.freshness["0.99"] for r in live.reports if r.freshness]
        return {
            "keys": keys, "messages": records, "batch_offsets": batch_offsets, "partitions": PARTITIONS,
            "produce_seconds": round(produce_seconds, 1),
            "plain_append": {"seconds": round(append_seconds, 1),
                             "records_per_second": round(records / append_seconds)},
            "sink": {"seconds": round(sink_seconds, 1), "records_per_second": round(records / sink_seconds),
                     "batches": len(batches), "phases_median": phases,
                     "tag_steps_median": {s: round(statistics.median(r.tag_steps[s] for r in batches), 3)
                                          for s in batches[0].tag_steps}},
            "sink_share_of_append": round(append_seconds / sink_seconds, 3),
            "decoding": decoding,
            "paced": {"rate_per_second": round(rate), "seconds": paced_seconds, "sent": sent,
                      "trigger_seconds": trigger_seconds, "batches": len(p99),
                      "freshness_p99_seconds": p99, "freshness_p99_max": max(p99, default=None),
                      "within_3_triggers": bool(p99) and max(p99) < 3 * trigger_seconds},
        }
    finally:
        broker.stop()
