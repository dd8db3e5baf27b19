"""`python -m bench.report` renders a recorded `make bench` result as Markdown tables."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_report_command_renders_a_recorded_global_row():
    run = subprocess.run([sys.executable, "-m", "bench.report", "bench/results/full-2026-11-23.json"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    # The run predates the key filter and the delta-spark MERGE: their columns say n/a.
    assert "| global | 10M | 4.64 s (3.48x) | n/a | 1.33 s | 0.42 s | 0.213 B | n/a | n/a | 0 | True |" in run.stdout


def test_the_time_above_the_commit_lists_every_case_measured_against_the_hand_written_version():
    recorded = "bench/results/full-2026-11-26.json"
    run = subprocess.run([sys.executable, "-m", "bench.report", recorded], cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 0, run.stderr
    result = json.loads((ROOT / recorded).read_text())
    cases = [*result["e2e"], *result["e2e_tiny"], *result["global"]]
    assert {c["workload"] for c in cases} >= {"events", "global", "global-spread"}
    for c in cases:
        hand, sink = c["baseline"]["above_commit"], c["sink"]["above_commit"]
        assert (f"| {c['workload']} | {c['table_rows'] // 1_000_000}M | {c['batch_rows']:,} | {hand:.3f} | "
                f"{sink:.3f} | {sink - hand:+.3f} |") in run.stdout
