"""The sink's own commit paths: the batch's writes (`writes`), the copy-on-write rewrite and
merge-on-read (`rewrite`, and the modules it is split into: the stored rows, the key hits,
what the batch changes in a file, the data and change files it writes, the marks), the SCD
type 2 versions (`versions`), and the files held in memory between batches (`file_cache`).

It may import the Delta log (`sink.delta_log`) and the index (the tombstone table, for the
versions); never the engines (`sink.lakehouse.engines`), the tagging task or the batch."""
