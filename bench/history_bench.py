"""SCD type 2 against type 1: the events mix through both sinks, on the same starting rows."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
from deltalake import DeltaTable, write_deltalake

from bench.e2e import median_after_first, report_figures, stream
from bench.workloads import WORKLOADS, write_batches, write_start_table
from sink import SinkConfig, UpsertSink
from sink.history import END_AT, HISTORY_COLUMNS, RUN_EVENTS, START_AT

CONTENDERS = {"type-1": 1, "type-2": 2}


def history_table(template: str, uri: str) -> None:
    """The starting table as a history table: each row one current version, from its event time."""
    for batch in DeltaTable(template).to_pyarrow_dataset().to_batches(batch_size=2_000_000):
        rows = pa.Table.from_batches([batch])
        times = rows.column("event_time")
        runs = pa.array([[]] * rows.num_rows, pa.list_(pa.struct([pa.field("event_time", times.type)])))
        rows = (rows.append_column(START_AT, times).append_column(END_AT, pa.nulls(rows.num_rows, times.type))
                .append_column(RUN_EVENTS, runs))
        write_deltalake(uri, rows, partition_by=["dt"], mode="append")


def current_rows(uri: str) -> pa.Table:
    table = DeltaTable(uri).to_pyarrow_table()
    if END_AT in table.column_names:
        table = table.filter(pc.is_null(table.column(END_AT))).drop_columns(
            [c for c in HISTORY_COLUMNS if c in table.column_names])
    return table.sort_by([("id", "ascending"), ("dt", "ascending")]).combine_chunks()


def run(spark, work: Path, sizes: list[int], batches: int, batch_rows: int, num_shards: int, log=print) -> list[dict]:
    out = []
    for rows in sizes:
        case = work / f"history-{rows}"
        started = time.perf_counter()
        write_start_table(str(case / "start"), rows)
        history_table(str(case / "start"), str(case / "start-history"))
        log(f"starting tables {rows:,} rows in {time.perf_counter() - started:.1f}s")
        write_batches(case / "landing", WORKLOADS["events"], rows, batches, batch_rows)
        results = {}
        for name, scd_type in CONTENDERS.items():
            uri = case / name / "table"
            shutil.copytree(case / ("start" if scd_type == 1 else "start-history"), uri)
            cfg = SinkConfig(table_uri=str(uri), key=["id"], partition_by=["dt"], ordering="event_time",
                             delete_when="op = 'd'", checkpoint_dir=str(case / name / "cp"),
                             index_dir=str(case / name / "index"), num_shards=num_shards, metrics_port=0,
                             scd_type=scd_type)
            sink = UpsertSink(cfg)
            seconds, reports, _ = stream(spark, case / "landing", case / name / "cp", sink)
            sink.close()
            results[name] = {"batch_seconds": [round(s, 3) for s in seconds],
                             "median_after_first": round(median_after_first(seconds), 3),
                             **report_figures(reports, remote=False),
                             "versions_written": [r.versions_written for r in reports],
                             "versions_replaced": [r.versions_replaced for r in reports],
                             "table_rows_after": DeltaTable(str(uri)).to_pyarrow_dataset().count_rows()}
        equal = current_rows(str(case / "type-2" / "table")).equals(current_rows(str(case / "type-1" / "table")))
        shutil.rmtree(case)
        ratio = round(results["type-2"]["median_after_first"] / results["type-1"]["median_after_first"], 2)
        log(f"events {rows:,} per batch: type 1 {results['type-1']['median_after_first']}s, type 2 "
            f"{results['type-2']['median_after_first']}s ({ratio}x); current rows equal: {equal}")
        out.append({"workload": "events", "table_rows": rows, "batches": batches, "batch_rows": batch_rows,
                    **results, "ratio_type_2_over_type_1": ratio, "current_rows_equal": equal})
    return out
