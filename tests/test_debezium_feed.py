"""A Debezium-shaped change feed through the ready job, checked against an independent oracle
after every run: a snapshot, creates, updates, key-only deletes (the default replica identity
sends only the key in `before`), re-delivered events, late files and a corrupt value."""

import datetime as dt
import json
import random

import pytest
from deltalake import DeltaTable

from jobs.upsert_stream import run
from tests.test_corrupt_records import CORRUPT, drop

pytestmark = pytest.mark.spark

ROW = "shop_id BIGINT, order_id BIGINT, total_cents BIGINT, status STRING, created_at TIMESTAMP"
CONFIG = f"""
[sink]
table_uri = "data/orders"
key = ["shop_id", "order_id"]
partition_by = ["created_month"]
ordering = "lsn"
delete_when = "op = 'd'"
except_columns = ["op"]
checkpoint_dir = "data/checkpoint"
index_dir = "data/index"
metrics_port = 0
partition_date_format = "%Y-%m"
# An LSN names one change: a record with the stored LSN is a re-delivery, nothing to write.
ties = "existing"

[source]
format = "json"
path = "data/landing"
schema = "op STRING, ts_ms BIGINT, source STRUCT<lsn: BIGINT, txId: BIGINT>, before STRUCT<{ROW}>, after STRUCT<{ROW}>"
max_files_per_trigger = 1
select = [
  "coalesce(after.shop_id, before.shop_id) AS shop_id",
  "coalesce(after.order_id, before.order_id) AS order_id",
  "date_format(after.created_at, 'yyyy-MM') AS created_month",
  "source.lsn AS lsn",
  "op",
  "after.total_cents AS total_cents",
  "after.status AS status",
  "after.created_at AS created_at",
]
"""


# The same feed through the job's Debezium preset: the envelope flattened by the job, the month
# derived from the flat columns; re-deliveries win their ties and change nothing (unchanged).
PRESET = CONFIG.split("select = [")[0].replace('except_columns = ["op"]', 'except_columns = ["op", "ts_ms"]').replace(
    'ties = "existing"', 'ties = "incoming"') + """\
envelope = "debezium"
select = ["*", "date_format(created_at, 'yyyy-MM') AS created_month"]
"""


def envelope(op, lsn, key, row=None):
    """A Debezium change event: deletes carry only the key in `before`."""
    return {"op": op, "ts_ms": 1_750_000_000_000 + lsn, "source": {"lsn": lsn, "txId": lsn // 3},
            "before": {"shop_id": key[0], "order_id": key[1]} if op == "d" else None, "after": row}


def feed(seed, orders=80, changes=500):
    """Events in commit (LSN) order, each with its key and the row it leaves (None: deleted)."""
    rng = random.Random(seed)
    created = {(shop, order): dt.datetime(2025, rng.choice([5, 6, 7]), rng.randint(1, 28), 9, tzinfo=dt.UTC)
               for shop in (1, 2) for order in range(orders // 2)}
    keys, lsn, events, live = sorted(created), 0, [], set()

    def row(key):
        return {"shop_id": key[0], "order_id": key[1], "total_cents": rng.randrange(100, 90_000),
                "status": rng.choice(["new", "paid", "shipped"]), "created_at": created[key].isoformat()}

    for key in keys[: len(keys) // 2]:  # the initial snapshot
        lsn += 1
        events.append((envelope("r", lsn, key, row(key)), key))
        live.add(key)
    for _ in range(changes):
        key = rng.choice(keys)
        lsn += rng.randint(1, 3)
        if key not in live:
            events.append((envelope("c", lsn, key, row(key)), key))
            live.add(key)
        elif rng.random() < 0.2:
            events.append((envelope("d", lsn, key), key))
            live.discard(key)
        else:
            events.append((envelope("u", lsn, key, row(key)), key))
    return events


def files_of(events, seed, files=6):
    """Events cut into files in LSN order, then disordered as a transport does: some events
    arrive two files late, some are delivered twice (the same LSN again, a file later)."""
    rng = random.Random(seed)
    size = len(events) // files + 1
    out = [events[i:i + size] for i in range(0, len(events), size)]
    for i in range(files - 2):
        late = [e for e in out[i] if rng.random() < 0.1]
        out[i] = [e for e in out[i] if e not in late]
        out[i + 2] += late
    for i in range(files - 1):
        out[i + 1] += [e for e in out[i] if rng.random() < 0.05]
    return out


def oracle(events):
    """Per key the event with the highest LSN: its row, or nothing if it deleted the key."""
    newest = {}
    for event, key in events:
        if key not in newest or event["source"]["lsn"] > newest[key]["source"]["lsn"]:
            newest[key] = event
    return sorted((e["after"]["shop_id"], e["after"]["order_id"], e["after"]["total_cents"], e["after"]["status"],
                   e["after"]["created_at"][:7], e["source"]["lsn"]) for e in newest.values() if e["op"] != "d")


def table(uri):
    return sorted((r["shop_id"], r["order_id"], r["total_cents"], r["status"], r["created_month"], r["lsn"])
                  for r in DeltaTable(uri).to_pyarrow_table().to_pylist())


@pytest.mark.parametrize("config", [CONFIG, PRESET], ids=["select", "envelope"])
def test_a_debezium_feed_through_the_ready_job_matches_the_oracle_after_every_run(spark, tmp_path, config):
    conf = tmp_path / "sink.toml"
    conf.write_text(config)
    landing, uri = tmp_path / "data" / "landing", str(tmp_path / "data" / "orders")
    files = files_of(feed(7), seed=8)
    # Orders created and deleted whose creates come in a later file than their deletes: the
    # deletes find no row in any partition, and the late creates must stay out.
    for n in range(3):
        key = (3, n)
        row = {"shop_id": 3, "order_id": n, "total_cents": 100, "status": "new",
               "created_at": "2025-06-02T09:00:00+00:00"}
        files[1].append((envelope("d", 10_001 + 2 * n, key), key))
        files[5].append((envelope("c", 10_000 + 2 * n, key, row), key))
    # A value of the wrong type in a late update: quarantined with its line, never applied.
    bad_event = next(e for e, _ in files[4] if e["op"] == "u")
    bad_line = json.dumps(bad_event).replace(f'"total_cents": {bad_event["after"]["total_cents"]}',
                                             '"total_cents": "12,50"')
    applied, reports = [], []
    for i, chunk in enumerate(files):
        lines = [json.dumps(e) if e is not bad_event else bad_line for e, _ in chunk]
        drop(landing, f"f{i}.json", lines)
        (sink,) = run(str(conf), once=True)
        reports += sink.reports
        applied += [(e, k) for e, k in chunk if e is not bad_event]
        assert table(uri) == oracle(applied), f"after file {i}"
    assert all(r.without_partition["ambiguous"] == r.without_partition["upsert"] == 0 for r in reports)
    quarantine = DeltaTable(sink.config.resolved_quarantine_uri).to_pyarrow_table().to_pylist()
    assert [(r["_corrupt_record"], r["_quarantine_reason"]) for r in quarantine] == [(bad_line, CORRUPT)]
    assert sum(r.without_partition["located"] for r in reports) > 0  # key-only deletes found their rows
    assert sum(r.without_partition["unknown"] for r in reports) >= 3
    if config is PRESET:  # ties = "incoming": the re-delivered events wrote nothing
        assert sum(r.ops["unchanged"] for r in reports) > 0
