"""Partitioned scope: deletes that carry only the key (Debezium's default replica identity
sends `before` with the key alone, so a partition derived from the row is null) are placed
where the key lives, or quarantined loudly when that is ambiguous (issue: CDC feeds, point 2)."""

import logging
import random

import pytest
from deltalake import DeltaTable
from prometheus_client import REGISTRY

from sink import SinkConfig, UpsertSink

pytestmark = pytest.mark.spark

SCHEMA = "id INT, month STRING, ts INT, op STRING, v STRING"


def config(tmp_path, index="index", **extra):
    options = {"writer_id": "orders", **extra}
    return SinkConfig(table_uri=str(tmp_path / "orders"), key=["id"], partition_by=["month"], ordering="ts",
                      delete_when="op = 'd'", index_dir=str(tmp_path / index), num_shards=2, metrics_port=0,
                      **options)


def rows(uri):
    return sorted((r["id"], r["month"], r["ts"], r["v"]) for r in DeltaTable(uri).to_pyarrow_table().to_pylist())


@pytest.mark.parametrize("tag_on", ["driver", "executors"])
def test_key_only_deletes_are_applied_where_the_key_is_and_quarantined_where_ambiguous(spark, tmp_path, caplog,
                                                                                      tag_on):
    cfg = config(tmp_path, tag_on=tag_on)
    seed = [(1, "2025-06", 1, "u", "a"), (2, "2025-06", 5, "u", "b"), (3, "2025-06", 1, "u", "c"),
            (4, "2025-07", 1, "u", "d"), (7, "2025-06", 1, "u", "x"), (7, "2025-07", 1, "u", "y")]
    UpsertSink(cfg)(spark.createDataFrame(seed, SCHEMA), 0)

    # A new replica (the old one lost): no partition is held, every one must be looked at.
    sink = UpsertSink(config(tmp_path, index="index-2", tag_on=tag_on))
    deletes = [(1, None, 3, "d", None),  # in 2025-06 only
               (4, None, 3, "d", None),  # in 2025-07 only
               (2, None, 3, "d", None),  # in 2025-06, older than the stored row: stale
               (7, None, 3, "d", None),  # in both: ambiguous
               (99, None, 3, "d", None),  # nowhere
               (5, None, 2, "d", None), (5, "2025-07", 1, "u", "e")]  # an insert of this batch, then its delete
    with caplog.at_level(logging.WARNING, logger="sink"):
        sink(spark.createDataFrame(deletes, SCHEMA), 1)
    report = sink.reports[-1]
    assert rows(cfg.table_uri) == [(2, "2025-06", 5, "b"), (3, "2025-06", 1, "c"), (7, "2025-06", 1, "x"),
                                   (7, "2025-07", 1, "y")]
    assert report.without_partition == {"located": 4, "unknown": 1, "ambiguous": 1, "upsert": 0}
    assert {k: report.ops[k] for k in ("delete", "stale", "delete_missing", "superseded", "quarantined")} == {
        "delete": 2, "stale": 1, "delete_missing": 2, "superseded": 1, "quarantined": 1}
    quarantine = DeltaTable(cfg.resolved_quarantine_uri).to_pyarrow_table().to_pylist()
    assert [(r["id"], r["_quarantine_reason"].split(":")[0]) for r in quarantine] == [
        (7, "ambiguous delete without a partition")]
    assert "2 partitions (month=2025-06, month=2025-07)" in quarantine[0]["_quarantine_reason"]
    warnings = [r.getMessage() for r in caplog.records if "null partition column" in r.getMessage()]
    assert len(warnings) == 1 and "1 record(s)" in warnings[0] and "scope = 'global'" in warnings[0]

    # Late, older upserts of deleted keys stay deleted, also for the key no partition held
    # (its delete is remembered under the null partition) and on yet another new replica.
    late = UpsertSink(config(tmp_path, index="index-3", tag_on=tag_on))
    late(spark.createDataFrame([(1, "2025-06", 2, "u", "late"), (99, "2025-06", 2, "u", "late"),
                                (99, "2025-07", 1, "u", "late"), (5, "2025-07", 1, "u", "late"),
                                (4, "2025-07", 4, "u", "new")], SCHEMA), 2)
    assert late.reports[-1].ops["stale"] == 4
    assert rows(cfg.table_uri) == [(2, "2025-06", 5, "b"), (3, "2025-06", 1, "c"), (4, "2025-07", 4, "new"),
                                   (7, "2025-06", 1, "x"), (7, "2025-07", 1, "y")]


def test_upserts_without_a_partition_are_quarantined_with_one_warning_and_a_metric(spark, tmp_path, caplog):
    def metric(outcome):
        return REGISTRY.get_sample_value("upsert_sink_records_without_partition_total",
                                         {"sink": "warned", "outcome": outcome})

    cfg = config(tmp_path, writer_id="warned")
    sink = UpsertSink(cfg)
    assert [metric(o) for o in ("located", "unknown", "ambiguous", "upsert")] == [0, 0, 0, 0]
    with caplog.at_level(logging.WARNING, logger="sink"):
        sink(spark.createDataFrame([(1, None, 1, "u", "a"), (2, None, 1, "u", "b"), (3, "2025-06", 1, "u", "c")],
                                   SCHEMA), 0)
    assert sink.reports[-1].without_partition == {"located": 0, "unknown": 0, "ambiguous": 0, "upsert": 2}
    assert [metric(o) for o in ("located", "unknown", "ambiguous", "upsert")] == [0, 0, 0, 2]
    warnings = [r.getMessage() for r in caplog.records if "null partition column" in r.getMessage()]
    assert len(warnings) == 1 and "2 record(s)" in warnings[0]


def oracle(events):
    """Each key's newest event (keys live in one partition each): a row, or nothing if a delete."""
    newest = {}
    for e in events:
        if e[0] not in newest or e[2] > newest[e[0]][2]:
            newest[e[0]] = e
    return sorted((i, m, ts, v) for i, m, ts, op, v in newest.values() if op != "d")


@pytest.mark.parametrize(("seed", "tag_on"), [(3, "driver"), (11, "driver"), (5, "executors")])
def test_random_key_only_deletes_late_events_and_lost_replicas_match_the_oracle(spark, tmp_path, seed, tag_on):
    """Every key lives in one month; deletes name no month; events arrive shuffled over the
    batches (late ones older than what is stored); every other batch runs on a new replica."""
    rng = random.Random(seed)
    months = ["2025-05", "2025-06", "2025-07"]
    events, ts = [], 0
    for _ in range(600):
        key = rng.randrange(120)
        ts += 1
        if rng.random() < 0.3:
            events.append((key, None, ts, "d", None))
        else:
            events.append((key, months[key % 3], ts, "u", f"v{ts}"))
    rng.shuffle(events)
    batches = [events[i:i + 100] for i in range(0, len(events), 100)]
    for b, batch in enumerate(batches):
        sink = UpsertSink(config(tmp_path, index=f"index-{b // 2}", tag_on=tag_on))
        sink(spark.createDataFrame(batch, SCHEMA), b)
        assert rows(sink.config.table_uri) == oracle([e for seen in batches[:b + 1] for e in seen]), f"batch {b}"
        assert sink.reports[-1].without_partition["ambiguous"] == 0
