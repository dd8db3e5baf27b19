"""Debezium-shaped messages from a real Kafka broker into Delta (`python -m bench.run --kafka`).

- Throughput: a topic holding a snapshot read of every key and then updates of random keys
  is read from its start twice, `batch_offsets` offsets a batch: by a plain Kafka-to-Delta
  append query (the same decoding, Spark's Delta sink: the pipeline's floor) and by the ready
  job's sink. Records per second of each, and the sink's share of the floor.
- Freshness: the job runs with a processing-time trigger while a producer sends updates at
  half the sink's measured rate, each stamped with its send time as `ts_ms`; every batch's
  freshness (commit time minus `ts_ms`, sink.freshness) at the 99th percentile, against 3
  trigger intervals.
- Where the time goes: the sink's batch phases (medians over the throughput run's batches).
"""

from __future__ import annotations

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
ROW = "id BIGINT, note STRING, amount BIGINT"
SCHEMA = f"op STRING, ts_ms BIGINT, source STRUCT<lsn: BIGINT>, before STRUCT<{ROW}>, after STRUCT<{ROW}>"
# The JSON converter's wrapper (its schema abridged: the job reads the payload).
WRAPPER = '{"schema":{"type":"struct","name":"bench.Envelope"},"payload":%s}'


def event(op: str, key: int, lsn: int, ts_ms: int, note: str) -> bytes:
    row = {"id": key, "note": note, "amount": lsn % 10_000}
    payload = {"op": op, "ts_ms": ts_ms, "source": {"lsn": lsn}, "before": None, "after": row}
    return (WRAPPER % json.dumps(payload, separators=(",", ":"))).encode()


def producer(broker: KafkaBroker) -> Producer:
    return Producer({"bootstrap.servers": broker.bootstrap_servers, "linger.ms": 20, "batch.size": 1_000_000,
                     "compression.type": "lz4", "queue.buffering.max.messages": 1_000_000})


def send(out: Producer, messages) -> int:
    n = 0
    for key, value in messages:
        while True:
            try:
                out.produce(TOPIC, key=str(key).encode(), value=value)
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
schema = "{SCHEMA}"
envelope = "debezium"
value_format = "json-with-schema"
max_offsets_per_trigger = {batch_offsets}

[job]
trigger_seconds = {trigger_seconds}
""")
    return conf


def plain_append(spark, conf: Path, work: Path) -> float:
    """Seconds for the plain query to append the whole topic to a Delta table."""
    from jobs.job_config import load_job_config
    from jobs.upsert_stream import source_stream

    cfg = load_job_config(conf)
    stream = source_stream(spark, cfg).drop(cfg.corrupt_record_column)
    started = time.perf_counter()
    query = (stream.writeStream.format("delta").option("checkpointLocation", str(work / "append" / "checkpoint"))
             .trigger(availableNow=True).start(str(work / "append" / "table")))
    query.awaitTermination()
    return time.perf_counter() - started


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
            out.produce(TOPIC, key=str(key).encode(), value=event("u", key, lsn, now_ms, f"p{lsn}"))
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
            "paced": {"rate_per_second": round(rate), "seconds": paced_seconds, "sent": sent,
                      "trigger_seconds": trigger_seconds, "batches": len(p99),
                      "freshness_p99_seconds": p99, "freshness_p99_max": max(p99, default=None),
                      "within_3_triggers": bool(p99) and max(p99) < 3 * trigger_seconds},
        }
    finally:
        broker.stop()
