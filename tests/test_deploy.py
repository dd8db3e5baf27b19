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
    assert set(services) == {"sink-job", "prometheus", "grafana"}

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

    # The job's config (the path the image runs with) serves metrics on the published port.
    config_arg = services["sink-job"]["command"][services["sink-job"]["command"].index("--config") + 1]
    config = ROOT / config_arg.replace("/app/", "")
    sink = tomllib.loads(config.read_text())["sink"]
    assert f"{sink['metrics_port']}:{sink['metrics_port']}" in services["sink-job"]["ports"]

    # Prometheus scrapes that service and port, with the config compose mounts.
    prom_mount = next(v for v in services["prometheus"]["volumes"] if "prometheus.yml" in v)
    prom = yaml.safe_load((ROOT / prom_mount.split(":")[0]).read_text())
    targets = [t for job in prom["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]]
    assert targets == [f"sink-job:{sink['metrics_port']}"]
    assert prom_mount.split(":")[1] in " ".join(services["prometheus"]["command"])

    # Grafana's datasource is that Prometheus, and its dashboard provider reads the mounted folder.
    datasource = yaml.safe_load((CONF / "grafana/provisioning/datasources/prometheus.yml").read_text())
    prom_port = services["prometheus"]["ports"][0].split(":")[1]
    assert datasource["datasources"][0]["url"] == f"http://prometheus:{prom_port}"
    provider = yaml.safe_load((CONF / "grafana/provisioning/dashboards/upsert-sink.yml").read_text())
    mounts = dict(v.split(":")[:2] for v in services["grafana"]["volumes"])
    assert mounts["./conf/grafana/dashboards"] == provider["providers"][0]["options"]["path"]
    assert list((ROOT / "conf/grafana/dashboards").glob("*.json"))


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
