"""What a tagging task gets from the driver: the config's table, stream and index sections,
and the facts of one batch; built by `task_context`, pickled into each task."""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass

import pyarrow as pa

from sink import keys
from sink.config import SinkConfig
from sink.config.sections import IndexSection, StreamSection, TableSection
from sink.index import changelog
from sink.index.entry import expire_before
from sink.index.spec import replica_spec

INDEX_SUBDIR = "upsert-sink-index"


@dataclass(frozen=True)
class TaskContext:
    """Everything a tagging task needs, pickled from the driver."""

    table: TableSection
    stream: StreamSection
    index: IndexSection
    tombstone_uri: str
    tombstone_ttl_seconds: int | None  # stored deletes older than this count as absent
    # The batch.
    table_id: str
    table_version: int
    writer_id: str
    batch_id: int
    num_shards: int
    # The task's output: the stream's own columns, then the columns of `tagged_schema`.
    output_schema: pa.Schema
    now: float  # the driver's clock at batch start (TTLs, access times, deletes' stamps)
    driver_local_dir: str | None = None  # spark.local.dir as the driver sees it
    keep_open: bool = False  # tagging in the driver: replicas stay open between batches
    changelog_uri: str | None = None  # this writer's index changelog (None: not kept)
    snapshot_uri: str | None = None  # where replica snapshots are published (None: off)
    # The batch's input files, oldest first; None: each task orders its own (sink.arrival).
    file_order: tuple[int, ...] | None = ()
    write_files: bool = False  # Spark tasks write the batch's files: output shaped for them
    # The writes stay on the executors as the source of Spark's MERGE (delta-spark): output
    # shaped as for write_files, the partitions holding updates and deletes in the stats.
    merge_source: bool = False
    # A history table (scd_type 2): in global scope an entry locates a key in every partition
    # its events named (sink.index.history_locations).
    history: bool = False
    # The sink object this batch is of: the tables a process keeps open serve only it ("":
    # nothing kept open; sink.lakehouse.engines.open_tables).
    sink_instance: str = ""
    # The names the log's partition values go by (physical ones under column mapping), for
    # reading other writers' commits; None: the partition columns' own.
    partition_log_keys: tuple[str, ...] | None = None
    # The table takes inserts only (`delta.appendOnly`): sink.tagging.append_only.
    append_only: bool = False

    @property
    def ignore_null_updates(self) -> bool:
        """An update's null columns keep the stored value (sink.tagging.partial); a history table fills
        nulls in sequence order when it rebuilds (sink.history)."""
        return self.stream.ignore_null_updates and not self.history

    @property
    def keeps_stored_values(self) -> bool:
        """Some updates keep stored values: null columns (ignore_null_updates) or those holding
        unchanged_value (sink.tagging.partial)."""
        return (self.stream.ignore_null_updates or self.stream.unchanged_value is not None) and not self.history

    @property
    def deletes(self) -> bool:
        """The stream marks deletes (delete_when)."""
        return self.stream.delete_when is not None

    @property
    def expire_before(self) -> int | None:
        """Deletes stamped before this (seconds since the epoch) have expired; None: never."""
        return expire_before(self.tombstone_ttl_seconds, self.now)

    @property
    def shield_pid(self) -> str | None:
        """Partitioned scope with deletes: the partition keeping deletes that named no
        partition and found no row (sink.tagging.placement); every replica holds it."""
        if self.table.scope == "global" or not self.table.partition_by or not self.deletes:
            return None
        return keys.null_partition_id(self.table.partition_by)

    @property
    def spec(self) -> str:
        return replica_spec(self.table.key, self.table.partition_by, self.table.ordering, self.table.scope)

    def index_root(self) -> str:
        return index_root(self.index.index_dir, self.driver_local_dir)

    def changelog_header(self) -> changelog.Header:
        return changelog.Header(self.table_id, self.writer_id, self.batch_id, self.num_shards, self.spec)


def task_context(cfg: SinkConfig, **batch) -> TaskContext:
    """The context of one batch's tasks: `cfg`'s sections, and the batch's facts (`batch`:
    TaskContext's other fields, by name)."""
    side = cfg.side_tables
    return TaskContext(table=cfg.table, stream=cfg.stream, index=cfg.index, tombstone_uri=side.tombstone_uri,
                       tombstone_ttl_seconds=side.tombstone_ttl_seconds, history=cfg.scd_type == 2,
                       snapshot_uri=side.replica_snapshot_uri if cfg.index.replica_snapshot_every_versions else None,
                       **batch)


def spark_local_dirs(env: dict[str, str] | None = None) -> list[str]:
    """This process's Spark local dirs, found the way Spark finds them: YARN's LOCAL_DIRS in a
    YARN container, else SPARK_EXECUTOR_DIRS (standalone workers), else SPARK_LOCAL_DIRS
    (Kubernetes, and what PySpark hands its workers). Each executor has its own."""
    env = os.environ if env is None else env
    if env.get("CONTAINER_ID") and env.get("LOCAL_DIRS"):
        dirs = env["LOCAL_DIRS"].split(",")
    elif env.get("SPARK_EXECUTOR_DIRS"):
        dirs = env["SPARK_EXECUTOR_DIRS"].split(os.pathsep)
    else:
        dirs = env.get("SPARK_LOCAL_DIRS", "").split(",")
    return [d for d in dirs if d]


def index_root(index_dir: str | None, driver_local_dir: str | None) -> str:
    """Where this process finds a table's replicas: the config's index_dir, else its default."""
    return index_dir or default_index_root(driver_local_dir)


def default_index_root(driver_local_dir: str | None = None, env: dict[str, str] | None = None) -> str:
    """Under this executor's first Spark local dir, else the driver's spark.local.dir, else the
    system temp dir; never bare /tmp itself."""
    dirs = spark_local_dirs(env) or [d for d in (driver_local_dir or "").split(",") if d]
    return os.path.join(dirs[0] if dirs else tempfile.gettempdir(), INDEX_SUBDIR)
