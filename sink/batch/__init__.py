"""One micro-batch as a pipeline of phases over one `BatchState` (sink.foreach_batch runs
them): checks, prepare, tag, side tables, commit, metrics."""
