"""`python -m bench.run` writes its results beside the earlier ones, never over them."""

import datetime as dt
import json
import time

from bench import run


def test_a_second_run_of_the_day_writes_a_file_of_its_own_and_each_run_keeps_its_own(tmp_path, monkeypatch):
    monkeypatch.setattr(run, "RESULTS", tmp_path)
    today = dt.date.today().isoformat()
    first, second = {"name": "dv", "n": 1}, {"name": "dv", "n": 2}
    run.write(first, time.perf_counter(), plotted=False)
    run.write(second, time.perf_counter(), plotted=False)
    first["n"] = 3  # a later save of the first run's result
    run.write(first, time.perf_counter(), plotted=False)
    assert json.loads((tmp_path / f"dv-{today}.json").read_text())["n"] == 3
    assert json.loads((tmp_path / f"dv-{today}-2.json").read_text())["n"] == 2


def test_the_quick_run_sets_every_size_the_full_run_sets():
    assert run.QUICK.keys() == run.FULL.keys()
