"""The deployment files: Prometheus config, Grafana dashboard and provisioning, compose."""

import json
import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml
from prometheus_client import Counter, Gauge, Histogram

from jobs import kafka_source
from jobs.job_config import KEY_FROM_MESSAGES, load_job_config
from sink.ops import metrics

ROOT = Path(__file__).resolve().parent.parent
CONF = ROOT / "conf"


def exported_series() -> set[str]:
    """Every series name the sink's metrics produce."""
    names = set()
    for value in vars(metrics).values():
        if isinstance(value, Counter):
            names |= {value._name + "_total"}
        elif isinstance(value, Histogram):
            names |= {value._name + s for s in ("_bucket", "_sum", "_count")}
        elif isinstance(value, Gauge):
            names.add(value._name)
    return names


def test_prometheus_config_passes_promtool():
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool (Debian's prometheus package) is not installed; .ci/run installs it")
    result = subprocess.run([promtool, "check", "config", str(CONF / "prometheus.yml")],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_dashboard_queries_name_only_exported_metrics():
    dashboard = json.loads((CONF / "grafana" / "dashboards" / "upsert-sink.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    used = {m for e in exprs for m in re.findall(r"upsert_sink_[a-z_]+", e)}
    assert used and used <= exported_series(), used - exported_series()
    titles = " ".join(p["title"].lower() for p in dashboard["panels"])
    for topic in ("hit ratio", "lookups / s", "records by operation", "latency", "partition loads",
                  "load time", "cached records", "cached bytes", "table version", "kafka consumer lag", "freshness"):
        assert topic in titles


def test_compose_files_and_ports_line_up():
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    assert set(services) == {"sink-job", "prometheus", "grafana", *CDC_SERVICES}

    build = services["sink-job"]["build"]
    dockerfile = ROOT / build["context"] / build["dockerfile"]
    assert dockerfile.is_file()
    for line in dockerfile.read_text().splitlines():
        if line.startswith("COPY "):
            for src in line.split()[1:-1]:
                assert (ROOT / src).exists(), f"Dockerfile copies missing {src}"

    for name, service in services.items():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source != "./data":  # created by the job at run time
                assert (ROOT / source).exists(), f"{name} mounts missing {source}"

    # Each job's config (the path the image runs with) serves metrics on its published port.
    ports = {}
    for job in ("sink-job", "cdc-job"):
        (sink,) = load_job_config(job_config(services[job])).tables  # a [[sink]]'s, or the mirror's tables'
        assert f"{sink.metrics_port}:{sink.metrics_port}" in services[job]["ports"]
        ports[job] = sink.metrics_port

    # Prometheus scrapes that service and port, with the config compose mounts.
    prom_mount = next(v for v in services["prometheus"]["volumes"] if "prometheus.yml" in v)
    prom = yaml.safe_load((ROOT / prom_mount.split(":")[0]).read_text())
    targets = [t for job in prom["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]]
    assert targets == [f"{job}:{port}" for job, port in ports.items()]
    assert prom_mount.split(":")[1] in " ".join(services["prometheus"]["command"])

    # Grafana's datasource is that Prometheus, and its dashboard provider reads the mounted folder.
    datasource = yaml.safe_load((CONF / "grafana/provisioning/datasources/prometheus.yml").read_text())
    prom_port = services["prometheus"]["ports"][0].split(":")[1]
    assert datasource["datasources"][0]["url"] == f"http://prometheus:{prom_port}"
    provider = yaml.safe_load((CONF / "grafana/provisioning/dashboards/upsert-sink.yml").read_text())
    mounts = dict(v.split(":")[:2] for v in services["grafana"]["volumes"])
    assert mounts["./conf/grafana/dashboards"] == provider["providers"][0]["options"]["path"]
    assert list((ROOT / "conf/grafana/dashboards").glob("*.json"))


CDC_SERVICES = ("cdc-job", "kafka", "postgres", "connect", "connector-init")


def job_config(service: dict) -> Path:
    """The config file a job service runs with, in the repository."""
    command = service["command"]
    return ROOT / command[command.index("--config") + 1].replace("/app/", "")


def test_the_cdc_pipeline_in_compose_lines_up():
    """PostgreSQL with logical decoding, the connector Connect registers, the topic it writes,
    the broker the CDC job reads, the job's Spark Kafka connector and its table's columns."""
    services = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    assert "wal_level=logical" in services["postgres"]["command"]
    connector = json.loads((CONF / "cdc" / "pg-connector.json").read_text())
    assert connector["database.hostname"] == "postgres" and connector["plugin.name"] == "pgoutput"
    assert services["connect"]["environment"]["BOOTSTRAP_SERVERS"] == "kafka:9092"
    assert "PLAINTEXT://kafka:9092" in services["kafka"]["environment"]["KAFKA_ADVERTISED_LISTENERS"]
    mounted = dict(v.split(":")[:2] for v in services["connector-init"]["volumes"])
    assert mounted["./conf/cdc/pg-connector.json"] in " ".join(services["connector-init"]["entrypoint"])

    cfg = load_job_config(job_config(services["cdc-job"]))
    assert (cfg.sinks, cfg.mirror.source.bootstrap_servers) == ([], "kafka:9092")
    (table,) = connector["table.include.list"].split(",")
    topic = f"{connector['topic.prefix']}.{table}"
    assert re.fullmatch(cfg.mirror.source.subscribe_pattern, topic)
    sink, source = cfg.mirror.table(topic)
    assert (sink.table_uri, source.topics) == (f"/app/data/cdc/{table.split('.')[1]}", [topic])
    assert kafka_source.package() in services["cdc-job"]["entrypoint"]
    # Debezium at its defaults; the job names no column and no key: the table's primary key,
    # its columns, come from the messages' Connect schemas.
    assert not [k for k in connector if k.startswith(("decimal.", "time.", "binary."))]
    assert (source.schema, sink.key, source.widens) == (None, [KEY_FROM_MESSAGES], True)
    assert connector["key.converter.schemas.enable"] == connector["value.converter.schemas.enable"] == "true"
    init = (CONF / "cdc" / "init.sql").read_text()
    assert re.search(rf"CREATE TABLE {table.split('.')[1]} \(.*PRIMARY KEY.*?\);", init, re.S)


def test_the_image_takes_python_and_spark_from_the_pins_in_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    required = tuple(int(p) for p in re.fullmatch(r">=(\d+)\.(\d+)", project["requires-python"]).groups())
    dockerfile = (CONF / "docker" / "Dockerfile").read_text()
    bases = re.findall(r"^FROM\s+(\S+)", dockerfile, re.M)
    assert len(bases) == 1 and bases[0].startswith("python:"), "one base image: the Python one"
    python = tuple(int(p) for p in re.match(r"python:(\d+)\.(\d+)", bases[0]).groups())
    assert python >= required
    # Spark is the pyspark wheel pip installs from pyproject's pin, found under that Python.
    assert "pip install --no-cache-dir ." in dockerfile
    assert any(d.startswith("pyspark") for d in project["dependencies"])
    spark_home = re.search(r"SPARK_HOME=(\S+)", dockerfile).group(1)
    assert spark_home == f"/usr/local/lib/python{python[0]}.{python[1]}/site-packages/pyspark"
    assert "openjdk-17" in dockerfile  # the Java the Makefile asks for
    # The job writes to the bind-mounted ./data as the uid compose passes.
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    assert compose["services"]["sink-job"]["build"]["args"]["UID"] == "${UID:-1000}"
    assert re.search(r"^ARG UID=", dockerfile, re.M) and 'useradd --uid "${UID}"' in dockerfile
