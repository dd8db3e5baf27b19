"""Where the libraries' failures become the sink's. RocksDB (through rocksdict) and Spark
raise bare exceptions whose kind only the message tells: every such reading of a message is
here, so a library that rewords one breaks one module."""

from __future__ import annotations

from sink.errors import PartitionLoadError

# Spark's words when it aborts a job rather than re-run a lost executor's tasks.
_SPARK_ABORTED_RERUN = "Spark cannot rollback"


def first_line(error: BaseException) -> str:
    """The error's first line, or its type's name when it has no message."""
    text = str(error)
    return text.splitlines()[0] if text else type(error).__name__


def is_corruption(error: BaseException) -> bool:
    """RocksDB found the replica's files damaged (truncated SST, checksum mismatch, bad MANIFEST),
    or a column family its MANIFEST lists and its OPTIONS file lacks: a process killed between
    writing the two as it created the family (a Debezium job SIGKILLed mid-load left one)."""
    text = str(error)
    return "Corruption" in text or "Column families not opened" in text


def compacted_away(error: BaseException) -> bool:
    """RocksDB's error for a table file listed in the MANIFEST and deleted since."""
    text = str(error)
    return ".sst" in text and "No such file or directory" in text


def is_lock_held(error: BaseException) -> bool:
    """RocksDB's error for a directory another process holds open read-write."""
    return "lock" in str(error).lower()


def spark_aborted_a_rerun(error: BaseException) -> str | None:
    """Spark's reason when it aborted a job rather than re-run lost tasks (None: another failure)."""
    return next((line.strip() for line in str(error).splitlines() if _SPARK_ABORTED_RERUN in line), None)


def partition_load_failure(error: BaseException, batch_id: int) -> PartitionLoadError | None:
    """A Spark job's failure whose task failed its partition loads, as the sink's error naming
    them (None: another failure). Spark carries the task's error as text only."""
    name = PartitionLoadError.__name__
    detail = next((line for line in str(error).splitlines() if name in line), None)
    return None if detail is None else PartitionLoadError(f"batch {batch_id}: {detail.strip()}")
