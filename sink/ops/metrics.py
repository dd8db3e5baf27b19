"""Prometheus metrics of the sink, published on the driver (listed on the docs' Monitoring page)."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterable

from prometheus_client import Counter, Gauge, Histogram, start_http_server

from sink.errors import SinkError
from sink.lakehouse.engines.delta_rs import COMMIT_KINDS
from sink.tagging import placement
from sink.tagging.task_stats import LOAD_REASONS

_LABEL = ["sink"]

LOOKUPS = Counter(
    "upsert_sink_index_lookups", "Index lookups of distinct batch keys, by result and the tier that answered",
    [*_LABEL, "result", "tier"],
)
PARTITION_LOADS = Counter(
    "upsert_sink_index_partition_loads", "Partitions loaded into replicas, by cause: bootstrap, on_demand, invalidated",
    [*_LABEL, "reason"],
)
PARTITION_PEEKS = Counter(
    "upsert_sink_index_partition_peeks",
    "Partitions not held read for a batch's few keys of them instead of loaded (peek_max_keys)", _LABEL,
)
SHARD_MOVES = Counter(
    "upsert_sink_index_shard_moves",
    "Shard replicas found behind on batches of this writer tagged on another executor", _LABEL,
)
CHANGELOG_APPLIED = Counter(
    "upsert_sink_index_changelog_entries_applied", "Index changelog entries applied by catching-up replicas",
    _LABEL,
)
REPLICA_SNAPSHOTS = Counter(
    "upsert_sink_index_replica_snapshots",
    "Shard replica snapshots published, and replicas that started from one instead of reading the table "
    "(replica_snapshot_every_versions)", [*_LABEL, "event"],
)
REPLICAS_REPAIRED = Counter(
    "upsert_sink_index_replicas_repaired", "Shard replicas found damaged, wiped and rebuilt from the table", _LABEL,
)
KEYS_IN_SEVERAL_PARTITIONS = Counter(
    "upsert_sink_keys_in_several_partitions",
    "Keys with records in several partitions of one batch (each partition keeps its own row)", _LABEL,
)
KEYS_IN_OTHER_PARTITION = Counter(
    "upsert_sink_keys_in_other_partition",
    "New keys (of those checked) already stored as a row of another partition; each partition keeps "
    "its own row", _LABEL,
)
WITHOUT_PARTITION = Counter(
    "upsert_sink_records_without_partition",
    "Records with a null partition column (partitioned scope), by outcome: deletes located in the one partition "
    "holding their key, deletes of unknown keys, and, quarantined, ambiguous deletes and upserts",
    [*_LABEL, "outcome"],
)
VERIFIED_KEYS = Counter(
    "upsert_sink_index_verified_keys", "Keys the sampled verification compared between a replica and the tables",
    _LABEL,
)
VERIFY_MISMATCHES = Counter(
    "upsert_sink_index_verify_mismatches",
    "Keys on which a replica disagreed with the tables (sampled verification); their partitions were reloaded",
    _LABEL,
)
LOAD_FAILURES = Counter(
    "upsert_sink_index_load_failures", "Batches failed by a partition that would not load", _LABEL
)
EVICTIONS = Counter("upsert_sink_index_evictions", "Partitions evicted from replicas", _LABEL)
PARTITIONS_HELD = Gauge(
    "upsert_sink_index_partitions", "Partitions held by the replicas the latest batch used", _LABEL
)
CACHED_RECORDS = Gauge(
    "upsert_sink_index_cached_records", "Entries in the replicas the latest batch used", _LABEL
)
CACHED_BYTES = Gauge(
    "upsert_sink_index_cached_bytes", "Bytes of the replicas the latest batch used", _LABEL
)
LATEST_LOAD_SECONDS = Gauge(
    "upsert_sink_index_latest_load_seconds", "Seconds the latest batch spent loading partitions", _LABEL
)
RECORDS = Counter("upsert_sink_records", "Input records by operation", [*_LABEL, "op"])
VERSIONS = Counter(
    "upsert_sink_history_versions",
    "scd_type = 2: version rows of the batches' keys' rebuilt histories written, stored ones they replaced, "
    "and versions opened, closed and split by a late event",
    [*_LABEL, "change"],
)
VERSION_CHANGES = ("written", "replaced", "opened", "closed", "split")
BATCH_SECONDS = Histogram(
    "upsert_sink_batch_seconds", "Batch phase durations", [*_LABEL, "phase"],
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
)
FRESHNESS = Gauge(
    "upsert_sink_freshness_seconds",
    "freshness_column: the latest committed batch's records' end-to-end freshness (commit time minus source time) "
    "at quantiles 0.5, 0.99 and 1 (the oldest record)", [*_LABEL, "quantile"],
)
KAFKA_LAG = Gauge(
    "upsert_sink_kafka_lag", "Kafka sources of the ready job: offsets behind the newest, per topic-partition, after "
    "the latest batch", [*_LABEL, "topic", "partition"],
)
QUERY_FAILURES = Counter(
    "upsert_sink_query_failures_total", "The ready job: failures of a table's query (each restarted after a backoff, "
    "the other tables going on)", _LABEL,
)
TABLE_VERSION = Gauge("upsert_sink_table_version", "Delta version of the latest commit", _LABEL)
COMMITS = Counter("upsert_sink_commits", "Delta commits by mode", [*_LABEL, "mode"])
FILES_CHANGED = Counter(
    "upsert_sink_files_changed", "Stored files the commits changed: rows marked in a deletion vector (marked), or the "
    "file replaced by a new one or removed (rewritten)", [*_LABEL, "how"],
)
COMMIT_RETRIES = Counter("upsert_sink_commit_retries", "Commits retried after a conflict", _LABEL)
BATCHES_SKIPPED = Counter(
    "upsert_sink_batches_skipped", "Batches skipped as already committed", _LABEL
)

_served_ports: set[int] = set()
_serve_lock = threading.Lock()


def serve(port: int) -> None:
    """Start the driver's endpoint on `port` once per process (0 = off)."""
    if port == 0:
        return
    with _serve_lock:
        if port in _served_ports:
            return
        try:
            start_http_server(port)
        except OSError as e:
            raise _unusable(port, e) from e
        _served_ports.add(port)


def check_port(port: int) -> None:
    """Fail now, before anything else runs, when `serve(port)` would fail (0 = off)."""
    if port == 0 or port in _served_ports:
        return
    with socket.socket() as probe:
        try:
            probe.bind(("", port))  # where start_http_server listens
        except OSError as e:
            raise _unusable(port, e) from e


def _unusable(port: int, error: OSError) -> SinkError:
    return SinkError(f"metrics_port = {port}: cannot serve Prometheus metrics there ({error}); choose a free port, "
                     "or 0 to turn the endpoint off")


# The (result, tier) pairs `publish` counts lookups under.
LOOKUP_LABELS = (("hit", "memory"), ("hit", "rocksdb"), ("miss", "rocksdb"), ("miss", "filter"), ("hit", "table"),
                 ("miss", "table"))


def start(sink: str, ops: Iterable[str]) -> None:
    """Show every counter of `sink`, with every label value it is published under (`ops`:
    the record outcomes), at 0 from the start: a rate or increase() alert needs the series to
    exist before its first increment, and a process's first batch is often the one that matters."""
    for counter in (LOAD_FAILURES, BATCHES_SKIPPED, COMMIT_RETRIES, REPLICAS_REPAIRED, KEYS_IN_SEVERAL_PARTITIONS,
                    KEYS_IN_OTHER_PARTITION, EVICTIONS, SHARD_MOVES, CHANGELOG_APPLIED, PARTITION_PEEKS, VERIFIED_KEYS,
                    VERIFY_MISMATCHES):
        counter.labels(sink)
    for mode in COMMIT_KINDS:
        COMMITS.labels(sink, mode)
    for how in ("marked", "rewritten"):
        FILES_CHANGED.labels(sink, how)
    for event in ("published", "restored"):
        REPLICA_SNAPSHOTS.labels(sink, event)
    for outcome in placement.WITHOUT_PARTITION:
        WITHOUT_PARTITION.labels(sink, outcome)
    for op in ops:
        RECORDS.labels(sink, op)
    for change in VERSION_CHANGES:
        VERSIONS.labels(sink, change)
    for result, tier in LOOKUP_LABELS:
        LOOKUPS.labels(sink, result, tier)
    for reason in LOAD_REASONS:
        PARTITION_LOADS.labels(sink, reason)


def publish(sink: str, report) -> None:
    """Publish one batch's report (a `sink.BatchReport`) under the `sink` label."""
    for op, n in report.ops.items():
        RECORDS.labels(sink, op).inc(n)
    VERSIONS.labels(sink, "written").inc(report.versions_written)
    VERSIONS.labels(sink, "replaced").inc(report.versions_replaced)
    for change, n in report.version_changes.items():
        VERSIONS.labels(sink, change).inc(n)
    # Hits count keys found and not expired, the tiers what they held: the difference (an
    # expired delete) stays out of the RocksDB count rather than make it negative.
    answered = (report.memory_hits, max(0, report.hits - report.memory_hits - report.table_hits),
                max(0, report.misses - report.filter_misses - report.table_misses), report.filter_misses,
                report.table_hits, report.table_misses)
    for (result, tier), n in zip(LOOKUP_LABELS, answered):
        LOOKUPS.labels(sink, result, tier).inc(n)
    for reason, n in report.partition_loads.items():
        PARTITION_LOADS.labels(sink, reason).inc(n)
    PARTITION_PEEKS.labels(sink).inc(report.partition_peeks)
    SHARD_MOVES.labels(sink).inc(report.shard_moves)
    REPLICAS_REPAIRED.labels(sink).inc(report.replicas_repaired)
    KEYS_IN_SEVERAL_PARTITIONS.labels(sink).inc(report.keys_in_several_partitions)
    KEYS_IN_OTHER_PARTITION.labels(sink).inc(report.keys_in_other_partition)
    for outcome, n in report.without_partition.items():
        WITHOUT_PARTITION.labels(sink, outcome).inc(n)
    CHANGELOG_APPLIED.labels(sink).inc(report.changelog_applied)
    REPLICA_SNAPSHOTS.labels(sink, "published").inc(report.snapshots_published)
    REPLICA_SNAPSHOTS.labels(sink, "restored").inc(report.snapshots_restored)
    VERIFIED_KEYS.labels(sink).inc(report.verified_keys)
    VERIFY_MISMATCHES.labels(sink).inc(report.verify_mismatches)
    if any(report.partition_loads.values()):
        LATEST_LOAD_SECONDS.labels(sink).set(report.load_seconds)
    COMMIT_RETRIES.labels(sink).inc(report.retries)
    if report.mode == "skipped":
        BATCHES_SKIPPED.labels(sink).inc()
    else:
        EVICTIONS.labels(sink).inc(report.evicted)
        PARTITIONS_HELD.labels(sink).set(report.partitions_held)
        CACHED_RECORDS.labels(sink).set(report.cached_records)
        CACHED_BYTES.labels(sink).set(report.cached_bytes)
    if report.mode in COMMIT_KINDS:
        COMMITS.labels(sink, report.mode).inc()
    FILES_CHANGED.labels(sink, "marked").inc(report.files_marked)
    FILES_CHANGED.labels(sink, "rewritten").inc(report.files_rewritten)
    for quantile, seconds in (report.freshness or {}).items():
        FRESHNESS.labels(sink, quantile).set(seconds)
    if report.table_version is not None:
        TABLE_VERSION.labels(sink).set(report.table_version)
    for phase, seconds in report.phases.items():
        if phase != "metrics":  # observed by the caller, once this has run
            BATCH_SECONDS.labels(sink, phase).observe(seconds)
    BATCH_SECONDS.labels(sink, "total").observe(report.total_seconds)


def observe_phase(sink: str, phase: str, seconds: float) -> None:
    BATCH_SECONDS.labels(sink, phase).observe(seconds)
