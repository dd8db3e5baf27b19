"""The tagging task that runs on executors (inside `mapInArrow`), one call per Spark partition.

Records arrive routed by shard (`repartition(N, shard)`), so a shard's records are all
in one task. For each shard in its input the task opens the shard's replica, catches
it up to the table version the driver will commit on, loads the partitions its records
need and the replica lacks (all together, concurrently), tags the records and stages
the changes under the batch id. It yields the tagged records and one stats row.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc
from deltalake import DeltaTable

from sink import columns as C
from sink import keys
from sink.errors import PartitionLoadError
from sink.index.catchup import catch_up
from sink.index.loader import read_partition
from sink.index.replica import ShardReplica, replica_path
from sink.lakehouse.log import read_commit
from sink.tagging import tag

LOAD_THREADS = 4
LOAD_ATTEMPTS = 3


@dataclass(frozen=True)
class TaskContext:
    """Everything a tagging task needs, pickled from the driver."""

    table_uri: str
    tombstone_uri: str
    table_id: str
    table_version: int
    writer_id: str
    batch_id: int
    key_cols: tuple[str, ...]
    partition_cols: tuple[str, ...]
    ordering: str
    num_shards: int
    index_dir: str | None
    incoming_wins_ties: bool
    # The task's output: the stream's own columns, then OP, WRITE, HIT, STATS.
    output_schema: pa.Schema

    @property
    def spec(self) -> str:
        """What the replica's entries mean; a replica of another spec is rebuilt."""
        return json.dumps(
            {"key": self.key_cols, "partition_by": self.partition_cols, "ordering": self.ordering}
        )


def default_index_root() -> str:
    """Spark's local dir on this executor (never bare /tmp itself)."""
    local_dirs = os.environ.get("SPARK_LOCAL_DIRS") or os.environ.get("SPARK_LOCAL_DIR")
    base = local_dirs.split(",")[0] if local_dirs else tempfile.gettempdir()
    return os.path.join(base, "upsert-sink-index")


def tag_batches(ctx: TaskContext, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """mapInArrow body: tag this task's records, shard by shard, then report stats."""
    batches = list(batches)
    records = pa.Table.from_batches(batches) if batches else None
    stats = {"shard_ids": [], "partition_loads": 0, "load_seconds": 0.0, "commits_read": 0,
             "invalidated": 0, "promoted": 0, "rebuilds": 0, "tag_seconds": 0.0}
    if records is not None and records.num_rows:
        for shard in pc.unique(records.column(C.SHARD)).to_pylist():
            rows = records.filter(pc.equal(records.column(C.SHARD), shard))
            tagged = _tag_shard(ctx, int(shard), rows, stats)
            yield from tagged.cast(ctx.output_schema).to_batches()
    yield _stats_batch(ctx.output_schema, stats)


def _tag_shard(ctx: TaskContext, shard: int, rows: pa.Table, stats: dict) -> pa.Table:
    started = time.perf_counter()
    pids = keys.partition_ids(rows, ctx.partition_cols)
    root = ctx.index_dir or default_index_root()
    path = replica_path(root, ctx.table_id, shard, ctx.num_shards)
    with ShardReplica.open(path, ctx.spec) as replica:
        report = catch_up(
            replica, ctx.table_version,
            lambda v: read_commit(ctx.table_uri, v, list(ctx.partition_cols)),
            ctx.writer_id, shard,
        )
        needed = pc.unique(pids).to_pylist()
        missing = [p for p in needed if not replica.has_partition(p)]
        stats["load_seconds"] += _load_partitions(ctx, replica, shard, missing)
        replica.touch(needed)
        result = tag(
            rows.column(C.KEY).combine_chunks(), pids, rows.column(C.ORDERING).combine_chunks(),
            rows.column(C.DELETE).combine_chunks(), rows.column(C.SEQ).combine_chunks(),
            replica.lookup, ctx.incoming_wins_ties,
        )
        replica.stage(ctx.batch_id, result.changes)
    stats["shard_ids"].append(shard)
    stats["partition_loads"] += len(missing)
    stats["commits_read"] += report.commits_read
    stats["invalidated"] += len(report.invalidated)
    stats["promoted"] += report.promoted
    stats["rebuilds"] += int(report.rebuilt is not None and report.rebuilt != "new replica")
    stats["tag_seconds"] += time.perf_counter() - started
    user_columns = [n for n in rows.column_names if not n.startswith(C.PREFIX)]
    return (
        rows.select(user_columns).append_column(C.OP, pa.array(result.op, pa.string()))
        .append_column(C.WRITE, pa.array(result.write, pa.string()))
        .append_column(C.HIT, pa.array(result.hit, pa.bool_()))
        .append_column(C.STATS, pa.nulls(rows.num_rows, pa.string()))
    )


def _load_partitions(ctx: TaskContext, replica: ShardReplica, shard: int, pids: list[str]) -> float:
    """Load every missing partition at the table version, concurrently; seconds spent."""
    if not pids:
        return 0.0
    started = time.perf_counter()
    table = DeltaTable(ctx.table_uri, version=ctx.table_version)
    tombstones = DeltaTable(ctx.tombstone_uri) if DeltaTable.is_deltatable(ctx.tombstone_uri) else None

    def load(pid: str) -> None:
        error: Exception | None = None
        for _ in range(LOAD_ATTEMPTS):
            try:
                k, entries = read_partition(
                    table, tombstones, pid, ctx.key_cols, ctx.ordering, shard, ctx.num_shards
                )
                replica.load_partition(pid, k, entries, reason="on_demand")
                return
            except Exception as e:  # retried, then reported with the partition's name
                error = e
        raise PartitionLoadError(
            f"loading partition {pid} of {ctx.table_uri} at version {ctx.table_version} "
            f"into shard {shard} failed {LOAD_ATTEMPTS} times: {error}"
        ) from error

    with ThreadPoolExecutor(max_workers=min(LOAD_THREADS, len(pids))) as pool:
        list(pool.map(load, pids))
    return time.perf_counter() - started


def _stats_batch(schema: pa.Schema, stats: dict) -> pa.RecordBatch:
    values = {C.OP: C.STATS_OP, C.STATS: json.dumps(stats)}
    arrays = [
        pa.array([values[f.name]], f.type) if f.name in values else pa.nulls(1, f.type)
        for f in schema
    ]
    return pa.RecordBatch.from_arrays(arrays, schema=schema)
