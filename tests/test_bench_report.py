"""`python -m bench.report` renders a recorded `make bench` result as Markdown tables."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_report_command_renders_a_recorded_global_row():
    run = subprocess.run([sys.executable, "-m", "bench.report", "bench/results/full-2026-11-23.json"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    # The run predates the key filter: its columns say n/a.
    assert "| global | 10M | 4.64 s | 1.33 s (3.48x) | 0.42 s | 0.213 B | n/a | n/a | 0 | True |" in run.stdout
