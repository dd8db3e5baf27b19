"""Workload `mirror`: the table a Debezium pipeline mirrors. Unpartitioned, keyed by `id`, its
rows in 8 files; each 100k-record batch 75% updates spread uniformly over the stored keys, 20%
inserts, 5% deletes, with repeats (a key twice in a batch, the later record newer) and stale
records (older than the stored row) among the updates. The sink (driver and executor tagging)
against the careful delta-spark MERGE on the key, on the plain table and with deletion vectors;
every table ends equal to an independent oracle (pyarrow, not Spark).

Per contender and size: seconds per batch (median after the first: the slope over sizes is the
point), the commit phase, the bytes and files the batch's commits wrote, removed and marked, and, for
executor tagging, how many writing tasks wrote and the busiest one's share. Every contender
then runs RESTARTED batches more; the sink's run in a restarted sink whose replicas were lost
(a new process on new disks), which starts from the replica snapshots the stream published
(`replica_snapshot_every_versions`).

    python -m bench.run --mirror --sizes 1000000 10000000 50000000 --batches 4
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from deltalake import DeltaTable, write_deltalake

from bench import global_bench
from bench.baseline import SparkMerge
from bench.e2e import median_after_first, phase_medians, stream, table_contents

FILES = 8
MIX = {"updates": 0.75, "inserts": 0.20, "deletes": 0.05}
REPEATS = 0.02  # of the updates: the key sent again, later in the batch, newer
STALE = 0.02  # of the updates: older than the stored row (changes nothing)
CONTENDERS = ("spark-merge-careful", "sink", "sink-executors")
TAG_ON = {"sink": "driver", "sink-executors": "executors"}
# A snapshot of each replica at its first load, then every this many versions: the restart
# starts from one a few batches old and replays this writer's batches since from the changelog.
SNAPSHOT_EVERY = 100
RESTARTED = 2  # the restart's batch, and the one after it (a new process's caches fill in both)
_EPOCH_US = 1_790_000_000_000_000


def _rows(keys: np.ndarray, times_us: np.ndarray, ops: np.ndarray, amounts: np.ndarray) -> pa.Table:
    """Rows as the global-scope bench builds them, `dt` a column like any other here."""
    return global_bench._rows(keys, np.full(len(keys), "-", object), times_us, ops, amounts)


def _stored(keys: np.ndarray) -> pa.Table:
    return _rows(keys, _EPOCH_US + keys % 1_000_000, np.full(len(keys), "r", object), (keys % 49_999) / 100.0)


def write_start_table(uri: str, rows: int) -> None:
    """`rows` keys in FILES appends (one file each), keys spread over every file."""
    keys = np.random.default_rng(0).permutation(rows)
    for part in np.array_split(keys, FILES):
        write_deltalake(uri, _stored(np.sort(part)), mode="append")


def write_batches(landing: Path, table_rows: int, batches: int, batch_rows: int, seed: int = 11) -> None:
    """One Parquet file per batch; the mix in the module docstring. A deleted key is never
    touched again, so the MERGE (which keeps no tombstones) ends equal to the sink."""
    rng = np.random.default_rng(seed)
    landing.mkdir(parents=True, exist_ok=True)
    alive = np.ones(table_rows + batches * batch_rows, bool)
    alive[table_rows:] = False
    next_key = table_rows
    for b in range(batches):
        now_us = _EPOCH_US + 10_000_000 + b * 1_000_000_000
        n_upd, n_ins = int(batch_rows * MIX["updates"]), int(batch_rows * MIX["inserts"])
        n_del = batch_rows - n_upd - n_ins
        live = np.flatnonzero(alive)
        picked = rng.choice(live, n_upd + n_del, replace=False)
        upd, dele = picked[:n_upd], picked[n_upd:]
        n_rep, n_stale = int(n_upd * REPEATS), int(n_upd * STALE)
        repeat, stale, fresh = upd[:n_rep], upd[n_rep:n_rep + n_stale], upd[n_rep + n_stale:]
        new = np.arange(next_key, next_key + n_ins)
        next_key += n_ins
        alive[dele] = False
        alive[new] = True
        parts = [
            _rows(new, now_us + rng.integers(0, 1000, n_ins), np.full(n_ins, "c", object), rng.uniform(1, 500, n_ins)),
            _rows(fresh, np.full(len(fresh), now_us), np.full(len(fresh), "u", object),
                  rng.uniform(1, 500, len(fresh))),
            _rows(repeat, np.full(n_rep, now_us), np.full(n_rep, "u", object), rng.uniform(1, 500, n_rep)),
            _rows(repeat, np.full(n_rep, now_us + 1), np.full(n_rep, "u", object), rng.uniform(1, 500, n_rep)),
            _rows(stale, _EPOCH_US - 1 - rng.integers(0, 1000, n_stale), np.full(n_stale, "u", object),
                  rng.uniform(1, 500, n_stale)),
            _rows(dele, np.full(n_del, now_us), np.full(n_del, "d", object), np.zeros(n_del)),
        ]
        table = pa.concat_tables(parts)
        pq.write_table(table.take(pa.array(rng.permutation(table.num_rows))), landing / f"batch-{b:04d}.parquet")


def oracle(table_rows: int, landing: Path) -> pa.Table:
    """Per key the record with the highest event time wins (the stored row being the oldest
    candidate); a winning delete removes the key."""
    parts = [_stored(np.arange(table_rows))]
    parts += [pq.read_table(path) for path in sorted(landing.glob("*.parquet"))]
    rows = pa.concat_tables(parts)
    rows = rows.take(pc.sort_indices(rows, [("id", "ascending"), ("event_time", "descending")]))
    ids = rows.column("id").combine_chunks()
    first = np.ones(rows.num_rows, bool)
    first[1:] = ~pc.equal(ids[1:], ids[:-1]).to_numpy(zero_copy_only=False)
    winners = rows.filter(pa.array(first))
    return global_bench._sorted(winners.filter(pc.not_equal(winners.column("op"), "d")))


def commit_sizes(uri: str, after: int) -> list[dict]:
    """Per version after `after`: bytes and files written, files removed, and files marked (a
    file added again with a deletion vector: its `add` names a file already there, nothing is
    written but the vector)."""
    out = []
    for path in sorted((Path(uri) / "_delta_log").glob("*.json")):
        if int(path.stem) <= after:
            continue
        actions = [json.loads(line) for line in path.read_text().splitlines() if line]
        removed = {a["remove"]["path"] for a in actions if "remove" in a}
        written = [a["add"] for a in actions if "add" in a and a["add"]["path"] not in removed]
        marked = sum(1 for a in actions if "add" in a and a["add"]["path"] in removed)
        out.append({"bytes_added": sum(a["size"] for a in written), "files_added": len(written),
                    "files_removed": len(removed) - marked, "files_marked": marked})
    return out


def run_case(spark, work: Path, table_rows: int, batches: int, batch_rows: int, deletion_vectors: bool,
             shards: int = 2, contenders: tuple[str, ...] = CONTENDERS) -> dict:
    from sink import SinkConfig

    case = work / f"mirror-{table_rows}{'-dv' if deletion_vectors else ''}"
    template, landing = case / "start", case / "landing"
    started = time.perf_counter()
    write_start_table(str(template), table_rows)
    if deletion_vectors:
        spark.sql(f"ALTER TABLE delta.`{template}` SET TBLPROPERTIES ('delta.enableDeletionVectors' = 'true')")
    write_batches(landing, table_rows, batches + RESTARTED, batch_rows)  # the sink's last ones after a restart
    expected = oracle(table_rows, landing)
    out: dict = {"workload": "mirror", "table_rows": table_rows, "deletion_vectors": deletion_vectors,
                 "batches": batches, "batch_rows": batch_rows, "setup_seconds": round(time.perf_counter() - started, 1)}
    start_version = DeltaTable(str(template)).version()
    for name in contenders:
        uri = case / name / "table"
        shutil.copytree(template, uri)
        if name in TAG_ON:
            cfg = SinkConfig(table_uri=str(uri), key=["id"], partition_by=[], ordering="event_time",
                             delete_when="op = 'd'", checkpoint_dir=str(case / name / "cp"),
                             index_dir=str(case / name / "index"), num_shards=shards, metrics_port=0,
                             tag_on=TAG_ON[name], replica_snapshot_every_versions=SNAPSHOT_EVERY)
            seconds, reports, restart = _stream_then_restart(spark, landing, case / name, cfg)
            figures = {
                "commit_seconds": round(median_after_first([r.commit_seconds for r in reports]), 3),
                "phases": phase_medians(reports), "modes": [r.mode for r in reports],
                "write_tasks": [r.write_tasks for r in reports],
                "write_busiest_share": [round(r.write_busiest_share, 2) for r in reports],
                "files_marked_rewritten": [(r.files_marked, r.files_rewritten) for r in reports],
                **restart,
            }
        else:
            merge = SparkMerge(str(uri), careful=False, scope="global")  # ON the key: no partition to prune by
            seconds, _, merge_seconds = stream(spark, landing, case / name / "cp", merge)
            figures = {"commit_seconds": round(median_after_first(merge_seconds), 3)}
        sizes = commit_sizes(str(uri), start_version)
        out[name] = {
            "batch_seconds": [round(s, 3) for s in seconds],
            "median_after_first": round(median_after_first(seconds), 3),
            **figures,
            "mb_added_per_batch": round(sum(s["bytes_added"] for s in sizes) / (batches + RESTARTED) / 1e6, 2),
            "files_added_per_batch": round(sum(s["files_added"] for s in sizes) / (batches + RESTARTED), 1),
            "files_removed_per_batch": round(sum(s["files_removed"] for s in sizes) / (batches + RESTARTED), 1),
            "files_marked_per_batch": round(sum(s["files_marked"] for s in sizes) / (batches + RESTARTED), 1),
            "table_equal_to_oracle": global_bench._sorted(table_contents(str(uri))).equals(expected),
        }
        shutil.rmtree(case / name, ignore_errors=True)
    shutil.rmtree(case, ignore_errors=True)
    merge = out.get("spark-merge-careful")
    if merge:
        for name in contenders:
            if name in TAG_ON:
                out[f"ratio_merge_over_{name.replace('-', '_')}"] = round(
                    merge["median_after_first"] / out[name]["median_after_first"], 2)
    return out


def _stream_then_restart(spark, landing: Path, where: Path, cfg) -> tuple[list[float], list, dict]:
    """The stream but its last RESTARTED batches, then those in a new sink whose replicas were
    lost: the seconds of the batches before, the reports of all, and the restart's figures."""
    from sink import UpsertSink
    from sink.lakehouse.commit import file_cache

    last = sorted(landing.glob("batch-*.parquet"))[-RESTARTED:]
    where.mkdir(parents=True, exist_ok=True)
    for path in last:
        shutil.move(path, where / path.name)
    try:
        file_cache.WRITTEN.clear()  # the previous case's files
        sink = UpsertSink(cfg)
        seconds, reports, _ = stream(spark, landing, Path(cfg.checkpoint_dir), sink)
        sink.close()
    finally:
        for path in last:
            shutil.move(where / path.name, path)
    shutil.rmtree(cfg.index_dir)
    file_cache.WRITTEN.clear()  # a new process holds none of the files the last one wrote
    sink = UpsertSink(cfg)
    again, restarted, _ = stream(spark, landing, Path(cfg.checkpoint_dir), sink)
    sink.close()
    again, restarted = again[len(seconds):], restarted[len(reports):]  # `stream` lists the query's every batch
    steady = median_after_first(seconds)
    return seconds, [*reports, *restarted], {
        "restart_seconds": [round(s, 3) for s in again],
        "restart_snapshots_restored": restarted[0].snapshots_restored,
        "restart_phases": [{p: round(s, 3) for p, s in r.phases.items() if s} for r in restarted],
        "restart_over_median": [round(s / steady, 2) for s in again],
    }


def run(spark, work: Path, sizes: list[int], batches: int, batch_rows: int, log=print) -> list[dict]:
    """Each size, the plain table and with deletion vectors."""
    cases = []
    for rows in sizes:
        for deletion_vectors in (False, True):
            case = run_case(spark, work, rows, batches, batch_rows, deletion_vectors)
            figures = ", ".join(f"{n} {case[n]['median_after_first']}s" for n in CONTENDERS)
            equal = all(case[n]["table_equal_to_oracle"] for n in CONTENDERS)
            log(f"mirror {rows:,}{' (deletion vectors)' if deletion_vectors else ''} per batch: {figures}; "
                f"tables equal to the oracle: {equal}")
            cases.append(case)
    return cases
