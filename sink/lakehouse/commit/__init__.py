"""The sink's own commit paths: the batch's writes (`writes`), the copy-on-write rewrite and
merge-on-read (`rewrite`, and the modules it is split into: the stored rows, the key hits,
what the batch changes in a file, the data and change files it writes, the marks; the
snapshot's files and the actions a commit writes: `actions`), the SCD type 2 versions
(`versions`), the stored value a partial update keeps (`unchanged`), and what is held between
batches (`file_cache`, `key_locator`).

It may import the Delta log (`sink.delta_log`) and the index (the tombstone table, for the
versions); never the engines (`sink.lakehouse.engines`), the tagging task or the batch."""
