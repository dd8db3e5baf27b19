"""The sink's commits to its Delta table, in two layers:

- `commit/`: the sink's own commit paths and the rows they write (`writes`): copy-on-write,
  merge-on-read, change data files, SCD type 2 versions.
- `engines/`: the engines a batch commits through (delta-rs, delta-spark) behind one
  interface (`engines.engine`), their MERGE and append; over `commit/`.

Both write through the sink's Delta log (`sink.delta_log`), which sits below the index: the
index reads the log, and the commit paths read the index's tombstones. Nothing here imports
the tagging task, the batch's phases or the ops."""
