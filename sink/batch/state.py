"""What the phases of one batch hand each other."""

from __future__ import annotations

from dataclasses import dataclass, field

import pyarrow as pa
from pyspark.sql import DataFrame
from pyspark.sql.types import StructType

from sink.ops.report import BatchReport
from sink.tagging.task_context import TaskContext
from sink.tagging.writing import Written


@dataclass(frozen=True)
class TaggedBatch:
    """A batch's tagging job, read back on the driver."""

    # The records, tagged; when Spark tasks wrote the files, only the quarantined ones and the
    # delete records (the writes stayed on the executors).
    records: pa.Table
    partitions: pa.Array  # the partition ids the batch's records name
    shards: list[int]  # shards with records
    written: Written | None  # what the writing tasks wrote, when they did
    # With the writes left on the executors: the partitions holding updates and deletes.
    changed_partitions: list[str]


@dataclass
class BatchState:
    """One batch on its way through the phases; each phase reads what the ones before it set."""

    batch_df: DataFrame  # the stream's batch; after the checks, with the hidden ordering copies
    batch_id: int
    report: BatchReport
    now: float  # one time per batch, whatever the attempt: it stamps the batch's deletes
    # Checks: the columns the batch adds to the table, and this writer's last batch in it.
    added: list[pa.Field] = field(default_factory=list)
    committed: int | None = None
    # The table's row checks (CHECK constraints, invariants, generated columns: label ->
    # expression) the batch's upserts are quarantined for breaking; none with check_constraints = "fail".
    constraints: dict[str, str] = field(default_factory=dict)
    # Prepare: the records routed and checked, the shape of the tagging output, the input
    # files in arrival order.
    num_shards: int = 0
    prepared: DataFrame | None = None
    out_schema: StructType | None = None
    files: tuple[int, ...] | None = ()  # None: each task orders its records' files (sink.arrival)
    # Tag: the tasks' context (None: to build, at the first attempt or after a conflict that
    # touched the batch's partitions), the tagged batch, and whether its tombstones are written.
    ctx: TaskContext | None = None
    # The table version up to which other writers' commits are recorded (sink.batch.other_writers).
    other_writers_seen: int | None = None
    attempt: int = 0
    tagged: TaggedBatch | None = None
    # The writes, cached where the executors tagged them, when a Spark MERGE reads them there.
    merge_source: DataFrame | None = None
    tombstoned: bool = False

    @property
    def replayed(self) -> bool:
        """The table holds this batch already: a replay after a crash between the Delta commit
        and Spark's checkpoint."""
        return self.committed is not None and self.batch_id == self.committed
