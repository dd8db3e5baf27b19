"""`make bench` / `make bench-quick`: every benchmark, one JSON and one PNG per run.

    python -m bench.run --quick        # small sizes, a few minutes
    python -m bench.run                # 1M, 5M and 10M-row tables (hours on 2 cores)
    python -m bench.run --against-spark --sizes 10000000 --batches 3
                                       # only the sink against delta-spark's MERGE (its cases below)
    python -m bench.run --deletion-vectors --sizes 10000000 --batches 3
                                       # only its deletion-vector, table-feature and commit cases
    python -m bench.run --kafka --keys 1000000
                                       # Debezium messages from a Kafka broker (bench/kafka_bench.py)
    python -m bench.run --mirror --sizes 1000000 10000000 --batches 4
                                       # only a database table's mirror: unpartitioned, updates
                                       # anywhere (bench/mirror_bench.py)
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.metadata as md
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import commit_bench, e2e, global_bench, history_bench, mirror_bench, tagging_bench
from bench.baseline import SparkMerge

RESULTS = Path(__file__).resolve().parent / "results"

QUICK = {"sizes": [1_000_000], "workloads": ["events", "insert-only"], "batches": 3, "tiny_batches": 6,
         "batch_rows": 100_000,
         "tag_index_keys": 200_000, "index_partitions": 2, "index_keys_per_partition": 200_000,
         "commit_sizes": [1_000_000], "commit_repeats": 1, "global_sizes": [200_000],
         "memory_sizes": [100_000, 1_000_000], "history_sizes": [1_000_000], "mirror_sizes": [200_000]}
FULL = {"sizes": [1_000_000, 5_000_000, 10_000_000],
        "workloads": ["events", "insert-only", "update-heavy", "recent-updates"],
        "batches": 6, "tiny_batches": 12, "batch_rows": 100_000, "tag_index_keys": 1_000_000, "index_partitions": 7,
        "index_keys_per_partition": 1_000_000, "commit_sizes": [1_000_000, 5_000_000, 10_000_000],
        "commit_repeats": 2, "global_sizes": [1_000_000, 10_000_000], "memory_sizes": [100_000, 1_000_000],
        "history_sizes": [1_000_000, 10_000_000], "mirror_sizes": [1_000_000, 10_000_000, 50_000_000]}


TINY_BATCH_ROWS = [1, 100, 1000]

# `--against-spark`: the sink against the MERGE Spark users write (delta-spark's, as documented
# and with the batch's partitions in ON), the delta-rs one for reference.
AGAINST_SPARK = {"workloads": ["events", "update-heavy", "insert-only"],
                 "contenders": ("sink", "sink-executors", "baseline", "spark-merge", "spark-merge-careful")}


def machine() -> dict:
    versions = {p: md.version(p) for p in ("pyspark", "deltalake", "rocksdict", "pyarrow", "xxhash")}
    java = subprocess.run(["java", "-version"], capture_output=True, text=True).stderr.splitlines()[0]
    return {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
            "java": java, "versions": versions}


def index_figures(partitions: int, per_partition: int) -> dict:
    """bench.index_bench in a child process (it forks workers; keep them away from Spark)."""
    out = subprocess.run([sys.executable, "-m", "bench.index_bench", "--partitions", str(partitions),
                          "--keys-per-partition", str(per_partition), "--name", "index-run"],
                         capture_output=True, text=True, check=True, cwd=Path(__file__).resolve().parent.parent)
    path = out.stdout.strip().splitlines()[-1].removeprefix("written to ")
    result = json.loads(Path(path).read_text())
    Path(path).unlink()
    return result


def two_executor_figures(params: dict) -> list[dict]:
    """bench.two_executors in a child process (a second Spark application)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "two-executors.json"
        subprocess.run([sys.executable, "-m", "bench.two_executors", "--sizes", *map(str, params["sizes"]),
                        # Twice the batches: shards move back and forth once replicas exist on both.
                        "--batches", str(2 * params["batches"]), "--batch-rows", str(params["batch_rows"]),
                        "--out", str(out)], check=True, cwd=Path(__file__).resolve().parent.parent)
        return json.loads(out.read_text())["cases"]


def connect_figures(params: dict) -> list[dict]:
    """bench.connect_bench in a child process (a process holds one kind of session)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "connect.json"
        subprocess.run([sys.executable, "-m", "bench.connect_bench", "--sizes", str(params["sizes"][0]),
                        "--batches", str(params["batches"]), "--batch-rows", str(params["batch_rows"]),
                        "--out", str(out)], check=True, cwd=Path(__file__).resolve().parent.parent)
        return json.loads(out.read_text())["cases"]


def driver_memory_figures(sizes: list[int]) -> list[dict]:
    """bench.driver_memory, one child process per size and commit mode (a Spark application
    each, and its own peak RSS): the executors writing the files, the MERGE fallback (delta-rs'
    in a Spark task, Spark's, both from the executors' writes), and the executors writing a history table's
    (scd_type 2) files."""
    cases = []
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "driver-memory.json"
        for mode, scd_type, engine in (("auto", 1, "deltalake"), ("merge", 1, "deltalake"),
                                       ("merge", 1, "delta-spark"), ("auto", 2, "deltalake")):
            for n in sizes:
                subprocess.run([sys.executable, "-m", "bench.driver_memory", "--records", str(n), "--commit-mode", mode,
                                "--scd-type", str(scd_type), "--engine", engine, "--out", str(out)], check=True,
                               cwd=Path(__file__).resolve().parent.parent)
                cases.append(json.loads(out.read_text()))
    return cases


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = result["e2e"]
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    labels = [f"{c['workload']}\n{c['table_rows'] // 1_000_000}M rows" for c in cases]
    x = range(len(cases))
    bars = [(name, color, label) for name, color, label in [
        ("baseline", "#999999", "hand-written MERGE (delta-rs)"),
        ("spark-merge", "#d62728", "delta-spark MERGE, as documented"),
        ("spark-merge-careful", "#9467bd", "delta-spark MERGE, partitions in ON"),
        ("sink", "#2ca02c", "sink, default (driver tagging here)"),
        ("sink-executors", "#1f77b4", "sink (executor tagging)"),
        ("sink-merge", "#ff7f0e", "sink, MERGE commit")] if name in cases[0]]
    width = 0.8 / len(bars)
    for i, (name, color, label) in enumerate(bars):
        axes[0].bar([p + (i - (len(bars) - 1) / 2) * width for p in x], [c[name]["median_after_first"] for c in cases],
                    width, label=label, color=color)
    axes[0].set_xticks(list(x), labels, fontsize=7, rotation=30, ha="right")
    axes[0].set_ylabel("seconds per 100k-record batch (median)")
    axes[0].set_title("End to end, side by side")
    axes[0].legend(fontsize=8)
    commits = result["commit"]
    for key, label in [("append_median", "append"), ("rewrite_median", "rewrite (sink)"),
                       ("merge_pruned_median", "MERGE, pruned"),
                       ("merge_unpruned_median", "MERGE, unpruned")]:
        axes[1].plot([c["table_rows"] / 1e6 for c in commits], [c[key] for c in commits], marker="o", label=label)
    axes[1].set_xlabel("table rows (millions)")
    axes[1].set_ylabel("seconds per commit (median)")
    axes[1].set_title("The Delta commit alone (100k rows)")
    axes[1].legend(fontsize=8)
    fig.suptitle(f"{result['name']} {result['date']} - {result['machine']['cpus']} cores")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def against_spark(spark, work: Path, params: dict, result: dict, save) -> None:
    """The end-to-end cases against delta-spark's MERGE, its deletion-vector variant and global
    scope, at `params`' sizes, on local[2] (the two-executor case runs in a child process
    later); `save()` after each, so that a failure late in an hour's run keeps the rest."""
    e2e.warm_up(spark, work, num_shards=2, batch_rows=params["batch_rows"])
    result["e2e"] = e2e.run(spark, work, params["sizes"], AGAINST_SPARK["workloads"], params["batches"],
                            params["batch_rows"], num_shards=2, contenders=AGAINST_SPARK["contenders"])
    save()
    result["e2e_deletion_vectors"] = deletion_vector_figures(spark, work, params)
    save()
    result["e2e_table_features"] = table_feature_figures(spark, work, params)
    save()
    result["commit_merge_on_read"] = commit_merge_on_read_figures(spark, work, params)
    save()
    result["global"] = global_bench.run(spark, work, params["sizes"], params["batches"], params["batch_rows"],
                                        workloads=("global",))
    save()


def deletion_vector_figures(spark, work: Path, params: dict) -> list[dict]:
    """The events and update-heavy cases on a table with deletion vectors: delta-spark's careful
    MERGE against the sink's merge-on-read, both tagging paths."""
    return e2e.run(spark, work, params["sizes"], ["events", "update-heavy"], params["batches"], params["batch_rows"],
                   num_shards=2, contenders=("baseline", "spark-merge-careful-dv", *e2e.DELETION_VECTORS))


def table_feature_figures(spark, work: Path, params: dict) -> list[dict]:
    """The events case on a table with the change data feed, one with a CHECK constraint, and
    one with every feature at once (e2e.VARIANTS): delta-spark's careful MERGE against the sink,
    both tagging paths."""
    return e2e.run(spark, work, params["sizes"], ["events"], params["batches"], params["batch_rows"], num_shards=2,
                   contenders=e2e.VARIANT_CONTENDERS, variants=tuple(e2e.VARIANTS))


def commit_merge_on_read_figures(spark, work: Path, params: dict) -> list[dict]:
    """The commit phase alone (no Spark) of consecutive events batches' writes, rewrite against
    merge-on-read, on tables of the same rows in small and in large files."""
    return commit_bench.merge_on_read(params["sizes"], params["batch_rows"], batches=5)


def verification_figures(spark, work: Path, params: dict) -> list[dict]:
    """The sampled verification's cost (verify_fraction, default 0.01): the events case with it
    on and off, under both tagging paths."""
    return e2e.run(spark, work, params["sizes"][:1], ["events"], params["batches"], params["batch_rows"],
                   num_shards=2, contenders=e2e.VERIFICATION)


def kafka(keys: int, started: float) -> None:
    from bench import kafka_bench
    from jobs.spark_session import spark_session

    params = {"keys": keys, "updates": keys, "batch_offsets": 200_000, "trigger_seconds": 10, "paced_seconds": 90}
    result = {"name": "kafka", "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), "machine": machine(),
              "parameters": params}
    spark = spark_session("bench-kafka", "local[2]", {"spark.sql.shuffle.partitions": "2", "spark.ui.enabled": "false"},
                          delta=True, kafka=True)
    spark.sparkContext.setLogLevel("ERROR")
    work = Path(tempfile.mkdtemp(prefix="sink-kafka-"))
    try:
        result["kafka"] = kafka_bench.run(spark, work, **params)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        spark.stop()
    write(result, started, plotted=False)


def e2e_session():
    """local[2], with Delta's Spark engine: the delta-spark MERGE baselines run in it."""
    from jobs.spark_session import spark_session

    spark = spark_session("bench", "local[2]", {"spark.sql.shuffle.partitions": "2", "spark.ui.enabled": "false",
                                                **SparkMerge.SESSION_CONF}, delta=True)
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--against-spark", action="store_true",
                        help="only the sink against delta-spark's MERGE: end to end, deletion vectors, global scope, "
                             "two executors")
    parser.add_argument("--deletion-vectors", action="store_true",
                        help="only the deletion-vector, table-feature and merge-on-read commit cases of "
                             "--against-spark")
    parser.add_argument("--sizes", type=int, nargs="+",
                        help="with --against-spark or --deletion-vectors: table rows (default: the run's)")
    parser.add_argument("--batches", type=int, help="with --against-spark, --deletion-vectors or --verification: "
                                                    "batches a case (default: the run's)")
    parser.add_argument("--kafka", action="store_true",
                        help="only Debezium-shaped messages from a Kafka broker: the sink against a plain append "
                             "query, and its freshness at half its rate (make cdc-stack installs the broker)")
    parser.add_argument("--keys", type=int, default=1_000_000, help="with --kafka: keys (and as many updates)")
    parser.add_argument("--mirror", action="store_true",
                        help="only the mirror of a database table (unpartitioned, updates anywhere) against "
                             "delta-spark's MERGE, plain and with deletion vectors (default sizes: 1M, 10M, 50M)")
    parser.add_argument("--verification", action="store_true",
                        help="only the sampled verification's cost (events, the run's first size)")
    args = parser.parse_args()
    params = QUICK if args.quick else FULL
    name = "quick" if args.quick else "full"
    started = time.perf_counter()
    if args.kafka:
        kafka(args.keys, started)
        return
    if args.mirror:
        params = {"sizes": args.sizes or FULL["mirror_sizes"], "batches": args.batches or 4,
                  "batch_rows": FULL["batch_rows"]}
        result = {"name": "mirror", "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
                  "machine": machine(), "parameters": params}
        spark = e2e_session()
        work = Path(tempfile.mkdtemp(prefix="sink-mirror-"))
        try:
            result["mirror"] = []
            for size in params["sizes"]:  # saved size by size: a 50M case takes hours
                result["mirror"] += mirror_bench.run(spark, work, [size], params["batches"], params["batch_rows"])
                write(result, started, plotted=False)
        finally:
            shutil.rmtree(work, ignore_errors=True)
            spark.stop()
        return
    if args.verification or args.deletion_vectors:
        params = {**params, "sizes": args.sizes or params["sizes"], "batches": args.batches or params["batches"]}
        cases = ({"verification": verification_figures} if args.verification else
                 {"e2e_deletion_vectors": deletion_vector_figures, "e2e_table_features": table_feature_figures,
                  "commit_merge_on_read": commit_merge_on_read_figures})
        result = {"name": f"{next(iter(cases)).removeprefix('e2e_').replace('_', '-')}-{name}",
                  "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), "machine": machine(),
                  "parameters": params}
        spark = e2e_session()
        work = Path(tempfile.mkdtemp(prefix="sink-e2e-"))
        try:
            e2e.warm_up(spark, work, num_shards=2, batch_rows=params["batch_rows"])
            for case, figures in cases.items():
                result[case] = figures(spark, work, params)
                write(result, started, plotted=False)
        finally:
            shutil.rmtree(work, ignore_errors=True)
            spark.stop()
        write(result, started, plotted=False)
        return
    if args.against_spark:
        params = {**params, "sizes": args.sizes or params["sizes"], "batches": args.batches or params["batches"]}
        result = {"name": "against-spark", "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
                  "machine": machine(), "parameters": {**params, **AGAINST_SPARK}}
        spark = e2e_session()
        work = Path(tempfile.mkdtemp(prefix="sink-e2e-"))
        try:
            against_spark(spark, work, params, result, lambda: write(result, started, plotted=False))
        finally:
            shutil.rmtree(work, ignore_errors=True)
            spark.stop()
        print("== events on two executors (local-cluster), executor tagging", flush=True)
        result["e2e_two_executors"] = two_executor_figures(params)
        write(result, started, plotted=False)
        return
    result = {"name": name, "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
              "machine": machine(), "parameters": params}
    print(f"== tagging ({params['tag_index_keys']:,} keys indexed)", flush=True)
    result["tagging"] = tagging_bench.run(params["tag_index_keys"], params["batch_rows"], 200_000)
    print(f"== index ({params['index_partitions']} x {params['index_keys_per_partition']:,} keys)", flush=True)
    result["index"] = index_figures(params["index_partitions"], params["index_keys_per_partition"])
    print(f"== commit ({result['index']['bootstrap']['keys_per_second']:,} bootstrap keys/s above)", flush=True)
    result["commit"] = commit_bench.run(params["commit_sizes"], params["batch_rows"], params["commit_repeats"])
    print("== the commit of events batches by merge-on-read, small and large files", flush=True)
    result["commit_merge_on_read"] = commit_bench.merge_on_read(params["sizes"][-1:], params["batch_rows"], batches=5)
    print("== end to end", flush=True)
    spark = e2e_session()
    work = Path(tempfile.mkdtemp(prefix="sink-e2e-"))
    try:
        e2e.warm_up(spark, work, num_shards=2, batch_rows=params["batch_rows"])
        result["e2e"] = e2e.run(spark, work, params["sizes"], params["workloads"], params["batches"],
                                params["batch_rows"], num_shards=2)
        print("== delta-spark's MERGE on a table with deletion vectors (events, update-heavy)", flush=True)
        result["e2e_deletion_vectors"] = deletion_vector_figures(spark, work, params)
        print("== delta-spark's MERGE on tables with the change data feed, a CHECK constraint, all features",
              flush=True)
        result["e2e_table_features"] = table_feature_figures(spark, work, params)
        print("== the sampled verification's cost (events, verify_fraction on and off)", flush=True)
        result["verification"] = verification_figures(spark, work, params)
        print("== tiny batches (events mix)", flush=True)
        result["e2e_tiny"] = e2e.run_tiny(spark, work, params["sizes"][0], TINY_BATCH_ROWS, params["tiny_batches"])
        print("== global scope (365 partitions, against a MERGE on the key alone)", flush=True)
        result["global"] = global_bench.run(spark, work, params["global_sizes"], params["batches"],
                                            params["batch_rows"])
        print("== a database table's mirror (unpartitioned, updates anywhere), plain and deletion vectors",
              flush=True)
        result["mirror"] = mirror_bench.run(spark, work, params["mirror_sizes"], params["batches"],
                                            params["batch_rows"])
        print("== SCD type 2 against type 1 (events)", flush=True)
        result["history"] = history_bench.run(spark, work, params["history_sizes"], params["batches"],
                                              params["batch_rows"], num_shards=2)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    spark.stop()
    print("== end to end, two executors (events, executor tagging)", flush=True)
    result["e2e_two_executors"] = two_executor_figures(params)
    print(f"== end to end through Spark Connect (events, {params['sizes'][0]:,} rows)", flush=True)
    result["e2e_connect"] = connect_figures(params)
    print("== the driver's memory per batch (executor tagging, two executors)", flush=True)
    result["driver_memory"] = driver_memory_figures(params["memory_sizes"])
    write(result, started)


_STEMS: dict[int, Path] = {}  # per result being written: its file, kept across its saves


def write(result: dict, started: float, plotted: bool = True) -> None:
    """bench/results/<name>-<date>.json, and its .png (`plotted`); a run of the same day's
    results goes to <name>-<date>-2.json (-3, ...), never over them."""
    result["seconds"] = round(time.perf_counter() - started, 1)
    RESULTS.mkdir(exist_ok=True)
    if id(result) not in _STEMS:
        base = f"{result['name']}-{dt.date.today().isoformat()}"
        taken = {p.stem for p in RESULTS.glob(f"{base}*.json")}
        _STEMS[id(result)] = RESULTS / next(n for n in (base, *(f"{base}-{i}" for i in range(2, 1000)))
                                            if n not in taken)
    stem = _STEMS[id(result)]
    stem.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    if plotted:
        plot(result, stem.with_suffix(".png"))
    print(f"written {stem}.json{' and .png' if plotted else ''} in {result['seconds']}s")


if __name__ == "__main__":
    main()
