"""The sink's engines as the tests run them: under delta-spark every update commits through
Spark's MERGE (commit_mode = "merge"), which on the tables the sink creates would otherwise be
delta-rs' copy-on-write, as under deltalake."""

ENGINE_OPTIONS = {"deltalake": {"engine": "deltalake"},
                  "delta-spark": {"engine": "delta-spark", "commit_mode": "merge"}}
# How a batch with updates commits under each.
UPDATES_COMMIT = {"deltalake": "rewrite", "delta-spark": "merge"}
