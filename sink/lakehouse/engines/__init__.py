"""The engines a batch commits through, behind one interface (`engine.DeltaEngine`): delta-rs
(`delta_rs`, its MERGE `merge`, in a Spark task `merge_task`, its append `append`, the tables
kept open `open_tables`) and Delta's Spark engine (`delta_spark`, its Spark confs
`spark_delta`); the MERGE's clauses both run (`merge_clauses`).

It may import the commit paths (`sink.lakehouse.commit`), the Delta log (`sink.delta_log`), the
config, the session and the stream's routing columns (`sink.routing`); nothing of the batch,
the tagging task or the ops."""
