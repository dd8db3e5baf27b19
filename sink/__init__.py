"""Spark Structured Streaming upsert sink for Delta Lake, with a RocksDB key index."""

from sink.config import SinkConfig
from sink.errors import (
    CommitConflictError,
    ConfigError,
    ConstraintViolationError,
    ContractMismatchError,
    DeletionVectorError,
    OtherWriterCommitError,
    PartitionLoadError,
    ReplicaLockedError,
    SchemaError,
    SinkError,
    UnrecordedCommitError,
    UnsupportedTableError,
    WriterIdReusedError,
)
from sink.foreach_batch import UpsertSink
from sink.ops.report import BatchReport

__all__ = [
    "BatchReport",
    "CommitConflictError",
    "ConfigError",
    "ConstraintViolationError",
    "ContractMismatchError",
    "DeletionVectorError",
    "OtherWriterCommitError",
    "PartitionLoadError",
    "ReplicaLockedError",
    "SchemaError",
    "SinkConfig",
    "SinkError",
    "UnrecordedCommitError",
    "UnsupportedTableError",
    "UpsertSink",
    "WriterIdReusedError",
]
