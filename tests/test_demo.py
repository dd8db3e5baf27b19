"""`make run`: the demo refuses a metrics port in use before it writes anything."""

import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_a_taken_metrics_port_stops_the_demo_before_any_event_is_written(tmp_path):
    conf = tmp_path / "conf" / "sink.toml"
    conf.parent.mkdir()
    conf.write_text((ROOT / "conf" / "sink.toml").read_text())  # its paths resolve under tmp_path/data
    with socket.socket() as taken:
        taken.bind(("", 0))
        taken.listen()
        port = taken.getsockname()[1]
        run = subprocess.run([sys.executable, "-m", "jobs.demo", "--config", str(conf), "--metrics-port", str(port)],
                             cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode != 0
    assert f"metrics_port = {port}: cannot serve Prometheus metrics there" in run.stderr
    assert "make run METRICS_PORT=<free port>" in run.stderr and "Traceback" not in run.stderr
    assert not (tmp_path / "data").exists()  # no event, no table
