"""The Delta engine a sink commits through, behind one interface: what the batch's phases ask
of the target table. `deltalake` (delta-rs: sink.lakehouse.engines.delta_rs.DeltaTarget) and
`delta-spark` (Delta's Spark engine where delta-rs cannot or should not write:
sink.lakehouse.engines.delta_spark.DeltaSparkTarget)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

import pyarrow as pa
from deltalake import DeltaTable
from pyspark.sql import DataFrame, SparkSession

from sink.config import SinkConfig
from sink.delta_log.column_mapping import ColumnMapping
from sink.delta_log.contract import Contract
from sink.delta_log.file_layout import FileLayout
from sink.delta_log.identity import IdentityColumn
from sink.delta_log.reading import CommitSummary
from sink.lakehouse.commit import actions, versions
from sink.lakehouse.engines.delta_rs import CommitOutcome, DeltaTarget
from sink.lakehouse.engines.delta_spark import DeltaSparkTarget


class DeltaEngine(Protocol):
    """The target table as one sink sees it. Every commit carries the app transaction
    (app_id, batch_id) and lands on the version last read, or raises CommitFailedError."""

    # Merge-on-read rewrites a file once this share of its rows would be marked (Writes').
    rewrite_marked_share: float

    @property
    def table(self) -> DeltaTable:
        """The table at the version last read, for reads (delta-rs reads what either engine writes)."""

    def attach(self, spark: SparkSession) -> None:
        """The Spark session of the stream's batches (an engine that commits through Spark
        checks it can)."""

    def exists(self) -> bool: ...

    def filled_columns(self) -> list[str]:
        """Columns whose values the engine writes itself (identity columns): the stream need
        not carry them."""

    def check_writable(self) -> None:
        """UnsupportedTableError, naming the feature, when this engine cannot write the table."""

    def open_or_create(self, schema: pa.Schema, contract: Contract) -> DeltaTable: ...

    def refresh(self) -> None:
        """Read the table's latest version."""

    def refresh_if_open(self) -> None:
        """Read the table's latest version if it is open (an unopened one is read at its latest)."""

    def stored_files(self) -> dict[str, list[actions.StoredFile]]:
        """The loaded version's files by partition id, with their deletion vectors."""

    def version(self) -> int: ...

    def table_id(self) -> str: ...

    def arrow_schema(self) -> pa.Schema: ...

    def generated_columns(self) -> dict[str, str]:
        """The table's generated columns and their SQL expressions."""

    def partition_columns(self) -> list[str]: ...

    def contract(self) -> Contract | None: ...

    def record_contract(self, contract: Contract) -> None: ...

    def transaction_version(self, app_id: str) -> int | None: ...

    def update_mode(self) -> str:
        """How updates commit on this table: "rewrite" (copy-on-write of located files),
        "merge-on-read" (deletion vectors mark the located rows) or "merge"."""

    def history_update_mode(self) -> str:
        """How a history table's rebuilt versions commit: "rewrite" or "merge"."""

    def change_data_feed(self) -> bool:
        """Whether the table has a change data feed, whose files a rewrite writes."""

    def column_mapping(self) -> ColumnMapping | None:
        """The table's column mapping, under which a rewrite reads and writes its files."""

    def file_layout(self) -> FileLayout:
        """What the table's properties ask of the files a rewrite writes."""

    def written_identity(self) -> tuple[IdentityColumn, ...]:
        """The identity columns whose values the sink's commits generate for new rows."""

    def partition_log_keys(self) -> tuple[str, ...]:
        """The names the log's partition values go by (physical ones under column mapping)."""

    def commits_since(self, version: int) -> list[CommitSummary]: ...

    def commit(self, rows: pa.Table, key_cols: Sequence[str], ordering: str | Sequence[str], app_id: str,
               batch_id: int, custom_metadata: Mapping[str, str], incoming_wins_ties: bool,
               added_columns: Sequence[pa.Field] = ()) -> CommitOutcome:
        """The batch's writes, held by the driver: append, rewrite or MERGE."""

    def merges_on_executors(self) -> bool:
        """Whether updates this engine MERGEs can be read from where the executors tagged
        them (`commit_source`), none of their rows coming to the driver."""

    def commit_source(self, source: DataFrame, partitions: Sequence[Mapping[str, str]], updates: int, *,
                      key_cols: Sequence[str], ordering: Sequence[str], partial: bool, incoming_wins_ties: bool,
                      app_id: str, batch_id: int, custom_metadata: Mapping[str, str],
                      added_columns: Sequence[pa.Field] = (), unchanged: bool = False) -> CommitOutcome:
        """The batch's writes as a Spark DataFrame (when `merges_on_executors()`): appended, or
        MERGEd pruned to `partitions`, those holding updated or deleted keys; `unchanged`: its
        string values may be UNCHANGED (unchanged_value), which keep the stored ones."""

    def commit_written(self, written: actions.Rewrite, app_id: str, batch_id: int,
                       custom_metadata: Mapping[str, str], added_columns: Sequence[pa.Field] = (),
                       partitions_changed: int = 0) -> CommitOutcome:
        """The files Spark's writing tasks wrote, as Add/Remove actions."""

    def commit_history(self, writes: versions.HistoryWrites, app_id: str, batch_id: int,
                       custom_metadata: Mapping[str, str], added_columns: Sequence[pa.Field] = (),
                       ) -> tuple[CommitOutcome, versions.HistoryRewrite | versions.HistoryMerge]:
        """A history table's rebuilt versions of the batch's keys."""


def delta_engine(config: SinkConfig) -> DeltaEngine:
    """The engine `config.engine` names; "auto" is delta-rs where it can write the table and
    Spark where it cannot, when the session has Delta's extension."""
    options = dict(allow_protocol_upgrade=config.allow_protocol_upgrade, checks_rows=config.writes_records_as_rows,
                   rewrite_marked_share=config.commit.rewrite_marked_share)
    if config.engine == "deltalake":
        return DeltaTarget(config.table_uri, config.partition_by, config.commit_mode, **options)
    return DeltaSparkTarget(config.table_uri, config.partition_by, config.commit_mode, **options,
                            spark_writes="merges" if config.engine == "delta-spark" else "unwritable",
                            generates_identity=config.scd_type == 1)
