"""The Delta log: reading a table's commits (`reading`) and the sink's own log writer (its
actions `log_commit`, the version's claim `log_store`, deletion vectors, live vectors, metadata
commits, checkpoints), what the protocol asks of a table's files (features, column mapping,
identity columns, statistics, file layout, paths), the schema a stream may bring, the sink's
contract with its table and the partition predicates.

The part where a mistake corrupts a table, below everything that touches a table: the index
reads the log through it, the commit paths (`sink.lakehouse`) write through it. It imports only
the sink's leaf modules (keys, errors, ordering, columns, library_errors, the history model):
never the index, the lakehouse, the tagging or the batch."""
