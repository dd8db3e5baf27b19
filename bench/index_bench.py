"""Index lifecycle figures: bootstrap keys/s, one cold partition load, bytes per entry on
disk, warm vs cold replica preparation. Writes bench/results/index-<date>.json.

    python -m bench.index_bench [--keys-per-partition 1000000] [--partitions 7]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import multiprocessing
import os
import platform
import shutil
import tempfile
import time
from pathlib import Path

import pyarrow as pa
from deltalake import DeltaTable, write_deltalake

from sink.delta_log.reading import read_commit
from sink.index.catchup import catch_up
from sink.index.lifecycle import ShardSource, bootstrap, load_partitions
from sink.index.replica import ShardReplica
from sink.index.spec import replica_spec

RESULTS = Path(__file__).resolve().parent / "results"
NOW = dt.datetime.now(dt.UTC)
SPEC = replica_spec(["id"], ["dt"], "event_time")


def make_table(uri: str, partitions: int, per_partition: int) -> None:
    for p in range(partitions):
        day = NOW - dt.timedelta(days=p)
        ids = pa.array([f"user-{p:02d}-{i:09d}" for i in range(per_partition)])
        times = pa.array([int(day.timestamp() * 1e6) - i for i in range(per_partition)], pa.int64())
        write_deltalake(uri, pa.table({
            "id": ids, "dt": pa.array([day.date().isoformat()] * per_partition),
            "event_time": times.cast(pa.timestamp("us", tz="UTC"))}),
            partition_by=["dt"], mode="append")


def _bootstrap_shard(uri: str, index: str, shard: int, shards: int, days: int) -> tuple[int, float]:
    table = DeltaTable(uri)
    with ShardReplica.open(Path(index) / f"shard-{shard}", SPEC) as replica:
        catch_up(replica, table.version(), lambda v: read_commit(uri, v, ["dt"]), "bench", shard)
        report = bootstrap(replica, ShardSource(table, None, ("id",), "event_time", shard, shards), ["dt"],
                           (None, "%Y-%m-%d"), None, days, NOW.timestamp())
    return report.keys, report.seconds


def du(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--keys-per-partition", type=int, default=1_000_000)
    parser.add_argument("--partitions", type=int, default=7)
    parser.add_argument("--shards", type=int, default=2)
    parser.add_argument("--name", default="index")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="sink-bench-"))
    uri = str(work / "table")
    try:
        t = time.perf_counter()
        make_table(uri, args.partitions, args.keys_per_partition)
        print(f"table: {args.partitions} x {args.keys_per_partition} keys in {time.perf_counter() - t:.1f}s")

        # Bootstrap: every shard in its own process, all at once (one per core).
        ctx = multiprocessing.get_context("spawn")
        t = time.perf_counter()
        with ctx.Pool(args.shards) as pool:
            per_shard = pool.starmap(_bootstrap_shard, [(uri, str(work / "boot"), s, args.shards, args.partitions)
                                                        for s in range(args.shards)])
        boot_wall = time.perf_counter() - t
        boot_keys = sum(k for k, _ in per_shard)
        boot_bytes = du(work / "boot")

        # One cold partition, one shard: the on-demand path.
        table = DeltaTable(uri)
        pid = f"dt={NOW.date().isoformat()}"
        with ShardReplica.open(work / "cold", SPEC) as replica:
            replica.set_version(table.version())
            t = time.perf_counter()
            cold = load_partitions(replica, ShardSource(table, None, ("id",), "event_time", 0, 1), [pid], "on_demand")
            cold_s = time.perf_counter() - t
        cold_bytes = du(work / "cold")

        # Preparing a replica for a batch: warm (nothing changed) vs cold (bootstrap).
        t = time.perf_counter()
        with ShardReplica.open(work / "boot" / "shard-0", SPEC) as replica:
            warm_report = catch_up(replica, table.version(), lambda v: read_commit(uri, v, ["dt"]), "bench", 0)
        warm_s = time.perf_counter() - t
        result = {
            "name": args.name, "date": NOW.isoformat(timespec="seconds"),
            "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
            "parameters": vars(args),
            "bootstrap": {"keys": boot_keys, "wall_seconds": round(boot_wall, 3),
                          "keys_per_second": round(boot_keys / boot_wall),
                          "per_shard_seconds": [round(s, 3) for _, s in per_shard],
                          "bytes_on_disk": boot_bytes, "bytes_per_entry": round(boot_bytes / boot_keys, 1)},
            "cold_partition": {"keys": cold.keys, "seconds": round(cold_s, 3),
                               "bytes_per_entry": round(cold_bytes / cold.keys, 1)},
            "warm_restart": {"seconds": round(warm_s, 4), "partitions_loaded": 0,
                             "log_entries_read": warm_report.commits_read},
        }
        RESULTS.mkdir(exist_ok=True)
        out = RESULTS / f"{args.name}-{NOW.date().isoformat()}.json"
        out.write_text(json.dumps(result, indent=2))
        print(json.dumps(result, indent=2))
        print(f"written to {out}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
