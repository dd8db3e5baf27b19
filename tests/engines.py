"""The sink's engines as the tests run them: under delta-spark every update commits through
Spark's MERGE (commit_mode = "merge"), which on the tables the sink creates would otherwise be
delta-rs' copy-on-write, as under deltalake."""

ENGINE_OPTIONS = {"deltalake": {"engine": "deltalake"},
                  "delta-spark": {"engine": "delta-spark", "commit_mode": "merge"}}
# How a batch with updates commits under each.
UPDATES_COMMIT = {"deltalake": "rewrite", "delta-spark": "merge"}

# Delta's Spark engine sized for the tests' small tables on 2 cores, in every session the tests
# start: a snapshot's state in 2 partitions (50 by default: a DELETE took 10-20 s, 3 s with 2;
# a MERGE on two executors 20-30 s), and VACUUM's listing in 4 tasks (10,000 by default: 65 s,
# 7 s with 4).
SMALL_TABLES_CONF = {"spark.databricks.delta.snapshotPartitions": "2",
                     "spark.sql.sources.parallelPartitionDiscovery.parallelism": "4"}
