"""The executor-local RocksDB replica of the record-key index."""
