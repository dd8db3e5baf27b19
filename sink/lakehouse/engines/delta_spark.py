"""The `delta-spark` engine: Delta's own Spark engine commits what delta-rs cannot write or
should not rewrite; delta-rs reads the table (through deletion vectors and column mapping)
and commits the rest.

Paths, per batch, by what the table allows (`update_mode`):
- a table the copy-on-write rewrite or merge-on-read may commit (no feature below; deletion
  vectors and a change data feed are written by the sink's log commit): delta-rs, as under
  `engine = "deltalake"` (measured faster: sink.lakehouse.engines.delta_rs);
- updates on a table with column mapping (or CHECK constraints, invariants, generated
  columns the batch does not check: `checks_rows`), or under `commit_mode = "merge"`: Spark's
  `MERGE INTO`,
  pruned by the partitions the index located as literals in `ON`;
- any write to a table delta-rs cannot write at all (row tracking, domain metadata; identity
  columns where the sink's commits do not generate them, `written_identity`): Spark's append
  or MERGE.

Spark's commits carry the app transaction through the session confs
`spark.databricks.delta.write.txnAppId`/`txnVersion` (Delta reads no writer option for
MERGE), set and unset around each write since they are session-wide, by one sink of the
session at a time (sink.session.confs); the sink's commit metadata goes into the commit's
`userMetadata` (sink.delta_log.reading reads it back). A commit that landed without the app
transaction is refused (UnrecordedCommitError), never taken as the batch's."""

from __future__ import annotations

import json
import uuid
from collections.abc import Collection, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Literal

import pyarrow as pa
import pyarrow.compute as pc
from deltalake.exceptions import CommitFailedError
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.pandas.types import from_arrow_type

from sink.delta_log.contract import Contract
from sink.delta_log.features import (
    IDENTITY_COLUMNS,
    identity_columns,
    mentions,
    merge_only_reason,
    row_checks,
    unwritable_reason,
)
from sink.delta_log.identity import IdentityColumn
from sink.delta_log.predicates import quote_ident
from sink.delta_log.reading import commit_record
from sink.errors import ConfigError, UnrecordedCommitError
from sink.lakehouse.commit import versions
from sink.lakehouse.commit.writes import WRITE_COLUMN, Writes, changing, distinct_partitions
from sink.lakehouse.engines.delta_rs import CommitOutcome, DeltaTarget
from sink.lakehouse.engines.merge_clauses import (
    MergeClauses,
    UpsertSpec,
    history_clauses,
    updates_in,
    upsert_clauses,
    upsert_source,
)
from sink.ordering import columns_of
from sink.routing import sql_string
from sink.session.confs import session_confs

TXN_APP_ID = "spark.databricks.delta.write.txnAppId"
TXN_VERSION = "spark.databricks.delta.write.txnVersion"
USER_METADATA = "spark.databricks.delta.commitInfo.userMetadata"


# What Spark commits: "merges", updates of tables the rewrite cannot honour and every write
# delta-rs cannot make (engine = "delta-spark"); "unwritable", only the latter, and only in a
# session with Delta's extension (engine = "auto": delta-rs' MERGE is the faster one).
SparkWrites = Literal["merges", "unwritable"]


class DeltaSparkTarget(DeltaTarget):
    """The target table under `engine = "delta-spark"` or `"auto"`: writes through the stream's
    Spark session (`attach`) where delta-rs cannot, or (`spark_writes = "merges"`) should not."""

    def __init__(self, uri: str, partition_by: Sequence[str], commit_mode: str = "auto", *,
                 spark_writes: SparkWrites = "merges", generates_identity: bool = False, **options):
        """`generates_identity`: the sink's own commits may write a table with identity columns
        (its batches' rows are the records: not a history table's); `options`: DeltaTarget's."""
        super().__init__(uri, partition_by, commit_mode, **options)
        self._spark_writes = spark_writes
        self._generate_identity = generates_identity
        self._spark: SparkSession | None = None  # None: delta-rs writes all (auto, no Delta in the session)

    def attach(self, spark: SparkSession) -> None:
        """The session of the stream's batches, which Spark's commits run in. Without Delta's
        SQL extension: a ConfigError naming it under engine = "delta-spark"; delta-rs alone
        under "auto"."""
        # Imported here: `python -m sink.lakehouse.engines.spark_delta` (make's) runs it as a script.
        from sink.lakehouse.engines.spark_delta import EXTENSION

        extensions = spark.conf.get("spark.sql.extensions", None) or ""
        if EXTENSION in extensions.split(","):
            self._spark = spark
        elif self._spark_writes == "merges":
            raise ConfigError(f"engine = 'delta-spark' needs Delta's extension in the Spark session: set "
                              f"spark.sql.extensions = {EXTENSION} and spark.sql.catalog.spark_catalog (the job's "
                              "[job] table does it; `python -m sink.lakehouse.engines.spark_delta` names the package), "
                              "or set engine = 'deltalake'")
        else:
            self._spark = None

    def check_writable(self) -> None:
        """Delta's Spark engine writes every feature the sink knows of."""
        if self._spark is None:
            super().check_writable()

    def filled_columns(self) -> list[str]:
        return identity_columns(self._read()) if self._spark is not None else []

    def _spark_writes_all(self) -> bool:
        """Spark makes every commit of this table: delta-rs cannot write it, nor the sink's own
        commits (which generate identity values, `written_identity`)."""
        return self._spark_alters() and not self.written_identity()

    def _spark_alters(self) -> bool:
        """Spark changes this table's metadata (columns, properties): delta-rs cannot write it."""
        return self._spark is not None and unwritable_reason(self.table) is not None

    def _generates_identity(self) -> bool:
        """Not where a row check reads an identity column: the records lack its values, which
        only the commit gives them, so Spark's MERGE checks those rows."""
        if not (self._generate_identity and self._spark is not None):
            return False
        filled = identity_columns(self.table)
        return not any(mentions(expr, c) for expr in row_checks(self.table).values() for c in filled)

    def written_identity(self) -> tuple[IdentityColumn, ...]:
        """A table whose only feature delta-rs cannot write is identity columns: the sink's
        commits generate their values wherever they commit the updates themselves."""
        if not self._generates_identity() or unwritable_reason(self.table, honoured=(IDENTITY_COLUMNS,)):
            return ()
        columns = IdentityColumn.of(self.table)
        return columns if columns and self.update_mode() != "merge" else ()

    def _spark_merges(self) -> bool:
        """This table's updates commit through Spark's MERGE."""
        return self._spark_writes_all() or (self._spark_writes == "merges" and self.update_mode() == "merge")

    def record_contract(self, contract: Contract) -> None:
        if not self._spark_alters():
            super().record_contract(contract)
            return
        properties = ", ".join(f"{sql_string(k)} = {sql_string(v)}" for k, v in contract.properties().items())
        self._session().sql(f"ALTER TABLE delta.{quote_ident(self.uri)} SET TBLPROPERTIES ({properties})")
        self.refresh()

    def _merge_only_reason(self, *, honoured: Collection[str] = ()) -> str | None:
        return ((self._spark is not None and unwritable_reason(self.table, honoured=honoured))
                or merge_only_reason(self.table, honoured=honoured))

    def merges_on_executors(self) -> bool:
        return self._spark_merges() or super().merges_on_executors()

    def commit(self, rows: pa.Table, key_cols: Sequence[str], ordering: str | Sequence[str], app_id: str,
               batch_id: int, custom_metadata: Mapping[str, str], incoming_wins_ties: bool,
               added_columns: Sequence[pa.Field] = ()) -> CommitOutcome:
        rows = rows.filter(pc.not_equal(rows.column(WRITE_COLUMN), "tombstone"))
        updating = changing(rows)
        updates = pc.any(updating).as_py()
        if not (self._spark_writes_all() or (updates and self._spark_merges())):
            return super().commit(rows, key_cols, ordering, app_id, batch_id, custom_metadata, incoming_wins_ties,
                                  added_columns)
        added, schema = self._schema_adding(added_columns)
        writes = Writes(rows, schema, list(key_cols), columns_of(ordering), self.partition_by, incoming_wins_ties,
                        None)
        partitions = distinct_partitions(rows.filter(updating), self.partition_by) if updates else []
        source = self._spark_frame(upsert_source(writes) if updates else writes.table_rows())
        spec = UpsertSpec.of(writes, self._written_columns(writes.schema))
        return self._commit_frame(source, partitions, updates_in(rows), spec, added, app_id, batch_id,
                                  custom_metadata)

    def commit_source(self, source: DataFrame, partitions: Sequence[Mapping[str, str]], updates: int, *,
                      key_cols: Sequence[str], ordering: Sequence[str], partial: bool, incoming_wins_ties: bool,
                      app_id: str, batch_id: int, custom_metadata: Mapping[str, str],
                      added_columns: Sequence[pa.Field] = (), unchanged: bool = False) -> CommitOutcome:
        """The batch's writes as the executors hold them: `source` has the table's columns
        (all but identity columns), WRITE_COLUMN and, when `partial`, PARTIAL_COLUMN;
        `partitions`: those holding updated or deleted keys (none: an append); `updates`: how
        many updates it has. No row of it comes to this process."""
        if not self._spark_merges():  # delta-rs' MERGE, from one Spark task
            return super().commit_source(source, partitions, updates, key_cols=key_cols, ordering=ordering,
                                         partial=partial, incoming_wins_ties=incoming_wins_ties, app_id=app_id,
                                         batch_id=batch_id, custom_metadata=custom_metadata,
                                         added_columns=added_columns, unchanged=unchanged)
        added, schema = self._schema_adding(added_columns)
        spec = UpsertSpec(schema, self._written_columns(schema), key_cols, ordering, self.partition_by,
                          incoming_wins_ties, partial, unchanged)
        return self._commit_frame(source, partitions, updates, spec, added, app_id, batch_id, custom_metadata)

    def _commit_frame(self, source: DataFrame, partitions: Sequence[Mapping[str, str]], updates: int,
                      spec: UpsertSpec, added: Sequence[pa.Field], app_id: str, batch_id: int,
                      custom_metadata: Mapping[str, str]) -> CommitOutcome:
        """Spark's append of `source` (no partition holds an updated or deleted key), else its
        MERGE, in one commit carrying (app_id, batch_id)."""
        before = self._check_latest()
        self._add_columns(added, before)
        mode = "merge" if partitions else "append"
        with self._transaction(app_id, batch_id, custom_metadata, mode):
            if mode == "append":
                source.select(*map(quote_ident, spec.columns)).write.format("delta").mode("append").save(self.uri)
                unchanged = 0
            else:
                unchanged = max(0, updates - self._merge(source, upsert_clauses(spec, partitions)))
        self.refresh()
        return CommitOutcome(mode, self._landed_by_spark(app_id, batch_id, before), len(partitions), unchanged)

    def commit_history(self, writes: versions.HistoryWrites, app_id: str, batch_id: int,
                       custom_metadata: Mapping[str, str], added_columns: Sequence[pa.Field] = (),
                       ) -> tuple[CommitOutcome, versions.HistoryRewrite | versions.HistoryMerge]:
        if not (self._spark_writes_all() or (self._spark_writes == "merges" and self.history_update_mode() == "merge")):
            return super().commit_history(writes, app_id, batch_id, custom_metadata, added_columns)
        self._check_history_readable()
        before = self._check_latest()
        merged = versions.merge_rows(self.uri, self.stored_files(), writes)
        self._add_columns(added_columns, before)
        with self._transaction(app_id, batch_id, custom_metadata, "merge"):
            if merged.source.num_rows:
                columns = self._written_columns(writes.schema)
                self._merge(self._spark_frame(merged.source),
                            history_clauses(merged, writes.key_cols, self.partition_by, writes.schema, columns))
            else:
                self._append_nothing(writes.schema)
        self.refresh()
        return CommitOutcome("merge", self._landed_by_spark(app_id, batch_id, before), len(merged.partitions)), merged

    def _written_columns(self, schema: pa.Schema) -> list[str]:
        """The columns the sink writes: all but the identity columns, whose values are Spark's."""
        filled = set(self.filled_columns())
        return [f.name for f in schema if f.name not in filled]

    def _check_latest(self) -> int:
        """The loaded version, which must still be the table's latest: Spark's commit lands on
        the version it reads itself, so a commit of another writer since the batch was tagged
        fails it here (CommitFailedError: the retry policy decides), as delta-rs' would."""
        before = self.version()
        self.refresh()
        if self.version() != before:
            raise CommitFailedError(f"{self.uri}: version {self.version()} was committed after version {before}, "
                                    "which the batch was tagged against")
        return before

    def _add_columns(self, added_columns: Sequence[pa.Field], before: int) -> None:
        if not added_columns:
            return
        if not self._spark_alters():
            super()._add_columns(added_columns, before)
            return
        columns = ", ".join(f"{quote_ident(f.name)} {from_arrow_type(f.type).simpleString()}" for f in added_columns)
        self._session().sql(f"ALTER TABLE delta.{quote_ident(self.uri)} ADD COLUMNS ({columns})")
        self.table.load_as_version(before + 1)

    def _append_nothing(self, schema: pa.Schema) -> None:
        """An empty append: the commit records the transaction set around it."""
        self._spark_frame(schema.empty_table()).select(*map(quote_ident, self._written_columns(schema))) \
            .write.format("delta").mode("append").save(self.uri)

    def _merge(self, source: DataFrame, clauses: MergeClauses) -> int:
        """Run the MERGE from `source`; how many rows it updated."""
        view = f"upsert_sink_source_{uuid.uuid4().hex}"
        source.createOrReplaceTempView(view)
        try:
            result = self._session().sql(clauses.sql(f"delta.{quote_ident(self.uri)}", view)).collect()
        finally:
            self._session().catalog.dropTempView(view)
        return int(result[0]["num_updated_rows"]) if result else 0

    def _spark_frame(self, rows: pa.Table) -> DataFrame:
        # Without its empty chunks: pyspark 4.2's createDataFrame drops every row after an
        # empty chunk (checked: chunks of 2, 0 and 3 rows gave a DataFrame of 2). An empty
        # table keeps one: with none, it fails on nested columns ("cannot construct
        # ChunkedArray from empty vector").
        batches = [b for b in rows.to_batches() if b.num_rows] or [pa.RecordBatch.from_pylist([], schema=rows.schema)]
        return self._session().createDataFrame(pa.Table.from_batches(batches, rows.schema))

    @contextmanager
    def _transaction(self, app_id: str, batch_id: int, custom_metadata: Mapping[str, str], mode: str) -> Iterator[None]:
        """The session confs that make Spark's next commit carry (app_id, batch_id) and the
        sink's metadata, unset after it (a commit failing on a concurrent one is CommitFailedError);
        no other sink of the session commits in between (sink.session.confs)."""
        confs = {TXN_APP_ID: app_id, TXN_VERSION: str(batch_id),
                 USER_METADATA: json.dumps(commit_record(app_id, batch_id, custom_metadata, mode))}
        try:
            with session_confs(self._session(), confs):
                yield
        except Exception as e:
            if _concurrent_commit(e):
                raise CommitFailedError(f"{self.uri}: {e}") from e
            raise

    def _landed_by_spark(self, app_id: str, batch_id: int, after: int) -> int:
        """The version Spark committed the batch in, found by its app transaction: a commit
        without it (the session's confs changed under it) is refused, never taken as the batch's."""
        landed = self._version_carrying(app_id, batch_id, after)
        if landed is None:
            raise UnrecordedCommitError(
                f"{self.uri}: Spark committed batch {batch_id} without the sink's app transaction ({app_id}): "
                f"something else set or unset {TXN_APP_ID} in the session while it committed. The batch's rows "
                "are in the table but not recorded as the batch's; stop the other use of the session's Delta "
                "confs and restart the query (it replays the batch).")
        return landed

    def _session(self) -> SparkSession:
        if self._spark is None:
            raise RuntimeError("attach(spark) first")
        return self._spark


def _concurrent_commit(error: Exception) -> bool:
    """Delta's conflict exceptions (ConcurrentAppendException and its kin), as Spark raises them."""
    return "Concurrent" in type(error).__name__ or "io.delta.exceptions.Concurrent" in str(error)
