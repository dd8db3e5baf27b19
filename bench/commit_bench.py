"""The Delta commit alone, by table size: append of 100k new keys; 100k rows (half updates
within the last 7 days) committed by rewriting the files holding the updated keys (the
sink's default), by a MERGE pruned to the changed partitions (the sink's fallback), and by
the same MERGE without the partition list. `merge_on_read`: consecutive events batches'
writes committed by rewriting and by merge-on-read, at two file sizes."""

from __future__ import annotations

import datetime as dt
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from deltalake import DeltaTable

from bench.workloads import TODAY, WORKLOADS, Mix, write_batches, write_start_table
from sink.config import SinkConfig
from sink.delta_log.contract import Contract
from sink.lakehouse.commit import file_cache
from sink.lakehouse.engines.delta_rs import WRITE_COLUMN, DeltaTarget

RECENT_UPDATES = Mix("recent-updates", updates=0.5, late_share=0.0, deletes=0.0, stale=0.0)


def _source(landing: Path, table_rows: int, mix: Mix, batch_rows: int) -> pa.Table:
    write_batches(landing, mix, table_rows, 1, batch_rows, seed=5)
    batch = pq.read_table(landing / "batch-0000.parquet")
    # What the sink would write: new keys insert, known keys update (no deletes or stale here).
    known = np.array([int(i.split("-")[1]) < table_rows for i in batch.column("id").to_pylist()])
    return batch.append_column(WRITE_COLUMN, pa.array(np.where(known, "update", "insert")))


def _events_sources(landing: Path, table_rows: int, batch_rows: int, batches: int = 1) -> list[pa.Table]:
    """What the sink writes for consecutive events batches: new keys insert, known keys update
    or delete, stale records (older than the stored row: dated before today's batches) left
    out. The workload's updates and deletes hit keys of the starting table only."""
    write_batches(landing, WORKLOADS["events"], table_rows, batches, batch_rows, seed=5)
    out = []
    for b in range(batches):
        batch = pq.read_table(landing / f"batch-{b:04d}.parquet")
        batch = batch.filter(pc.greater_equal(batch.column("event_time"),
                                              pa.scalar(dt.datetime.combine(TODAY, dt.time(12), dt.UTC))))
        known = np.array([int(i.split("-")[1]) < table_rows for i in batch.column("id").to_pylist()])
        deleting = pc.equal(batch.column("op"), "d").to_numpy(zero_copy_only=False)
        out.append(batch.append_column(WRITE_COLUMN, pa.array(np.where(~known, "insert", np.where(
            deleting, "delete", "update")))))
    return out


def _timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def run(sizes: list[int], batch_rows: int, repeats: int, log=print) -> list[dict]:
    out = []
    for rows in sizes:
        work = Path(tempfile.mkdtemp(prefix="commit-bench-"))
        try:
            write_start_table(str(work / "start"), rows)
            inserts = _source(work / "ins", rows, WORKLOADS["insert-only"], batch_rows)
            updates = _source(work / "upd", rows, RECENT_UPDATES, batch_rows)
            figures: dict[str, list[float]] = {"append": [], "rewrite": [], "merge_pruned": [], "merge_unpruned": []}
            for i in range(repeats):
                for name in figures:
                    uri = work / f"{name}-{i}"
                    shutil.copytree(work / "start", uri)
                    target = DeltaTarget(str(uri), ["dt"], "merge" if name == "merge_pruned" else "auto")
                    target.open_or_create(inserts.schema, Contract(("id",), ("dt",), "event_time", "partitioned"))
                    if name == "merge_unpruned":
                        figures[name].append(_timed(lambda u=uri, src=updates: _unpruned_merge(str(u), src)))
                    else:
                        source = inserts if name == "append" else updates
                        figures[name].append(_timed(lambda t=target, src=source: t.commit(
                            src, ["id"], "event_time", "bench", 0, {}, True)))
                    shutil.rmtree(uri)
            result = {"table_rows": rows, "batch_rows": batch_rows,
                      **{k: [round(v, 3) for v in vs] for k, vs in figures.items()},
                      **{f"{k}_median": round(statistics.median(vs), 3) for k, vs in figures.items()}}
            log(f"commit {rows:,}: append {result['append_median']}s, rewrite {result['rewrite_median']}s, "
                f"pruned MERGE {result['merge_pruned_median']}s, "
                f"unpruned MERGE {result['merge_unpruned_median']}s")
            out.append(result)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return out


def _unpruned_merge(uri: str, source: pa.Table) -> None:
    table = DeltaTable(uri)
    cols = {f"`{c}`": f"s.`{c}`" for c in source.column_names if c != WRITE_COLUMN}
    (table.merge(source, "t.id = s.id AND t.dt = s.dt", source_alias="s", target_alias="t")
     .when_matched_update(updates=cols).when_not_matched_insert(updates=cols).execute())


# Rows a start-table write takes at a time: one file per partition each (60 partitions).
FILE_LAYOUTS = {"small files": 2_000_000, "large files": None}  # None: the whole table at once


def merge_on_read(sizes: list[int], batch_rows: int, batches: int, log=print) -> list[dict]:
    """Consecutive events batches' writes (no Spark: the driver's commit phase as the sink runs
    it, its file caches at the sink's defaults) committed by rewriting the files holding their
    updated and deleted keys, and by merge-on-read (new row versions in new files, deletion
    vectors on the files found), on tables of the same rows in small and in large files:
    merge-on-read's cost should follow the changed rows, the rewrite's the files. The first
    batch finds nothing held; the second holds every probed file's keys and sorts them
    (`key_locator`); `warm_median` is the batches after."""
    out = []
    for rows in sizes:
        for layout, chunk in FILE_LAYOUTS.items():
            work = Path(tempfile.mkdtemp(prefix="commit-mor-bench-"))
            try:
                write_start_table(str(work / "start"), rows, chunk=chunk or rows)
                files = len(DeltaTable(str(work / "start")).file_uris())
                sources = _events_sources(work / "events", rows, batch_rows, batches)
                figures: dict[str, list[float]] = {"rewrite": [], "merge_on_read": []}
                for name in figures:
                    uri = work / name
                    shutil.copytree(work / "start", uri)
                    for cache, size in ((file_cache.WRITTEN, SinkConfig.file_cache_bytes),
                                        (file_cache.PROBED, SinkConfig.probe_cache_bytes)):
                        cache.clear()
                        cache.resize(size)
                    mode = "merge-on-read" if name == "merge_on_read" else "auto"
                    target = DeltaTarget(str(uri), ["dt"], mode, allow_protocol_upgrade=True)
                    target.open_or_create(sources[0].schema, Contract(("id",), ("dt",), "event_time", "partitioned"))
                    # The copy, and the rewrite's gigabytes before it, flushed now: their
                    # writeback would land in these batches' file creations.
                    os.sync()
                    for b, source in enumerate(sources):
                        figures[name].append(_timed(lambda t=target, src=source, b=b: t.commit(
                            src, ["id"], "event_time", "bench", b, {}, True)))
                    shutil.rmtree(uri)
                result = {"table_rows": rows, "layout": layout, "files": files, "rows_per_file": rows // files,
                          "writes": [s.num_rows for s in sources],
                          **{k: [round(v, 3) for v in vs] for k, vs in figures.items()},
                          **{f"{k}_first": round(vs[0], 3) for k, vs in figures.items()},
                          **{f"{k}_warm_median": round(statistics.median(vs[2:]), 3) for k, vs in figures.items()}}
                log(f"commit of events batches, {rows:,} rows in {files} files ({layout}): rewrite first "
                    f"{result['rewrite_first']}s, warm {result['rewrite_warm_median']}s; merge-on-read first "
                    f"{result['merge_on_read_first']}s, warm {result['merge_on_read_warm_median']}s")
                out.append(result)
            finally:
                for cache in (file_cache.WRITTEN, file_cache.PROBED):
                    cache.clear()
                shutil.rmtree(work, ignore_errors=True)
    return out
