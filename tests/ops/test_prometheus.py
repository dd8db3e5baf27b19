"""A real Prometheus scrapes the sink's endpoint while a streaming query runs."""

import contextlib
import json
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request

import pytest

from jobs.upsert_stream import run
from sink import SinkError
from sink.ops import metrics

pytestmark = pytest.mark.spark

SINK = "scrape-test"


def free_ports(n: int) -> list[int]:
    """`n` distinct free ports: each socket is held until all are bound (ports taken one at a
    time can come back twice)."""
    with contextlib.ExitStack() as held:
        sockets = [held.enter_context(socket.socket()) for _ in range(n)]
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]


def drop(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def event(i, ts, op="u"):
    return {"id": None if i is None else f"k{i}", "dt": f"2025-01-0{1 + (i or 0) % 3}", "ts": ts, "op": op}


def query(prom_port, expr):
    url = f"http://127.0.0.1:{prom_port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=5) as resp:
        body = json.load(resp)
    return {tuple(sorted(r["metric"].items())): float(r["value"][1]) for r in body["data"]["result"]}


def scraped(prom_port, expr, label, expected, deadline_s=60):
    """{label value: sample} of `expr` once Prometheus has scraped the expected values, or
    what it has at the deadline (scrapes run on their own clock, every second here)."""
    end = time.monotonic() + deadline_s
    while True:
        result = {dict(k).get(label): v for k, v in query(prom_port, expr).items()}
        if result == expected or time.monotonic() > end:
            return result
        time.sleep(0.2)


@pytest.fixture
def prometheus(tmp_path):
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("Debian's prometheus package is not installed and could not be (.ci/run and "
                    "`make test` install it with apt-get)")
    metrics_port, prom_port = free_ports(2)
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global:\n  scrape_interval: 1s\nscrape_configs:\n  - job_name: sink\n    static_configs:\n"
        f"      - targets: ['127.0.0.1:{metrics_port}']\n")
    proc = subprocess.Popen(
        [binary, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
         f"--web.listen-address=127.0.0.1:{prom_port}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    yield metrics_port, prom_port
    proc.terminate()
    proc.wait(30)


def test_prometheus_scrapes_exact_counts_of_a_streaming_query(spark, tmp_path, prometheus):
    metrics_port, prom_port = prometheus
    landing = tmp_path / "landing"
    landing.mkdir()
    # Batch 0: keys 0..99 are new -> 100 inserts, 100 misses.
    drop(landing / "a.json", [event(i, 10) for i in range(100)])
    # Batch 1: 0..49 newer -> 50 updates; 50..59 older -> 10 stale; 60..69 deleted -> 10 deletes
    # (70 hits); 100..129 new -> 30 inserts, 30 misses; 5 records without a key -> quarantined.
    drop(landing / "b.json",
         [event(i, 20) for i in range(50)] + [event(i, 5) for i in range(50, 60)]
         + [event(i, 30, "d") for i in range(60, 70)] + [event(i, 10) for i in range(100, 130)]
         + [event(None, 10) for _ in range(5)])
    conf = tmp_path / "sink.toml"
    conf.write_text(f"""
[sink]
table_uri = "{tmp_path / 'table'}"
key = ["id"]
partition_by = ["dt"]
ordering = "ts"
delete_when = "op = 'd'"
checkpoint_dir = "{tmp_path / 'cp'}"
index_dir = "{tmp_path / 'index'}"
writer_id = "{SINK}"
metrics_port = {metrics_port}

[source]
format = "json"
path = "{landing}"
schema = "id STRING, dt STRING, ts BIGINT, op STRING"
max_files_per_trigger = 1
""")
    (sink,) = run(str(conf), once=True)
    assert [r.batch_id for r in sink.reports] == [0, 1]

    expected = {
        ("upsert_sink_records_total", "op"): {"insert": 130, "update": 50, "delete": 10, "delete_missing": 0,
                                              "unchanged": 0, "stale": 10, "superseded": 0, "quarantined": 5},
        # Exist at 0 from the start, so increase() alerts can fire on the first failure.
        ("upsert_sink_index_load_failures_total", "sink"): {SINK: 0},
        ("sum by (result) (upsert_sink_index_lookups_total{SINK})", "result"): {"hit": 70, "miss": 130},
        ("upsert_sink_commits_total", "mode"): {"append": 1, "rewrite": 1, "merge-on-read": 0, "merge": 0},
        # Batch 1 rewrote the file of each of the 3 days batch 0 appended.
        ("upsert_sink_files_changed_total", "how"): {"marked": 0, "rewritten": 3},
        ("upsert_sink_table_version", "sink"): {SINK: 2},
    }
    for (name, label), values in expected.items():
        expr = name.replace("{SINK}", f'{{sink="{SINK}"}}') if "{SINK}" in name else f'{name}{{sink="{SINK}"}}'
        assert scraped(prom_port, expr, label, values) == values, name


def test_a_port_in_use_is_a_clear_error():
    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(SinkError, match=f"metrics_port = {port}: cannot serve"):
            metrics.serve(port)
