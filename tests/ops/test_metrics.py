import socket
import urllib.request

from prometheus_client import REGISTRY

from sink import BatchReport
from sink.ops import metrics
from sink.ops.report import PHASES


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_sinks_share_one_endpoint_told_apart_by_label():
    port = free_port()
    metrics.serve(port)
    metrics.serve(port)  # the second sink in the same driver: no second server, no error
    a = BatchReport(0, ops={"insert": 3, "update": 0, "delete": 0, "stale": 0, "quarantined": 0}, mode="append",
                    table_version=1, hits=0, misses=3)
    b = BatchReport(0, ops={"insert": 0, "update": 2, "delete": 1, "stale": 4, "quarantined": 0}, mode="merge",
                    table_version=9, hits=7, misses=0,
                    partition_loads={"bootstrap": 5, "on_demand": 2, "invalidated": 4}, shard_moves=3,
                    changelog_applied=120)
    metrics.publish("label-a", a)
    metrics.publish("label-b", b)
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    lines = set(text.splitlines())
    assert 'upsert_sink_records_total{op="insert",sink="label-a"} 3.0' in lines
    assert 'upsert_sink_records_total{op="stale",sink="label-b"} 4.0' in lines
    assert 'upsert_sink_index_lookups_total{result="hit",sink="label-b",tier="rocksdb"} 7.0' in lines
    assert 'upsert_sink_index_partition_loads_total{reason="bootstrap",sink="label-b"} 5.0' in lines
    assert 'upsert_sink_index_partition_loads_total{reason="invalidated",sink="label-b"} 4.0' in lines
    assert 'upsert_sink_index_shard_moves_total{sink="label-b"} 3.0' in lines
    assert 'upsert_sink_index_changelog_entries_applied_total{sink="label-b"} 120.0' in lines
    assert 'upsert_sink_table_version{sink="label-a"} 1.0' in lines
    assert 'upsert_sink_table_version{sink="label-b"} 9.0' in lines
    assert 'upsert_sink_commits_total{mode="merge",sink="label-b"} 1.0' in lines


def test_a_skipped_batch_counts_as_skipped_only():
    metrics.publish("label-skip", BatchReport(3, mode="skipped", table_version=4))
    assert REGISTRY.get_sample_value("upsert_sink_batches_skipped_total", {"sink": "label-skip"}) == 1
    assert REGISTRY.get_sample_value("upsert_sink_records_total", {"sink": "label-skip", "op": "insert"}) == 0
    assert REGISTRY.get_sample_value("upsert_sink_commits_total", {"sink": "label-skip", "mode": "merge"}) is None


def test_every_phase_is_observed_under_its_own_label():
    report = BatchReport(0, mode="append", table_version=1, total_seconds=2.0)
    report.phases.update(checks=0.01, prepare=0.2, tag=1.5, commit=0.25)
    metrics.publish("label-phases", report)
    for phase in (*PHASES, "total"):
        seconds = report.total_seconds if phase == "total" else report.phases[phase]
        labels = {"sink": "label-phases", "phase": phase}
        if phase == "metrics":  # its own time is known only after publishing: the caller observes it
            assert REGISTRY.get_sample_value("upsert_sink_batch_seconds_count", labels) is None
            continue
        assert REGISTRY.get_sample_value("upsert_sink_batch_seconds_count", labels) == 1
        assert REGISTRY.get_sample_value("upsert_sink_batch_seconds_sum", labels) == seconds


def test_a_new_sinks_counters_exist_at_zero_before_its_first_batch(tmp_path):
    from sink import SinkConfig, UpsertSink

    UpsertSink(SinkConfig(table_uri=str(tmp_path / "t"), key=["id"], ordering="ts", writer_id="fresh",
                          metrics_port=0))
    for name in ("upsert_sink_index_load_failures_total", "upsert_sink_batches_skipped_total",
                 "upsert_sink_commit_retries_total", "upsert_sink_index_replicas_repaired_total"):
        assert REGISTRY.get_sample_value(name, {"sink": "fresh"}) == 0, name
    assert REGISTRY.get_sample_value("upsert_sink_commits_total", {"sink": "fresh", "mode": "merge"}) == 0


def documented_counters() -> dict[str, dict[str, list[str]]]:
    """The Monitoring page's table: counter name -> label -> the documented values."""
    import re
    from pathlib import Path

    section = (Path(__file__).resolve().parents[2] / "docs" / "monitoring.md").read_text()
    counters = {}
    for name, labels in re.findall(r"^\| `(upsert_sink_\w+_total)(?:\{([^}]*)\})?`", section, re.M):
        pairs = [p.split("=", 1) for p in labels.split(", ")] if labels else []
        counters[name] = {label: values.split("\\|") for label, values in pairs}
    return counters


def test_every_documented_counter_and_label_value_exists_at_0_before_the_first_batch(tmp_path):
    from sink import SinkConfig, UpsertSink

    UpsertSink(SinkConfig(table_uri=str(tmp_path / "t"), key=["id"], ordering="ts", writer_id="fresh",
                          metrics_port=0))
    counters = documented_counters()
    assert len(counters) >= 12  # the table was read
    for name, labels in counters.items():
        samples = [s for metric in REGISTRY.collect() for s in metric.samples
                   if s.name == name and s.labels.get("sink") == "fresh"]
        assert samples, f"{name} has no series before the first batch"
        assert all(s.value == 0 for s in samples), name
        for label, values in labels.items():
            assert {s.labels[label] for s in samples} >= set(values), f"{name}{{{label}}}"


def test_check_port_fails_like_serve_on_a_port_in_use_and_passes_one_this_process_serves():
    import pytest

    from sink.errors import SinkError

    with socket.socket() as taken:
        taken.bind(("", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        with pytest.raises(SinkError, match=f"metrics_port = {busy}: cannot serve Prometheus metrics there"):
            metrics.check_port(busy)
    served = free_port()
    metrics.serve(served)
    metrics.check_port(served)  # this process's own endpoint: the sink reuses it
    metrics.check_port(0)
