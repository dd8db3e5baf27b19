"""`make run`: generate a realistic event stream, run the job over it, print a summary.

Each run drops a new slice of events into the landing directory (new keys, updates of
keys from earlier runs, late and out-of-order events, in-batch duplicates, deletes and a
few bad records), runs the streaming job once (availableNow) and reports. Re-running
continues on the same table: the checkpoint makes the job read only the new files.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import logging
import math
import random
import time
from collections import Counter
from pathlib import Path

import pyarrow.compute as pc
import xxhash
from deltalake import DeltaTable

from jobs.job_config import load_job_config
from jobs.upsert_stream import run
from sink.errors import SinkError
from sink.ops import metrics
from sink.tagging.outcomes import OUTCOMES

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "conf" / "sink.toml"
DAYS = 30


def key_partition(i: int, anchor: dt.date) -> dt.date:
    """The day a key lives in: skewed to recent days, fixed for the key's life."""
    u = (xxhash.xxh32_intdigest(str(i).encode()) + 1) / 2**32
    return anchor - dt.timedelta(days=min(DAYS - 1, int(-6 * math.log(u))))


def generate(landing: Path, state_file: Path, events: int, files: int) -> dict:
    """Write one run's events as `files` JSON-lines files; returns the updated state."""
    state = json.loads(state_file.read_text()) if state_file.exists() else {
        "runs": 0, "next_key": 0, "anchor": dt.date.today().isoformat()}
    run_no, first_new = state["runs"], state["next_key"]
    anchor = dt.date.fromisoformat(state["anchor"])
    rng = random.Random(run_no)
    n_new = int(events * 0.55)
    base_hours = 2 * run_no

    def event(i: int, op: str, offset_s: float) -> dict:
        day = key_partition(i, anchor)
        t = dt.datetime.combine(day, dt.time(), dt.UTC) + dt.timedelta(seconds=offset_s)
        return {"event_id": f"evt-{i:09d}", "dt": day.isoformat(), "event_time": t.isoformat(),
                "op": op, "user_id": f"user-{i % 5000}", "amount": round(rng.uniform(1, 500), 2),
                "payload": f"run {run_no}"}

    rows = []
    for i in range(first_new, first_new + n_new):
        rows.append(event(i, "c", base_hours * 3600 + rng.uniform(0, 3600)))
    known = first_new + n_new
    for _ in range(int(events * 0.30)):  # updates, newer than anything of earlier runs
        rows.append(event(rng.randrange(known), "u", base_hours * 3600 + 3600 + rng.uniform(0, 3600)))
    for _ in range(int(events * 0.05)):  # late events: mostly older than the stored row
        rows.append(event(rng.randrange(known), "u", rng.uniform(0, 60)))
    for _ in range(int(events * 0.03)):  # deletes
        rows.append(event(rng.randrange(known), "d", base_hours * 3600 + 7200 + rng.uniform(0, 60)))
    rows += [dict(rows[rng.randrange(len(rows))]) for _ in range(int(events * 0.05))]  # duplicates
    for _ in range(max(1, events // 500)):  # bad records: no key
        bad = event(rng.randrange(known), "u", base_hours * 3600)
        bad["event_id"] = None
        rows.append(bad)
    rng.shuffle(rows)

    landing.mkdir(parents=True, exist_ok=True)
    per_file = math.ceil(len(rows) / files)
    for f in range(files):
        chunk = rows[f * per_file:(f + 1) * per_file]
        path = landing / f"run-{run_no:04d}-part-{f:02d}.json"
        tmp = landing.parent / (path.name + ".tmp")  # outside the watched dir
        tmp.write_text("".join(json.dumps(r) + "\n" for r in chunk))
        tmp.rename(path)  # the file source must never see a half-written file
    state.update(runs=run_no + 1, next_key=known, last_events=len(rows))
    state_file.parent.mkdir(parents=True, exist_ok=True)
    state_file.write_text(json.dumps(state))
    return state


def summarize(sink, table_uri: str, seconds: float) -> str:
    reports = [r for r in sink.reports if r.mode != "skipped"]
    ops = Counter()
    for r in reports:
        ops.update(r.ops)
    records = sum(r.records_in for r in reports)
    modes = Counter(r.mode for r in reports)
    hits, misses = sum(r.hits for r in reports), sum(r.misses for r in reports)
    loads = Counter()
    for r in reports:
        loads.update(r.partition_loads)
    table = DeltaTable(table_uri)
    ids = table.to_pyarrow_table(columns=["dt", "event_id"])
    keys = pc.binary_join_element_wise(ids.column("dt"), ids.column("event_id"), "/")
    duplicates = ids.num_rows - len(pc.unique(keys))
    tag_s = [r.tag_seconds for r in reports]
    commit_s = [r.commit_seconds for r in reports]
    lines = [
        "",
        "=== upsert sink demo ===",
        f"batches: {len(reports)}  ({dict(modes)})  records in: {records}  in {seconds:.1f}s "
        f"= {records / seconds if seconds else 0:,.0f} events/s end to end",
        "operations: " + "  ".join(f"{k}={ops[k]}" for k in OUTCOMES),
        f"index: hits={hits} misses={misses} partition loads: "
        + "  ".join(f"{reason}={n}" for reason, n in loads.items()),
        f"per batch: tag {_mean(tag_s):.2f}s  commit {_mean(commit_s):.2f}s (mean)",
        f"table: version {table.version()}  rows {ids.num_rows}  keys with two rows: {duplicates}",
        f"  {table_uri}",
    ]
    return "\n".join(lines)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(DEFAULT_CONFIG))
    parser.add_argument("--events", type=int, default=300_000, help="events generated this run")
    parser.add_argument("--files", type=int, default=6)
    parser.add_argument("--metrics-port", type=int, help="instead of the config's metrics_port (0: off); "
                                                         "with make: make run METRICS_PORT=...")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("py4j").setLevel(logging.WARNING)
    cfg = load_job_config(args.config)
    port = cfg.sinks[0].metrics_port if args.metrics_port is None else args.metrics_port
    try:
        metrics.check_port(port)  # before any event is written: a failed run must leave nothing behind
    except SinkError as e:
        raise SystemExit(f"error: {e}. With make: make run METRICS_PORT=<free port>, or METRICS_PORT=0") from e
    landing = Path(cfg.source.path)
    state = generate(landing, landing.parent / "demo-state.json", args.events, args.files)
    logging.info("run %s: wrote %s events to %s", state["runs"], state["last_events"], landing)
    started = time.perf_counter()
    (sink,) = run(args.config, once=True, metrics_port=port, stop=True)
    print(summarize(sink, sink.config.table_uri, time.perf_counter() - started), flush=True)


if __name__ == "__main__":
    main()
