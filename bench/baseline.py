"""The hand-written foreachBatch a careful user writes with `deltalake` (the contender)."""

from __future__ import annotations

import time
from typing import Literal

from deltalake import CommitProperties, DeltaTable, Transaction
from pyspark.sql import DataFrame, Window
from pyspark.sql import functions as F

from sink.routing import sql_string


class HandWrittenMerge:
    """Dedupe per key in Spark, skip committed batch ids, one MERGE on key + partition with
    source-statistics pruning (streamed_exec=False), clauses guarded by the ordering column."""

    def __init__(self, table_uri: str, key: str = "id", partition: str = "dt", ordering: str = "event_time",
                 app_id: str = "hand-written"):
        self.uri, self.key, self.partition, self.ordering, self.app_id = table_uri, key, partition, ordering, app_id
        self.merge_seconds: list[float] = []  # per batch: the MERGE alone (its commit), as the sink's commit phase

    def __call__(self, df: DataFrame, batch_id: int) -> None:
        table = DeltaTable(self.uri)
        done = table.transaction_version(self.app_id)
        if done is not None and batch_id <= done:
            return
        latest = Window.partitionBy(self.key, self.partition).orderBy(
            F.col(self.ordering).desc(), F.col("_seq").desc())
        source = (df.withColumn("_seq", F.monotonically_increasing_id())
                  .withColumn("_rn", F.row_number().over(latest))
                  .filter("_rn = 1").drop("_rn", "_seq").toArrow())
        k, p, o = self.key, self.partition, self.ordering
        started = time.perf_counter()
        (table.merge(source, predicate=f"t.{k} = s.{k} AND t.{p} = s.{p}", source_alias="s", target_alias="t",
                     streamed_exec=False,
                     commit_properties=CommitProperties(app_transactions=[Transaction(self.app_id, batch_id)]))
         .when_matched_delete(predicate=f"s.op = 'd' AND t.{o} <= s.{o}")
         .when_matched_update_all(predicate=f"s.op <> 'd' AND t.{o} <= s.{o}")
         .when_not_matched_insert_all(predicate="s.op <> 'd'")
         .execute())
        self.merge_seconds.append(time.perf_counter() - started)


class SparkMerge:
    """What Spark users write today, with Delta's own engine (delta-spark): Delta's documented
    foreachBatch upsert. Dedupe per key, the batch as the app transaction (the session confs
    txnAppId/txnVersion, which delta-spark's MERGE honours: a replayed batch writes nothing),
    `MERGE ON key AND partition`. `careful`: the batch's distinct partition values as literals
    in ON as well, the target-only predicate delta-spark prunes files by (the keys of the
    source prune nothing). `deletion_vectors`: on the table first (its MERGE then marks rows
    deleted instead of rewriting files). Clauses guarded by the ordering column, as
    HandWrittenMerge's. `scope = "global"`: keys unique across the table, `MERGE ON` the key
    alone, ties keep the stored row (as global_bench's GlobalHandWrittenMerge)."""

    # Sized to the bench's 2 cores, as its shuffle partitions are: delta-spark rebuilds a new
    # version's snapshot in this many tasks (50 by default: 9.9 s a batch instead of 5.2 on a
    # 50k-row table, 10k-record batches).
    SESSION_CONF = {"spark.databricks.delta.snapshotPartitions": "2"}
    TXN_APP_ID = "spark.databricks.delta.write.txnAppId"
    TXN_VERSION = "spark.databricks.delta.write.txnVersion"

    def __init__(self, table_uri: str, *, careful: bool, deletion_vectors: bool = False,
                 scope: Literal["partitioned", "global"] = "partitioned", key: str = "id", partition: str = "dt",
                 ordering: str = "event_time"):
        self.uri, self.careful, self.deletion_vectors, self.scope = table_uri, careful, deletion_vectors, scope
        self.key, self.partition, self.ordering = key, partition, ordering
        self.app_id = "spark-merge" + ("-careful" if careful else "") + ("-dv" if deletion_vectors else "") + (
            "-global" if scope == "global" else "")
        self.merge_seconds: list[float] = []  # per batch: the MERGE alone (its commit), as the sink's commit phase

    def __call__(self, df: DataFrame, batch_id: int) -> None:
        from delta.tables import DeltaTable as SparkDeltaTable

        spark = df.sparkSession
        if self.deletion_vectors:
            spark.sql(f"ALTER TABLE delta.`{self.uri}` SET TBLPROPERTIES ('delta.enableDeletionVectors' = 'true')")
            self.deletion_vectors = False  # done: the table keeps it
        k, p, o = self.key, self.partition, self.ordering
        partitioned = self.scope == "partitioned"
        if partitioned:  # the later record wins a tie, and the incoming one a tie with the stored row
            latest = Window.partitionBy(k, p).orderBy(F.col(o).desc(), F.col("_seq").desc())
            on, newer = f"t.{k} = s.{k} AND t.{p} = s.{p}", f"t.{o} <= s.{o}"
        else:  # ties keep what came first: the earlier record, the stored row
            latest = Window.partitionBy(k).orderBy(F.col(o).desc(), F.col("_seq").asc())
            on, newer = f"t.{k} = s.{k}", f"t.{o} < s.{o}"
        source = (df.withColumn("_seq", F.monotonically_increasing_id())
                  .withColumn("_rn", F.row_number().over(latest)).filter("_rn = 1").drop("_rn", "_seq"))
        if self.careful:
            values = sorted(r[0] for r in df.select(p).distinct().collect() if r[0] is not None)
            on += f" AND t.{p} IN ({', '.join(sql_string(v) for v in values)})" if values else " AND false"
        started = time.perf_counter()
        spark.conf.set(self.TXN_APP_ID, self.app_id)
        spark.conf.set(self.TXN_VERSION, str(batch_id))
        try:
            target = SparkDeltaTable.forPath(spark, self.uri)
            merge = (target.alias("t").merge(source.alias("s"), on)
                     .whenMatchedDelete(condition=f"s.op = 'd' AND {newer}"))
            if set(target.toDF().columns) <= set(df.columns):
                merge = (merge.whenMatchedUpdateAll(condition=f"s.op <> 'd' AND {newer}")
                         .whenNotMatchedInsertAll(condition="s.op <> 'd'"))
            else:  # an identity column: `*` would name it, so the source's columns by name
                values = {c: f"s.`{c}`" for c in df.columns}
                merge = (merge.whenMatchedUpdate(condition=f"s.op <> 'd' AND {newer}", set=values)
                         .whenNotMatchedInsert(condition="s.op <> 'd'", values=values))
            merge.execute()
        finally:  # session-wide: another query's write must not carry this batch's id
            spark.conf.unset(self.TXN_APP_ID)
            spark.conf.unset(self.TXN_VERSION)
        self.merge_seconds.append(time.perf_counter() - started)
