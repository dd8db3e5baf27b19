"""One exception type per failure, all under SinkError."""


class SinkError(Exception):
    """Base class of every error the sink raises on purpose."""


class ConfigError(SinkError, ValueError):
    """A config value is missing or not one of the accepted values."""


class SchemaError(SinkError, ValueError):
    """The stream's schema does not fit the config (missing column, unsupported type)."""


class ContractMismatchError(SinkError):
    """The table records another key, partitioning, ordering, scope or key encoding than the config."""


class WriterIdReusedError(SinkError):
    """The table already holds later batches of this writer id: the checkpoint is new or reset."""


class CommitConflictError(SinkError):
    """Another writer kept winning the commit race after the bounded retries."""


class PartitionLoadError(SinkError):
    """A partition of the index could not be loaded from the table."""


class ReplicaLockedError(SinkError):
    """Another process holds this shard replica's RocksDB lock."""


class ReplicaLostError(SinkError):
    """A shard replica's directory was removed while a task used it (an operator deleted the
    index directory): the task rebuilds the replica and tags again."""


class CommitCheckError(SinkError):
    """A copy-on-write commit failed a check before committing (a file missing, a removed file
    not in the version the batch read, incomplete partition values, another schema): nothing
    was committed."""


class UnrecordedCommitError(SinkError):
    """Spark committed a batch without the sink's app transaction (the session's Delta commit
    confs were changed while it committed): the batch would not count as done, so the query
    stops rather than carry on from a table that does not record it."""


class UnsupportedTableError(ConfigError):
    """The table uses a feature the batch's commit path cannot honour and has no fallback for
    (a history table with deletion vectors, say): nothing was written."""


class DeltaJarsError(SinkError):
    """Spark could not start with Delta's Spark engine: its jars did not resolve."""


class OtherWriterCommitError(SinkError):
    """Another writer's commit cannot be followed exactly (a RESTORE to a version the sink
    cannot place, log entries gone before the sink read them): refused before writing, naming
    the commit."""


class ConstraintViolationError(SinkError):
    """A record breaks one of the table's CHECK constraints, invariants or generated columns
    under check_constraints = "fail": the batch is refused before anything is written, naming it."""


class DeletionVectorError(SinkError):
    """A deletion vector in the table does not read as the protocol's format says (its size,
    CRC-32, magic number or cardinality disagree with its descriptor): nothing was written."""


class AppendOnlyError(SinkError):
    """A record would update or delete a stored row of a table with `delta.appendOnly = true`
    (append_only_changes = "fail"): nothing was written."""


class UnchangedValueError(SinkError):
    """A write holds `unchanged_value` (a value its source did not send) for a key the table
    does not store: there is no stored value to keep, and the placeholder is never written."""
