"""The Delta engine a sink commits through, behind one interface: what the batch's phases ask
of the target table. `deltalake` (delta-rs: sink.lakehouse.delta_rs.DeltaTarget) is the one
engine today; `delta-spark` plugs in here as another implementation."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

import pyarrow as pa
from deltalake import DeltaTable

from sink.config import SinkConfig
from sink.lakehouse import rewrite, versions
from sink.lakehouse.contract import Contract
from sink.lakehouse.delta_rs import CommitOutcome, DeltaTarget
from sink.lakehouse.log import CommitSummary


class DeltaEngine(Protocol):
    """The target table as one sink sees it. Every commit carries the app transaction
    (app_id, batch_id) and lands on the version last read, or raises CommitFailedError."""

    @property
    def table(self) -> DeltaTable:
        """The table at the version last read, for reads (delta-rs reads what either engine writes)."""

    def exists(self) -> bool: ...

    def check_writable(self) -> None:
        """UnsupportedTableError, naming the feature, when this engine cannot write the table."""

    def open_or_create(self, schema: pa.Schema, contract: Contract) -> DeltaTable: ...

    def refresh(self) -> None:
        """Read the table's latest version."""

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
        """How updates commit on this table: "rewrite" (copy-on-write of located files) or "merge"."""

    def commits_since(self, version: int) -> list[CommitSummary]: ...

    def commit(self, rows: pa.Table, key_cols: Sequence[str], ordering: str | Sequence[str], app_id: str,
               batch_id: int, custom_metadata: Mapping[str, str], incoming_wins_ties: bool,
               added_columns: Sequence[pa.Field] = ()) -> CommitOutcome:
        """The batch's writes, held by the driver: append, rewrite or MERGE."""

    def commit_written(self, written: rewrite.Rewrite, app_id: str, batch_id: int,
                       custom_metadata: Mapping[str, str], added_columns: Sequence[pa.Field] = (),
                       partitions_changed: int = 0) -> CommitOutcome:
        """The files Spark's writing tasks wrote, as Add/Remove actions."""

    def commit_history(self, writes: versions.HistoryWrites, app_id: str, batch_id: int,
                       custom_metadata: Mapping[str, str], added_columns: Sequence[pa.Field] = (),
                       ) -> tuple[CommitOutcome, versions.HistoryRewrite | versions.HistoryMerge]:
        """A history table's rebuilt versions of the batch's keys."""


def delta_engine(config: SinkConfig) -> DeltaEngine:
    """The engine `config.engine` names (the config refuses the ones not built yet)."""
    return DeltaTarget(config.table_uri, config.partition_by, config.commit_mode)
