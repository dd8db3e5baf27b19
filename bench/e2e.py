"""End to end, side by side: the sink against the hand-written MERGE on the same input."""

from __future__ import annotations

import pickle
import shutil
import statistics
import tempfile
import time
from functools import partial
from pathlib import Path

import pyarrow as pa
from deltalake import DeltaTable
from pyspark.sql import functions as F

from bench.baseline import HandWrittenMerge, SparkMerge
from bench.workloads import SPARK_SCHEMA, WORKLOADS, write_batches, write_start_table
from sink import SinkConfig, UpsertSink
from sink.delta_log.schema import plain_layouts
from sink.index.replica import ShardReplica
from sink.lakehouse.commit import file_cache

# The sink on its default config (tag_on = "auto": the driver, under the bench's local master;
# commit_mode = "auto": updates rewrite files), the sink forced onto executor tagging, the sink
# committing updates through its MERGE fallback, and the hand-written MERGEs: delta-rs' (the
# "baseline"), and delta-spark's as Delta documents it and as a careful user writes it.
CONTENDERS = ("sink", "sink-executors", "sink-merge", "baseline", "spark-merge", "spark-merge-careful")
BASELINES = {"baseline": HandWrittenMerge, "spark-merge": partial(SparkMerge, careful=False),
             "spark-merge-careful": partial(SparkMerge, careful=True),
             "spark-merge-careful-dv": partial(SparkMerge, careful=True, deletion_vectors=True)}
# On a table with deletion vectors (the events case's variant): the sink under engine =
# "delta-spark", whose updates then commit through Spark's MERGE (which writes them).
TAG_ON = {"sink": "auto", "sink-executors": "executors", "sink-merge": "auto", "sink-spark-dv": "auto",
          "sink-spark-dv-executors": "executors", "sink-unverified": "auto", "sink-executors-unverified": "executors"}
COMMIT_MODE = {"sink": "auto", "sink-executors": "auto", "sink-merge": "merge", "sink-spark-dv": "auto",
               "sink-spark-dv-executors": "auto", "sink-unverified": "auto", "sink-executors-unverified": "auto"}
DELETION_VECTORS = ("sink-spark-dv", "sink-spark-dv-executors")
# The tables Spark users create, every contender's copy altered alike, events and MERGE the
# same. "all-features" is built by Spark SQL, since column mapping, identity and generated
# columns cannot be added to a table: deletion vectors, the change data feed, column mapping by
# name, a CHECK constraint, a generated column the stream carries and an identity column.
VARIANTS = {
    "change-data-feed": ("ALTER TABLE delta.`{uri}` SET TBLPROPERTIES ('delta.enableChangeDataFeed' = 'true')",),
    "check-constraint": ("ALTER TABLE delta.`{uri}` ADD CONSTRAINT amount_positive CHECK (amount > 0)",),
    "all-features": (),
}
FEATURES_DDL = (
    "CREATE TABLE delta.`{uri}` (id STRING, dt STRING, event_time TIMESTAMP, op STRING, amount DOUBLE, "
    "payload STRING, op_code STRING GENERATED ALWAYS AS (upper(op)), row_id BIGINT GENERATED ALWAYS AS IDENTITY) "
    "USING delta PARTITIONED BY (dt) TBLPROPERTIES ('delta.enableDeletionVectors' = 'true', "
    "'delta.enableChangeDataFeed' = 'true', 'delta.columnMapping.mode' = 'name')",
    "ALTER TABLE delta.`{uri}` ADD CONSTRAINT amount_positive CHECK (amount > 0)",
    "INSERT INTO delta.`{uri}` (id, dt, event_time, op, amount, payload) "
    "SELECT id, dt, event_time, op, amount, payload FROM delta.`{plain}`",
)
GENERATED = {"all-features": {"op_code": "upper(op)"}}
VARIANT_CONTENDERS = ("spark-merge-careful", "sink", "sink-executors")
# The sampled verification's cost: the sink with it off (verify_fraction = 0) beside the default.
UNVERIFIED = ("sink-unverified", "sink-executors-unverified")
VERIFICATION = ("sink", "sink-unverified", "sink-executors", "sink-executors-unverified", "baseline")


class Timed:
    """foreachBatch: `foreach`, timed; each batch's seconds and the sink's report (None for
    the hand-written MERGE) appended to a file, since under Spark Connect the batches run in
    the server's Python worker, not in this process."""

    def __init__(self, foreach, out: Path):
        self.foreach = foreach
        self.out = out

    def __call__(self, df, batch_id: int) -> None:
        started = time.perf_counter()
        self.foreach(df, batch_id)
        seconds = time.perf_counter() - started
        reports = getattr(self.foreach, "reports", None)
        merges = getattr(self.foreach, "merge_seconds", None)
        with self.out.open("ab") as f:
            pickle.dump((seconds, reports[-1] if reports else None, merges[-1] if merges else None), f)


def stream(spark, landing: Path, checkpoint: Path, foreach, generated: dict[str, str] | None = None
           ) -> tuple[list[float], list, list[float]]:
    """Run one availableNow query over `landing`, one file per batch: seconds per batch, the
    sink's reports, and the hand-written MERGE's own seconds per batch. `generated`: columns
    the stream computes (a table's generated columns, as a producer would)."""
    out = checkpoint.parent / "batches.pickle"
    source = spark.readStream.format("parquet").schema(SPARK_SCHEMA).option("maxFilesPerTrigger", 1).load(str(landing))
    for name, expression in (generated or {}).items():
        source = source.withColumn(name, F.expr(expression))
    query = (source.writeStream.foreachBatch(Timed(foreach, out))
             .option("checkpointLocation", str(checkpoint)).trigger(availableNow=True).start())
    query.awaitTermination()
    batches = []
    with out.open("rb") as f:
        while f.peek(1):
            batches.append(pickle.load(f))
    return ([s for s, _, _ in batches], [r for _, r, _ in batches if r is not None],
            [m for _, _, m in batches if m is not None])


def table_contents(uri: str) -> pa.Table:
    """The table's rows, sorted; a table with deletion vectors, which `to_pyarrow_table` refuses,
    through delta-rs' scan (Spark's `toArrow` of a 10M-row table lost its result in the
    driver's default 1g)."""
    table = DeltaTable(uri)
    if "deletionVectors" in (table.protocol().reader_features or []):
        rows = plain_layouts(pa.table(table.scan())).cast(pa.schema(table.schema().to_arrow()))
    else:
        rows = table.to_pyarrow_table()
    return rows.sort_by([("id", "ascending"), ("dt", "ascending")]).combine_chunks()


def table_checksum(spark, uri: str) -> tuple[int, int, int]:
    """(rows, the sum of every row's hash, distinct identity values) as Spark reads the table:
    equal tables give equal sums. The identity column is left out of the hash, since which row
    gets which value depends on the writer; its values must be distinct all the same."""
    table = spark.read.format("delta").load(uri)
    columns = [c for c in table.columns if c != "row_id"]
    row = table.select(F.count("*"), F.sum(F.xxhash64(*columns).cast("decimal(38,0)")),
                       F.countDistinct("row_id") if "row_id" in table.columns else F.count("*")).first()
    return int(row[0]), int(row[1] or 0), int(row[2])


def variant_template(spark, plain: Path, variant: str) -> Path:
    """The starting table for `variant`: `plain` itself, or (all-features) Spark SQL's copy."""
    if variant != "all-features":
        return plain
    template = plain.with_name(f"{plain.name}-{variant}")
    for statement in FEATURES_DDL:
        spark.sql(statement.format(uri=template, plain=plain))
    return template


def index_memory(index_dir: Path) -> tuple[int, int]:
    """(RocksDB's in-memory bloom filters and index blocks, the key filters) of every replica
    under `index_dir`, in bytes."""
    rocksdb = key_filters = 0
    for path in index_dir.glob("*/shard-*"):
        with ShardReplica.open_read_only(path) as replica:
            rocksdb += replica.keyspaces.reader_memory_bytes()
            key_filters += replica.keyspaces.key_filter_bytes()
    return rocksdb, key_filters


def median_after_first(values: list[float]) -> float:
    return statistics.median(values[1:] if len(values) > 1 else values)


def phase_medians(reports) -> dict[str, float]:
    """Each phase's median over the batches after the first (phases that never ran left out)."""
    return {phase: round(median_after_first([r.phases[phase] for r in reports]), 3)
            for phase in reports[0].phases if any(r.phases[phase] for r in reports)}


def report_figures(reports, remote: bool) -> dict:
    """Per-batch figures every sink contender records (`remote`: the batches ran in another
    process, whose file cache this one cannot see)."""
    return {
        "tag_seconds": [round(r.tag_seconds, 3) for r in reports],
        "commit_seconds": [round(r.commit_seconds, 3) for r in reports],
        "phases": phase_medians(reports),
        "tag_steps": {step: round(median_after_first([r.tag_steps[step] for r in reports]), 3)
                      for step in reports[0].tag_steps},
        "merge_partitions": [r.merge_partitions for r in reports],
        "partition_loads": [r.partition_loads for r in reports],
        "partition_peeks": [r.partition_peeks for r in reports],
        # Rows of the files the driver wrote, held for the next rewrite (at most file_cache_bytes).
        **({} if remote else {"file_cache_bytes": file_cache.WRITTEN.nbytes}),
    }


def breakdown(phases: dict[str, float]) -> str:
    return " ".join(f"{phase} {seconds}" for phase, seconds in phases.items())


def run_case(spark, work: Path, template: Path, workload: str, table_rows: int, batches: int,
             batch_rows: int, num_shards: int, contenders: tuple[str, ...] = CONTENDERS,
             executor_index_dirs: bool = False, remote: bool = False, variant: str | None = None) -> dict:
    """`executor_index_dirs`: leave index_dir unset, so each executor keeps its own replicas.
    `remote`: a Spark Connect session, whose server's Python worker runs the batches.
    `variant`: one of VARIANTS, every contender's table altered alike and compared by Spark."""
    case = work / (f"{workload}-{table_rows}" + (f"-{variant}" if variant else ""))
    landing = case / "landing"
    write_batches(landing, WORKLOADS[workload], table_rows, batches, batch_rows)
    results = {}
    for name in contenders:
        uri = case / name / "table"
        shutil.copytree(template, uri)
        for statement in VARIANTS.get(variant, ()):
            spark.sql(statement.format(uri=uri))
        if name not in BASELINES:
            if name in DELETION_VECTORS:
                spark.sql(f"ALTER TABLE delta.`{uri}` SET TBLPROPERTIES ('delta.enableDeletionVectors' = 'true')")
            cfg = SinkConfig(table_uri=str(uri), key=["id"], partition_by=["dt"], ordering="event_time",
                             delete_when="op = 'd'", checkpoint_dir=str(case / name / "cp"),
                             index_dir=None if executor_index_dirs else str(case / name / "index"),
                             num_shards=num_shards, metrics_port=0, tag_on=TAG_ON[name],
                             commit_mode=COMMIT_MODE[name],
                             engine="delta-spark" if name in DELETION_VECTORS else "auto" if variant else "deltalake",
                             **({"verify_fraction": 0.0} if name in UNVERIFIED else {}))
            file_cache.WRITTEN.clear()  # the previous case's files
            sink = UpsertSink(cfg)
            seconds, reports, _ = stream(spark, landing, case / name / "cp", sink, GENERATED.get(variant))
            sink.close()  # saves the key filters
            extra = {
                **report_figures(reports, remote),
                "shard_seconds": [round(r.shard_seconds, 3) for r in reports],
                "modes": [r.mode for r in reports],
                "shard_moves": [r.shard_moves for r in reports],
                "changelog_applied": [r.changelog_applied for r in reports],
                "replicas_rebuilt": [r.replicas_rebuilt for r in reports],
                "verified_keys": [r.verified_keys for r in reports],
                # The batch but its commit phase: what the index costs above the hand-written dedupe.
                "above_commit": round(median_after_first([s - r.commit_seconds for s, r in zip(seconds, reports)]), 3),
                # Batches after the first that created no replica (on several executors, each
                # executor's first run of a shard bootstraps it once).
                "median_warm": round(median_after_first(
                    [seconds[0]] + [s for s, r in zip(seconds[1:], reports[1:]) if not r.replicas_rebuilt]), 3),
            }
            if not executor_index_dirs and not remote:  # under Connect the server's worker may hold them
                extra["key_filter_bytes"] = index_memory(case / name / "index")[1]
        else:
            merge = BASELINES[name](str(uri))
            seconds, _, merge_seconds = stream(spark, landing, case / name / "cp", merge, GENERATED.get(variant))
            above = [s - m for s, m in zip(seconds, merge_seconds)]
            extra = {"above_commit": round(median_after_first(above), 3)}
        results[name] = {"batch_seconds": [round(s, 3) for s in seconds],
                         "median_after_first": round(median_after_first(seconds), 3), **extra}
    if variant:
        sums = {name: table_checksum(spark, str(case / name / "table")) for name in contenders}
        equal = len(set(sums.values())) == 1 and all(rows == ids for rows, _, ids in sums.values())
        table_rows_now = next(iter(sums.values()))[0]
    else:
        expected = table_contents(str(case / "baseline" / "table"))
        equal = all(table_contents(str(case / name / "table")).equals(expected) for name in contenders)
        table_rows_now = expected.num_rows
    for figures in results.values():
        if "key_filter_bytes" in figures:  # per key of the table (the index also holds tombstones)
            figures["key_filter_bytes_per_key"] = round(figures.pop("key_filter_bytes") / table_rows_now, 3)
    # Executor tagging's Python workers keep their replicas open and checkpoint them once idle
    # (sink.index.worker_replicas): a checkpoint may write into a directory being removed.
    shutil.rmtree(case, ignore_errors=True)
    ratios = {f"ratio_{base.replace('-', '_')}_over_{name.replace('-', '_')}":
              round(results[base]["median_after_first"] / results[name]["median_after_first"], 2)
              for base in contenders if base in BASELINES for name in contenders if name not in BASELINES}
    return {"workload": workload, "table_rows": table_rows, "batches": batches, "batch_rows": batch_rows,
            **({"variant": variant} if variant else {}), **results, **ratios, "tables_equal": equal}


def run_tiny(spark, work: Path, table_rows: int, batch_sizes: list[int], batches: int, num_shards: int = 2,
             log=print) -> list[dict]:
    """The events mix in batches of a few records: what a batch costs when there is nothing to do."""
    template = work / f"start-tiny-{table_rows}"
    write_start_table(str(template), table_rows)
    out = []
    for batch_rows in batch_sizes:
        # delta-spark's MERGE costs seconds even for one record: the tiny cases leave it out.
        case = run_case(spark, work / f"tiny-{batch_rows}", template, "events", table_rows, batches, batch_rows,
                        num_shards, ("sink", "sink-executors", "sink-merge", "baseline"))
        log(f"tiny batches of {batch_rows}: sink {case['sink']['median_after_first']}s, baseline "
            f"{case['baseline']['median_after_first']}s; tables equal: {case['tables_equal']}")
        out.append(case)
    shutil.rmtree(template)
    return out


def warm_up(spark, work: Path, num_shards: int, contenders: tuple[str, ...] = CONTENDERS,
            executor_index_dirs: bool = False, batch_rows: int = 100_000, remote: bool = False) -> None:
    """One case at the measured batch size, not recorded: the JVM compiles the scan, the Arrow
    collect and the window dedupe during its first batches, and the contender that runs first
    in the first measured case (the sink) would pay for it alone. After a case of 20k-record
    batches, three identical *events* cases at 1M rows in a row still gave the sink collects
    of 0.201, 0.176 and 0.159 s (the hand-written version's batch less its MERGE: 0.337,
    0.312 and 0.289 s)."""
    template = work / "warm-up-start"
    write_start_table(str(template), 10 * batch_rows)
    run_case(spark, work, template, "events", 10 * batch_rows, 4, batch_rows, num_shards, contenders,
             executor_index_dirs, remote)
    shutil.rmtree(template)


def run_child(spark, sizes: list[int], batches: int, batch_rows: int, shards: int, contenders: tuple[str, ...],
              **options) -> list[dict]:
    """A child bench's *events* cases (a Spark application of its own: bench.two_executors,
    bench.connect_bench), after a warm-up; stops the session. `options`: run_case's."""
    work = Path(tempfile.mkdtemp(prefix="sink-child-bench-"))
    try:
        warm_up(spark, work, shards, contenders, batch_rows=batch_rows, **options)
        return run(spark, work, sizes, ["events"], batches, batch_rows, shards, contenders=contenders, **options)
    finally:
        spark.stop()
        shutil.rmtree(work, ignore_errors=True)


def run(spark, work: Path, sizes: list[int], workloads: list[str], batches: int, batch_rows: int,
        num_shards: int, log=print, contenders: tuple[str, ...] = CONTENDERS,
        executor_index_dirs: bool = False, remote: bool = False, variants: tuple[str | None, ...] = (None,)
        ) -> list[dict]:
    """Each workload at each size, on each of `variants` of the starting table (None: as written)."""
    out = []
    for rows in sizes:
        plain = work / f"start-{rows}"
        started = time.perf_counter()
        write_start_table(str(plain), rows)
        log(f"starting table {rows:,} rows in {time.perf_counter() - started:.1f}s")
        for variant in variants:
            template = variant_template(spark, plain, variant) if variant else plain
            for workload in workloads:
                case = run_case(spark, work, template, workload, rows, batches, batch_rows, num_shards, contenders,
                                executor_index_dirs, remote, variant)
                figures = ", ".join(f"{name} {case[name]['median_after_first']}s" for name in contenders)
                log(f"{workload} {rows:,}{f' ({variant})' if variant else ''} per batch: {figures}; "
                    f"tables equal: {case['tables_equal']}")
                for name in (n for n in contenders if n not in BASELINES):
                    log(f"  {name} phases (s): {breakdown(case[name]['phases'])}")
                out.append(case)
            if template != plain:
                shutil.rmtree(template)
        shutil.rmtree(plain)
    return out
