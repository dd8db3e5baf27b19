"""The driver's memory for one batch, executor tagging on two executors (local-cluster): how far
the driver's Python process rises above its peak before the batch. A table holds every other
key; a batch of N records of ~220 bytes, half updates of stored keys, half new keys. The table
and the batch's file are written by a child process, so that writing them does not set the
driver's peak; one batch size per process. `--commit-mode merge` measures the MERGE fallback:
the tagged writes stay on the executors, where delta-rs' MERGE reads them in one Spark task
(`--engine deltalake`) or Spark's MERGE does (`--engine delta-spark`); `--scd-type 2` a history table (every stored
key one version, which the batch's updates close). The table after the batch is checked
against its expected contents (a history table's current versions, and one closed version
per update).

    python -m bench.driver_memory --records 1000000 --commit-mode auto --out r.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

MASTER = "local-cluster[2,1,2048]"  # as the issue measured it; the MERGE fallback needs it at 1M
SCHEMA = pa.schema([("id", pa.int64()), ("dt", pa.string()), ("seq", pa.int64()), ("payload", pa.string())])
DAYS = 30
PAYLOAD_BYTES = 180


def rows(keys: np.ndarray, seq: int) -> pa.Table:
    """~220 bytes a record in Arrow: id, day, sequence and a payload varying by key."""
    filler = "x" * (PAYLOAD_BYTES - 20)
    payload = pc.binary_join_element_wise(pc.cast(pa.array(keys * 7919 + seq), pa.string()), filler, "-")
    days = pa.array([f"2026-01-{d + 1:02d}" for d in range(DAYS)])
    return pa.table({"id": pa.array(keys, pa.int64()), "dt": days.take(pa.array(keys % DAYS)),
                     "seq": pa.array(np.full(len(keys), seq), pa.int64()), "payload": payload}, schema=SCHEMA)


def seed(uri: str, landing: str, n: int, scd_type: int) -> None:
    """The table (keys 0, 2, .. 2n-2) and the batch (half of them updated, n/2 odd keys new);
    a history table's stored keys have one current version each."""
    from deltalake import write_deltalake

    table = rows(np.arange(0, 2 * n, 2), 1)
    if scd_type == 2:
        from sink.history import END_AT, RUN_EVENTS, START_AT

        runs = pa.array([[]] * len(table), pa.list_(pa.struct([("seq", pa.int64())])))
        table = (table.append_column(START_AT, table.column("seq"))
                 .append_column(END_AT, pa.nulls(len(table), pa.int64())).append_column(RUN_EVENTS, runs))
    write_deltalake(uri, table, partition_by=["dt"])
    updated = np.arange(0, n, 1) * 2  # the first n/2 stored keys ...
    batch = np.concatenate([updated[: n // 2], np.arange(1, n, 2)[: n - n // 2]])  # ... and n/2 new odd keys
    Path(landing).mkdir(parents=True)
    pq.write_table(rows(batch, 2), f"{landing}/batch.parquet")


def expected(uri_seed_keys: np.ndarray, batch: pa.Table) -> pa.Table:
    stored = rows(uri_seed_keys, 1)
    kept = stored.filter(pc.invert(pc.is_in(stored.column("id"), batch.column("id"))))
    return pa.concat_tables([kept, batch]).sort_by("id")


def peak_mb() -> float:
    """This process's peak RSS. VmHWM, not getrusage's ru_maxrss: Linux keeps ru_maxrss across
    fork and exec, so a child of a large process (make bench's) would report its parent's peak."""
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith("VmHWM:"))
    return int(line.split()[1]) / 1024  # kB


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, required=True)
    parser.add_argument("--commit-mode", choices=["auto", "merge"], default="auto")
    parser.add_argument("--scd-type", type=int, choices=[1, 2], default=1)
    parser.add_argument("--engine", choices=["deltalake", "delta-spark"], default="deltalake")
    parser.add_argument("--out", required=True)
    parser.add_argument("--seed", nargs=3, metavar=("URI", "LANDING", "N"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.seed:
        seed(args.seed[0], args.seed[1], int(args.seed[2]), args.scd_type)
        return

    import pyspark
    from deltalake import DeltaTable

    from jobs.spark_session import spark_session
    from sink import SinkConfig, UpsertSink

    os.environ.setdefault("SPARK_HOME", os.path.dirname(pyspark.__file__))
    spark = spark_session("bench-driver-memory", MASTER, {
        "spark.sql.shuffle.partitions": "2", "spark.default.parallelism": "2", "spark.ui.enabled": "false",
        "spark.executor.memory": "2g"}, delta=args.engine == "delta-spark")
    spark.sparkContext.setLogLevel("ERROR")
    work = Path(tempfile.mkdtemp(prefix="sink-driver-memory-"))
    n = args.records
    try:
        uri, landing = str(work / "table"), str(work / "landing")
        subprocess.run([sys.executable, "-m", "bench.driver_memory", "--records", "0", "--out", "-",
                        "--scd-type", str(args.scd_type), "--seed", uri, landing, str(n)], check=True,
                       cwd=Path(__file__).resolve().parent.parent)
        sink = UpsertSink(SinkConfig(table_uri=uri, key=["id"], partition_by=["dt"], ordering="seq",
                                     tag_on="executors", num_shards=2, bootstrap_days=0, metrics_port=0,
                                     commit_mode=args.commit_mode, writer_id="driver-memory",
                                     scd_type=args.scd_type, engine=args.engine))
        batch = spark.read.parquet(landing)
        sink(batch.limit(0), 0)  # the sink's modules and the replicas' first open, before measuring
        before = peak_mb()
        started = time.perf_counter()
        sink(batch, 1)
        seconds = time.perf_counter() - started
        rise = peak_mb() - before
        report = sink.reports[-1]
        got = DeltaTable(uri).to_pyarrow_table()
        closed = 0
        if args.scd_type == 2:  # the current versions as type 1's rows, and one closed version per update
            ended = pc.is_valid(got.column("__END_AT"))
            closed = got.filter(pc.and_(ended, pc.equal(got.column("__END_AT"), 2))).num_rows
            got = got.filter(pc.invert(ended))
        got = got.select(SCHEMA.names).cast(SCHEMA).sort_by("id")
        exact = got.equals(expected(np.arange(0, 2 * n, 2), pq.read_table(landing).cast(SCHEMA))) and (
            closed == (n // 2 if args.scd_type == 2 else 0))
    finally:
        spark.stop()
        shutil.rmtree(work, ignore_errors=True)
    case = {"records": n, "commit_mode": args.commit_mode, "scd_type": args.scd_type, "engine": args.engine,
            # Since the MERGE fallback under deltalake runs in a Spark task (earlier runs collected the batch).
            "merge_in_task": args.commit_mode == "merge" and args.engine == "deltalake",
            "driver_peak_before_mb": round(before, 1),
            "driver_peak_rise_mb": round(rise, 1), "batch_seconds": round(seconds, 2), "mode": report.mode,
            "inserted": report.ops["insert"], "updated": report.ops["update"], "table_exact": exact}
    print(f"{n:>9,} records, {args.engine}, commit_mode={args.commit_mode}, scd_type={args.scd_type}: driver peak "
          f"+{rise:,.0f} MB, {seconds:.1f} s, mode={report.mode}, exact={exact}", flush=True)
    Path(args.out).write_text(json.dumps({"master": MASTER, **case}, indent=1))


if __name__ == "__main__":
    main()
