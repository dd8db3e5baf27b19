"""Workload `global`: keys unique across a table of 365 daily partitions, side by side with
the best hand-written foreachBatch MERGE that has no index (it must join on the key alone).

Each 100k-record batch: 90% inserts dated today, a tenth of them re-sends of existing keys
of any age (at-least-once sources; they carry the stored row, so with ties = "existing"
they change nothing); 9.99% updates of keys from the last 3 days, a tenth of them moving to
today; 0.01% key-only deletes of keys of any age. `spread`: the adversarial case, updates of
keys of any age. Both tables end equal to an independent oracle (pyarrow, not Spark).

    python -m bench.global_bench --sizes 1000000 10000000 --batches 4 --out r.json
    python -m bench.global_bench --sizes 50000000 --batches 5 --workloads global --out r50.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from deltalake import CommitProperties, DeltaTable, Transaction, write_deltalake
from pyspark.sql import Window
from pyspark.sql import functions as F

from bench.baseline import SparkMerge
from bench.e2e import breakdown, index_memory, median_after_first, report_figures, stream
from bench.workloads import SCHEMA

DAYS = 365
TODAY = dt.date.today()
_EPOCH_US = int(dt.datetime.combine(TODAY, dt.time(), dt.UTC).timestamp() * 1e6)
_DAY_US = 86_400 * 1_000_000
_DATES = np.array([(TODAY - dt.timedelta(days=d)).isoformat() for d in range(DAYS)], dtype=object)


def _stored(keys: np.ndarray) -> pa.Table:
    """The starting table's rows of `keys`: a pure function of the key, so a re-send can
    carry exactly the stored row."""
    days = keys % DAYS
    return _rows(keys, _DATES[days], _EPOCH_US - days * _DAY_US + (keys * 7919) % (_DAY_US // 2),
                 np.full(len(keys), "u", object), (keys % 49_999) / 100.0)


def _rows(keys, dates, times_us, ops, amounts) -> pa.Table:
    return pa.table({
        "id": pc.binary_join_element_wise("user-", pc.cast(pa.array(keys), pa.string()), ""),
        "dt": pa.array(dates, pa.string()),
        "event_time": pa.array(times_us, pa.int64()).cast(pa.timestamp("us", tz="UTC")),
        "op": pa.array(ops, pa.string()),
        "amount": pa.array(amounts, pa.float64()),
        "payload": pc.binary_join_element_wise("payload-", pc.cast(pa.array(keys % 9973), pa.string()), ""),
    }, schema=SCHEMA)


def write_start_table(uri: str, rows: int) -> None:
    for start in range(0, rows, 2_000_000):
        write_deltalake(uri, _stored(np.arange(start, min(rows, start + 2_000_000))), partition_by=["dt"],
                        mode="append")


def write_batches(landing: Path, table_rows: int, batches: int, batch_rows: int, spread: bool,
                  seed: int = 7) -> None:
    """One Parquet file per batch (see the module docstring for the mix)."""
    rng = np.random.default_rng(seed)
    landing.mkdir(parents=True, exist_ok=True)
    deleted: set[int] = set()
    updated: set[int] = set()  # a re-send must carry the stored row: never one of these
    next_key = table_rows
    recent = np.flatnonzero(np.arange(table_rows) % DAYS < 3)  # the last 3 days, growing with today's inserts
    for b in range(batches):
        n_ins = int(batch_rows * 0.9)
        n_resend = n_ins // 10
        n_del = max(1, int(batch_rows * 0.0001))
        n_upd = batch_rows - n_ins - n_del
        now_us = _EPOCH_US + _DAY_US // 2 + (b + 1) * 60_000_000
        pool = np.arange(table_rows) if spread else recent
        drawn = rng.choice(pool, min(len(pool), 2 * n_upd), replace=False)
        upd = np.array([k for k in drawn.tolist() if k not in deleted][:n_upd], np.int64)
        dele = np.array([k for k in rng.integers(0, table_rows, 4 * n_del).tolist()
                         if k not in deleted and k not in set(upd.tolist())][:n_del], np.int64)
        updated.update(upd.tolist())
        deleted.update(dele.tolist())
        resend = np.array([k for k in dict.fromkeys(rng.integers(0, table_rows, 2 * n_resend).tolist())
                           if k not in updated and k not in deleted][:n_resend], np.int64)
        new = np.arange(next_key, next_key + n_ins - len(resend))
        next_key += len(new)
        recent = np.concatenate([recent, new])
        moving = rng.random(len(upd)) < 0.1
        upd_dates = np.where(moving | (upd >= table_rows), _DATES[0], _DATES[upd % DAYS])
        parts = [
            _rows(new, np.full(len(new), _DATES[0], object), now_us + rng.integers(0, 1000, len(new)),
                  np.full(len(new), "c", object), rng.uniform(1, 500, len(new))),
            _stored(resend),
            _rows(upd, upd_dates, np.full(len(upd), now_us), np.full(len(upd), "u", object),
                  rng.uniform(1, 500, len(upd))),
            _rows(dele, np.full(len(dele), None, object), np.full(len(dele), now_us),
                  np.full(len(dele), "d", object), np.zeros(len(dele))),
        ]
        table = pa.concat_tables(parts)
        pq.write_table(table.take(pa.array(rng.permutation(table.num_rows))), landing / f"batch-{b:04d}.parquet")


def oracle(table_rows: int, landing: Path) -> pa.Table:
    """Per key the record with the highest ordering wins, the stored row on a tie (ties =
    "existing"), then the earlier batch; a winning delete removes the key."""
    parts = [_stored(np.arange(table_rows)).append_column("_b", pa.array(np.full(table_rows, -1)))]
    for b, path in enumerate(sorted(landing.glob("*.parquet"))):
        t = pq.read_table(path)
        parts.append(t.append_column("_b", pa.array(np.full(t.num_rows, b))))
    rows = pa.concat_tables(parts)
    rows = rows.take(pc.sort_indices(rows, [("id", "ascending"), ("event_time", "descending"), ("_b", "ascending")]))
    ids = rows.column("id").combine_chunks()
    first = np.ones(rows.num_rows, bool)
    first[1:] = ~pc.equal(ids[1:], ids[:-1]).to_numpy(zero_copy_only=False)
    winners = rows.filter(pa.array(first))
    return _sorted(winners.filter(pc.not_equal(winners.column("op"), "d")).drop_columns(["_b"]))


def _sorted(table: pa.Table) -> pa.Table:
    return table.select(SCHEMA.names).cast(SCHEMA).sort_by([("id", "ascending")]).combine_chunks()


class GlobalHandWrittenMerge:
    """The best foreachBatch MERGE without an index: skip committed batch ids, dedupe by key,
    MERGE ON the key only (a key may live in any partition), updating every column so a
    changed `dt` moves the row, deleting by key; ties keep the stored row."""

    def __init__(self, uri: str, app_id: str = "hand-written-global"):
        self.uri, self.app_id = uri, app_id
        self.merge_seconds: list[float] = []  # per batch: the MERGE alone, as the sink's commit phase

    def __call__(self, df, batch_id: int) -> None:
        table = DeltaTable(self.uri)
        done = table.transaction_version(self.app_id)
        if done is not None and batch_id <= done:
            return
        latest = Window.partitionBy("id").orderBy(F.col("event_time").desc(), F.col("_seq").asc())
        source = (df.withColumn("_seq", F.monotonically_increasing_id())
                  .withColumn("_rn", F.row_number().over(latest)).filter("_rn = 1").drop("_rn", "_seq").toArrow())
        started = time.perf_counter()
        (table.merge(source, predicate="t.id = s.id", source_alias="s", target_alias="t", streamed_exec=False,
                     commit_properties=CommitProperties(app_transactions=[Transaction(self.app_id, batch_id)]))
         .when_matched_delete(predicate="s.op = 'd' AND t.event_time < s.event_time")
         .when_matched_update_all(predicate="s.op <> 'd' AND t.event_time < s.event_time")
         .when_not_matched_insert_all(predicate="s.op <> 'd'")
         .execute())
        self.merge_seconds.append(time.perf_counter() - started)


def run_case(spark, work: Path, table_rows: int, batches: int, batch_rows: int, spread: bool,
             shards: int = 2) -> dict:
    from sink import SinkConfig, UpsertSink
    from sink.lakehouse.commit import file_cache

    case = work / f"global-{table_rows}-{'spread' if spread else 'recent'}"
    template, landing = case / "start", case / "landing"
    started = time.perf_counter()
    write_start_table(str(template), table_rows)
    write_batches(landing, table_rows, batches, batch_rows, spread)
    setup = time.perf_counter() - started
    out: dict = {"workload": "global-spread" if spread else "global", "table_rows": table_rows,
                 "batches": batches, "batch_rows": batch_rows, "setup_seconds": round(setup, 1)}
    expected = oracle(table_rows, landing)

    uri = case / "sink" / "table"
    shutil.copytree(template, uri)
    cfg = SinkConfig(table_uri=str(uri), key=["id"], partition_by=["dt"], ordering="event_time",
                     delete_when="op = 'd'", scope="global", ties="existing", checkpoint_dir=str(case / "sink" / "cp"),
                     index_dir=str(case / "sink" / "index"), num_shards=shards, metrics_port=0)
    file_cache.WRITTEN.clear()  # the previous case's files
    sink = UpsertSink(cfg)
    seconds, reports, _ = stream(spark, landing, case / "sink" / "cp", sink)
    sink.close()  # saves the key filters
    keys = expected.num_rows  # the index also holds the few deleted keys' tombstones
    rocksdb_memory, key_filter_memory = index_memory(case / "sink" / "index")
    out["sink"] = {
        "batch_seconds": [round(s, 3) for s in seconds], "median_after_first": round(median_after_first(seconds), 3),
        **report_figures(reports, remote=False),
        "above_commit": round(median_after_first([s - r.commit_seconds for s, r in zip(seconds, reports)]), 3),
        "ops": [r.ops for r in reports],
        # No partition loads after bootstrap: the keyspace is exact, so none is a false positive.
        "loads_after_bootstrap": sum(sum(r.partition_loads.values()) for r in reports[1:]),
        "index_memory_bytes_per_key": round(rocksdb_memory / keys, 3),
        "key_filter_bytes_per_key": round(key_filter_memory / keys, 3),
        # New keys the key filter let through to RocksDB, which did not hold them, per batch.
        "key_filter_false_positives": [r.misses - r.filter_misses for r in reports],
        "table_equal_to_oracle": _sorted(DeltaTable(str(uri)).to_pyarrow_table()).equals(expected),
    }
    shutil.rmtree(case / "sink")

    uri = case / "baseline" / "table"
    shutil.copytree(template, uri)
    merge = GlobalHandWrittenMerge(str(uri))
    seconds, _, merge_seconds = stream(spark, landing, case / "baseline" / "cp", merge)
    out["baseline"] = {
        "batch_seconds": [round(s, 3) for s in seconds], "median_after_first": round(median_after_first(seconds), 3),
        "above_commit": round(median_after_first([s - m for s, m in zip(seconds, merge_seconds)]), 3),
        "table_equal_to_oracle": _sorted(DeltaTable(str(uri)).to_pyarrow_table()).equals(expected),
    }
    # What a Spark user writes: the same MERGE ON the key alone, in delta-spark.
    uri = case / "spark-merge" / "table"
    shutil.copytree(template, uri)
    merge = SparkMerge(str(uri), careful=False, scope="global")
    seconds, _, merge_seconds = stream(spark, landing, case / "spark-merge" / "cp", merge)
    out["spark-merge"] = {
        "batch_seconds": [round(s, 3) for s in seconds], "median_after_first": round(median_after_first(seconds), 3),
        "above_commit": round(median_after_first([s - m for s, m in zip(seconds, merge_seconds)]), 3),
        "table_equal_to_oracle": _sorted(DeltaTable(str(uri)).to_pyarrow_table()).equals(expected),
    }
    for base in ("baseline", "spark-merge"):
        ratio = out[base]["median_after_first"] / out["sink"]["median_after_first"]
        out[f"ratio_{base.replace('-', '_')}_over_sink"] = round(ratio, 2)
    shutil.rmtree(case)
    return out


WORKLOADS = ("global", "global-spread")


def run(spark, work: Path, sizes: list[int], batches: int, batch_rows: int, log=print,
        workloads: tuple[str, ...] = WORKLOADS) -> list[dict]:
    results = []
    for spread in [w == "global-spread" for w in workloads]:
        for rows in sizes:
            result = run_case(spark, work, rows, batches, batch_rows, spread)
            log(f"{result['workload']} {rows:,}: sink {result['sink']['median_after_first']}s, baseline "
                f"{result['baseline']['median_after_first']}s ({result['ratio_baseline_over_sink']}x), delta-spark "
                f"{result['spark-merge']['median_after_first']}s ({result['ratio_spark_merge_over_sink']}x); "
                f"equal to the oracle: {result['sink']['table_equal_to_oracle']}/"
                f"{result['baseline']['table_equal_to_oracle']}/{result['spark-merge']['table_equal_to_oracle']}; "
                "index memory "
                f"{result['sink']['index_memory_bytes_per_key']} B/key, key filter "
                f"{result['sink']['key_filter_bytes_per_key']} B/key, its false positives per batch "
                f"{result['sink']['key_filter_false_positives']}")
            log(f"  sink phases (s): {breakdown(result['sink']['phases'])}")
            results.append(result)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", required=True)
    parser.add_argument("--batches", type=int, default=4)
    parser.add_argument("--batch-rows", type=int, default=100_000)
    parser.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    from jobs.spark_session import spark_session

    spark = spark_session("bench-global", "local[2]", {"spark.sql.shuffle.partitions": "2",
                                                       "spark.ui.enabled": "false", **SparkMerge.SESSION_CONF},
                          delta=True)
    spark.sparkContext.setLogLevel("ERROR")
    work = Path(tempfile.mkdtemp(prefix="sink-global-"))
    try:
        results = run(spark, work, args.sizes, args.batches, args.batch_rows, workloads=tuple(args.workloads))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    spark.stop()
    Path(args.out).write_text(json.dumps({"cases": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
