"""The file-writing task that runs on executors (inside `mapInArrow`), after the tagging tasks.

Tagged writes arrive routed by the partition they change (`keys.spark_write_route_expr`),
so each partition's changes to stored rows are all in one task: it rewrites the partition's
files that hold changed keys and writes new keys (sink.lakehouse.commit.rewrite; a history table's:
its keys' rebuilt histories, sink.lakehouse.commit.versions, every event of a partition in one
task). New keys are spread over INSERT_SPLIT tasks. An unpartitioned table's writes
(`WriteContext.shares`) arrive in every task instead (`keys.spark_copies_route_expr`), each
of which writes its share (sink.lakehouse.commit.shares). The task yields only what the
driver commits: one FILE_OP row per file added, removed or marked, its action as JSON, and one with
the task's counts. The rows the driver needs (tagging stats, quarantined records, delete
records for the tombstone table: every row without a write) pass through.
"""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc
from deltalake import DeltaTable
from deltalake.transaction import AddAction
from pyspark import TaskContext

from sink import columns as C
from sink.delta_log.column_mapping import ColumnMapping
from sink.delta_log.deletion_vectors import Descriptor
from sink.delta_log.file_layout import DEFAULT_LAYOUT, FileLayout
from sink.delta_log.identity import IdentityColumn, IdentityValues
from sink.lakehouse.commit import versions
from sink.lakehouse.commit.actions import ChangeFile, MarkedFile, Rewrite, StoredFile, WrittenFile, summed_changes
from sink.lakehouse.commit.rewrite import rewrite_files
from sink.lakehouse.commit.shares import Share
from sink.lakehouse.commit.writes import PARTIAL_COLUMN, REWRITE_MARKED_SHARE, WRITE_COLUMN, Writes, changing
from sink.tagging.classify import TOMBSTONE
from sink.tagging.history_writes import HistoryBatch, history_writes

FILE_OP = "_file"
# Tasks a partition's new keys are spread over, each writing them a file: the partition that
# takes most of a batch's inserts (today's, in event streams) made one writing task the
# batch's tail (measured, two executors: 90k rows in one task, 7k in the other).
INSERT_SPLIT = 2
# The write of every valid record of a history table's batch: each is an event of its key.
HISTORY_EVENT = "event"


@dataclass(frozen=True)
class WriteContext:
    """Everything a writing task needs, pickled from the driver."""

    table_uri: str
    schema: pa.Schema  # the table's columns, with those the batch adds
    key_cols: tuple[str, ...]
    ordering: tuple[str, ...]
    partition_by: tuple[str, ...]
    incoming_wins_ties: bool
    partial: bool  # ignore_null_updates
    output_schema: pa.Schema
    # The files of the version the batch was tagged against, by partition id: a Spark
    # broadcast (its `.value`), or the mapping itself.
    files: object
    table_version: int = 0  # the version the batch was tagged against
    # A history table's batch (scd_type 2): the writes are its events (HISTORY_EVENT).
    history: HistoryBatch | None = None
    merge_on_read: bool = False  # replaced rows are marked in deletion vectors (sink.lakehouse.commit.merge_on_read)
    rewrite_marked_share: float = REWRITE_MARKED_SHARE  # a file marked this much is rewritten instead
    change_data: bool = False  # the table has a change data feed: its files are written too
    column_mapping: ColumnMapping | None = None  # the table's: its files' column names
    # The identity columns whose values new rows get, drawn by each of the `tasks` writing
    # tasks from its own share (sink.delta_log.identity).
    identity: tuple[IdentityColumn, ...] = ()
    tasks: int = 1
    layout: FileLayout = DEFAULT_LAYOUT  # what the table's properties ask of new files
    # Every task has every write of the table's one partition, and writes its share of them.
    shares: bool = False

    def stored_files(self) -> Mapping[str, list[StoredFile]]:
        return getattr(self.files, "value", self.files)


def write_batches(ctx: WriteContext, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """mapInArrow body: write this task's partitions' files, pass the other rows through."""
    started = time.perf_counter()
    batches = list(batches)
    if not batches:
        return
    records = pa.Table.from_batches(batches)
    write = records.column(C.WRITE)
    passed = pc.is_null(write)
    if pc.any(passed).as_py():
        yield from records.filter(passed).to_batches()
    rows = records.filter(pc.fill_null(pc.not_equal(write, TOMBSTONE), False))
    if not rows.num_rows:
        return
    if ctx.history is not None:
        yield _write_histories(ctx, rows, started)
        return
    columns = [*C.stream_columns(rows.column_names), WRITE_COLUMN, *([PARTIAL_COLUMN] if ctx.partial else [])]
    identity = None
    if ctx.identity:
        identity = IdentityValues(ctx.identity, stride=ctx.tasks, offset=TaskContext.get().partitionId())
    writes = Writes(rows.select(columns), ctx.schema, list(ctx.key_cols), list(ctx.ordering), list(ctx.partition_by),
                    ctx.incoming_wins_ties, None, ctx.merge_on_read, ctx.change_data, ctx.column_mapping, identity,
                    ctx.layout, ctx.rewrite_marked_share)
    share = Share(TaskContext.get().partitionId(), ctx.tasks) if ctx.shares else None
    rewrite = rewrite_files(ctx.table_uri, ctx.stored_files(), writes, share=share, divide=False)
    changed = len(pc.unique(writes.partition_ids().filter(changing(writes.rows))))
    counted = rows.num_rows
    if share is not None:  # each task has them all: counted once, by their keys' shares
        counted = int(share.homes(writes.rows, list(ctx.key_cols)).sum())
        changed = changed if share.index == 0 else 0
    yield _file_rows(ctx.output_schema, rewrite, {"rows": counted, "partitions_changed": changed,
                                                  "unchanged": rewrite.unchanged,
                                                  "row_changes": rewrite.row_changes,
                                                  "seconds": time.perf_counter() - started,
                                                  "identity": rewrite.identity_highs})


def _write_histories(ctx: WriteContext, events: pa.Table, started: float) -> pa.RecordBatch:
    """Rebuild the histories of this task's partitions' keys and write their files."""
    writes, counts = history_writes(events, ctx.history, lambda: DeltaTable(ctx.table_uri, version=ctx.table_version))
    done = versions.rewrite_files(ctx.table_uri, ctx.stored_files(), writes)
    history = {"ops": counts, "versions_written": done.versions_written,
               "versions_replaced": done.versions_replaced, "changes": done.changes}
    return _file_rows(ctx.output_schema, done.rewrite, {
        "rows": events.num_rows, "partitions_changed": done.rewrite.partitions_rewritten, "unchanged": 0,
        "seconds": time.perf_counter() - started, "history": history})


@dataclass
class Written:
    """What the writing tasks did, read back on the driver."""

    rewrite: Rewrite
    rows: int  # writes, tombstones aside
    partitions_changed: int
    seconds: float  # summed over the tasks
    # Each task's seconds, of the tasks that had writes: how evenly the write was spread.
    task_seconds: tuple[float, ...] = ()
    # A history batch's counts, summed: "ops" (insert, update, delete), "versions_written",
    # "versions_replaced", "changes" (sink.lakehouse.commit.versions.HistoryRewrite).
    history: dict | None = None


def read_written(texts: list[str]) -> Written:
    """The FILE_OP rows' JSON, gathered."""
    adds, removes, marked, changes, rows, changed, unchanged, seconds, history = [], [], [], [], 0, 0, 0, 0.0, None
    task_seconds: list[float] = []
    identity_highs: list[dict[str, int]] = []
    row_changes: list[dict[str, int]] = []
    for action in map(json.loads, texts):
        if "add" in action:
            a = action["add"]
            schema = pa.ipc.read_schema(pa.py_buffer(base64.b64decode(action["schema"])))
            adds.append(WrittenFile(AddAction(a["path"], a["size"], a["partition_values"], a["modification_time"],
                                              True, a["stats"]), schema))
        elif "remove" in action:
            removes.append(_stored(action["remove"]))
        elif "cdc" in action:
            c = action["cdc"]
            changes.append(ChangeFile(c["path"], c["size"], c["partition_values"]))
        elif "mark" in action:
            m = action["mark"]
            marked.append(MarkedFile(_stored(m["stored"]), Descriptor.from_json(m["deletion_vector"]), m["stats"]))
        else:
            task = action["task"]
            rows += task["rows"]
            changed += task["partitions_changed"]
            unchanged += task["unchanged"]
            seconds += task["seconds"]
            if task["rows"]:
                task_seconds.append(task["seconds"])
            identity_highs += task.get("identity", [])
            row_changes.append(task.get("row_changes", {}))
            if "history" in task:
                history = _summed(history or {}, task["history"])
    return Written(Rewrite(adds, removes, unchanged, marked, changes, identity_highs, summed_changes(row_changes)),
                   rows, changed, seconds, tuple(task_seconds), history)


def _summed(total: dict, more: dict) -> dict:
    """Nested counts added up."""
    return {k: _summed(total.get(k, {}), v) if isinstance(v, dict) else total.get(k, 0) + v for k, v in more.items()}


def added_json(written: WrittenFile) -> dict:
    a = written.action
    return {"add": {"path": a.path, "size": a.size, "partition_values": dict(a.partition_values),
                    "modification_time": a.modification_time, "stats": a.stats},
            "schema": base64.b64encode(written.schema.serialize().to_pybytes()).decode()}


def removed_json(stored: StoredFile) -> dict:
    return {"remove": _stored_json(stored)}


def change_json(change: ChangeFile) -> dict:
    return {"cdc": {"path": change.path, "size": change.size, "partition_values": change.partition_values}}


def marked_json(marked: MarkedFile) -> dict:
    return {"mark": {"stored": _stored_json(marked.stored), "deletion_vector": marked.deletion_vector.to_json(),
                     "stats": marked.stats}}


def _stored_json(stored: StoredFile) -> dict:
    vector = stored.deletion_vector
    return {"path": stored.path, "size": stored.size, "partition_values": stored.partition_values,
            "deletion_vector": vector.to_json() if vector is not None else None,
            "modification_time": stored.modification_time, "num_records": stored.num_records, "tags": stored.tags}


def _stored(d: dict) -> StoredFile:
    vector = d["deletion_vector"]
    return StoredFile(d["path"], d["size"], d["partition_values"],
                      Descriptor.from_json(vector) if vector is not None else None, d["modification_time"],
                      d["num_records"], d["tags"])


def _file_rows(schema: pa.Schema, rewrite: Rewrite, task: dict) -> pa.RecordBatch:
    """A writing task's output rows: its files added, removed, marked and of changes, then its
    counts (`task`)."""
    actions = [*(added_json(w) for w in rewrite.adds), *(removed_json(f) for f in rewrite.removes),
               *(marked_json(m) for m in rewrite.marked), *(change_json(c) for c in rewrite.changes), {"task": task}]
    texts = [json.dumps(a) for a in actions]
    n = len(texts)
    values = {C.OP: pa.array([FILE_OP] * n, pa.string()), C.STATS: pa.array(texts, pa.string())}
    return pa.RecordBatch.from_arrays([values.get(f.name, pa.nulls(n, f.type)) for f in schema], schema=schema)
