"""The checks before a batch's work: the stream against the config and the table's schema,
the table against the config's contract, and the writer id against the batches the table
already holds from it."""

from __future__ import annotations

import logging

import pyarrow as pa
from pyspark.sql import DataFrame
from pyspark.sql import functions as F
from pyspark.sql.pandas.types import to_arrow_schema

from sink import columns as C
from sink.batch.state import BatchState
from sink.config import SinkConfig
from sink.config.options import HIDDEN_ORDERING_PREFIX
from sink.delta_log.contract import Contract
from sink.delta_log.features import append_only, row_checks
from sink.delta_log.schema import added_columns, check_history_columns, pending
from sink.errors import (
    ConstraintViolationError,
    ContractMismatchError,
    SchemaError,
    UnsupportedTableError,
    WriterIdReusedError,
)
from sink.history import HISTORY_COLUMNS, RUN_EVENTS, HistoryColumns, history_fields
from sink.lakehouse.engines.engine import DeltaEngine
from sink.library_errors import first_line
from sink.routing import quarantine_reason, validate_stream, violation, with_hidden_ordering
from sink.session import session_kind

log = logging.getLogger(__name__)


class Checks:
    """`config`: as the sink runs on it (sink.config.SinkConfig.as_stored); `stream_config`: as
    written, what the stream is checked against."""

    def __init__(self, config: SinkConfig, stream_config: SinkConfig, target: DeltaEngine, writer_id: str):
        self._config = config
        self._stream_config = stream_config
        self._target = target
        self._writer_id = writer_id
        self.contract = Contract.of(config)  # where the table keeps the ordering
        self._validated = None
        self._constraints_checked = None

    def run(self, state: BatchState) -> None:
        """Open (or create) the table at its latest version and check the batch against it;
        sets the batch's hidden ordering copies, its added columns and the writer's last batch."""
        cfg = self._config
        # The latest version, before the stream is checked against its schema; a table opened
        # or created below is read at its latest.
        self._target.refresh_if_open()
        self.validate(state.batch_df)
        state.batch_df = batch_df = with_hidden_ordering(state.batch_df, self._stream_config)
        self._target.open_or_create(self.stored_schema(batch_df), self.contract)
        self._target.check_writable()
        if cfg.scd_type == 2 and append_only(self._target.table):
            raise UnsupportedTableError(f"{cfg.table_uri} is append-only (delta.appendOnly = true): a history table "
                                        "(scd_type = 2) closes a key's stored version when a new one comes, which "
                                        "changes a stored row; nothing was written")
        self._check_contract()
        state.added = self.added_columns(batch_df)
        if cfg.check_constraints == "quarantine":
            state.constraints = self._constraints(batch_df)
        elif cfg.writes_records_as_rows and self._target.update_mode() != "merge":
            self._refuse_breaking(state)
        state.committed = self._target.transaction_version(self._writer_id)
        if state.added:
            log.warning("batch %s adds column(s) %s to %s (schema_evolution = 'add_columns')", state.batch_id,
                        [f.name for f in state.added], cfg.table_uri)
        if state.committed is not None and state.batch_id < state.committed:
            raise WriterIdReusedError(
                f"batch {state.batch_id} is older than batch {state.committed}, already committed to "
                f"{cfg.table_uri} by writer_id {self._writer_id!r}: the checkpoint is new or was "
                "reset. A new checkpoint location needs a new writer_id."
            )

    def validate(self, df: DataFrame) -> None:
        """Check the stream against the config and, when the table exists, against the
        table's schema; the job calls it before starting the query."""
        if self._validated != df.schema:
            validate_stream(self._stream_config, df)
            if not self._config.num_shards:  # ConfigError where the session cannot tell its cores
                session_kind(df.sparkSession).default_parallelism()
            if self._target.exists():
                self._target.check_writable()
                self.added_columns(with_hidden_ordering(df, self._stream_config))
            self._validated = df.schema

    def _constraints(self, df: DataFrame) -> dict[str, str]:
        """The table's row checks, each checked once to apply to the stream's columns."""
        checks = row_checks(self._target.table)
        key = (df.schema, tuple(checks.items()))
        if self._constraints_checked != key:
            for label, expr in checks.items():
                try:
                    df.select(F.expr(expr)).schema  # noqa: B018 (analysis only)
                except Exception as e:
                    raise SchemaError(
                        f"{self._config.table_uri}'s {label} ({expr}) does not apply to the stream's columns "
                        f"({first_line(e)}): check_constraints = 'quarantine' evaluates it on each record; set "
                        "check_constraints = 'fail' to leave it to the commit") from e
            self._constraints_checked = key
        return checks

    def _refuse_breaking(self, state: BatchState) -> None:
        """check_constraints = "fail", on a table whose updates the sink commits itself:
        ConstraintViolationError, naming the check and a key, when an upsert breaks one of the
        table's row checks. Before anything is written, because the rewrite and the log commit
        check nothing (a MERGE does: its tables are left to it). One Spark job a batch, on
        tables with row checks."""
        cfg = self._config
        checks = row_checks(self._target.table)
        if not checks:
            return
        df = state.batch_df
        violations = [violation(label, expr) for label, expr in checks.items()]
        broken = (df.select(F.expr(quarantine_reason(cfg, df.schema, checks)).alias("broken"), *cfg.key)
                  .where(F.col("broken").isin(violations)).limit(1).collect())
        if broken:
            row = broken[0].asDict()
            reason = row.pop("broken")
            raise ConstraintViolationError(
                f"batch {state.batch_id}: the record with key {row} breaks {cfg.table_uri}'s {reason}; "
                "check_constraints = 'fail' refuses the batch, nothing was written. Fix the record upstream, or "
                "set check_constraints = 'quarantine' to set such records aside")

    def added_columns(self, df: DataFrame) -> list[pa.Field]:
        """The stream's columns the table lacks (added in the batch's commit); SchemaError for
        a dropped column or a type whose values a cast would change."""
        cfg = self._config
        roles = {**dict.fromkeys(cfg.key, "key"), **dict.fromkeys(cfg.partition_by, "partition_by"),
                 **dict.fromkeys(cfg.ordering_columns, "ordering")}
        table = self._target.arrow_schema()
        hidden = {c: HIDDEN_ORDERING_PREFIX + c for c in cfg.ordering_columns}
        hidden = {c: h for c, h in hidden.items() if h in table.names}
        if hidden:
            raise ContractMismatchError(
                f"{cfg.table_uri} keeps the ordering column(s) {list(hidden)} as {list(hidden.values())}: "
                "except_columns named them when the table was written; name them in except_columns again")
        check_history_columns(cfg.table_uri, table, self._history_fields(df, table) if cfg.scd_type == 2 else [])
        stored = [c for c in cfg.except_columns if c in table.names]
        if stored:
            raise SchemaError(f"except_columns {stored} are columns {cfg.table_uri} stores: the sink never leaves a "
                              "stored column empty; remove them from except_columns, or from the table first")
        # The history columns are the sink's: their type follows the contract, checked apart.
        # The engine fills the identity columns.
        filled = self._target.filled_columns()
        stored_stream = self.stored_schema(df, table.names)
        carried = [c for c in filled if c in stored_stream.names]
        if carried:
            raise SchemaError(f"the stream carries {cfg.table_uri}'s identity column(s) {carried}, whose values Delta "
                              "generates: drop them from the stream's select")
        unwritten = {*HISTORY_COLUMNS, *filled}
        stream, table = (pa.schema([f for f in s if f.name not in unwritten]) for s in (stored_stream, table))
        added = added_columns(stream, table, roles, cfg.schema_evolution, self._target.generated_columns())
        if cfg.scd_type == 2 and added:
            # A new untracked column (any, with ignore_null_updates) joins the run events too:
            # __RUN_EVENTS gains it as a field, null for the events stored before.
            values = pa.schema([*table, *added])
            run_events = next(f for f in history_fields(values, self.history_columns(values)) if f.name == RUN_EVENTS)
            added += pending([run_events], self._target.arrow_schema())
        return added

    def stored_schema(self, df: DataFrame, table_columns: list[str] = ()) -> pa.Schema:
        """The stream's columns the table stores: all but `except_columns` and the corrupt-record
        column (kept where `table_columns` already has it: a table created before the sink knew it)."""
        schema = to_arrow_schema(df.schema, timezone="UTC")
        unstored = set(self._config.unstored_columns) - ({self._config.corrupt_record_column} & set(table_columns))
        stored = pa.schema([f for f in schema if f.name not in unstored])
        if self._config.scd_type != 2:
            return stored
        return pa.schema([*stored, *history_fields(stored, self.history_columns(stored))])

    def history_columns(self, schema: pa.Schema) -> HistoryColumns:
        """scd_type = 2: the history's columns in a table of `schema`. A key's history is per
        partition in partitioned scope; in global scope the partition columns are values."""
        cfg = self._config
        fixed = {*cfg.identity_columns, *cfg.ordering_columns, *HISTORY_COLUMNS}
        values = [f.name for f in schema if f.name not in fixed]
        return HistoryColumns(key=tuple(cfg.identity_columns), ordering=tuple(cfg.ordering_columns),
                              delete=C.DELETE, values=tuple(values),
                              tracked=tuple(cfg.tracked_columns([*values, *cfg.ordering_columns])),
                              fill_nulls=cfg.ignore_null_updates)

    def _history_fields(self, df: DataFrame, table: pa.Schema) -> list[pa.Field]:
        """scd_type = 2: the history columns this config gives `table`, from the stream's
        columns the table has (a new one is checked as an added column)."""
        stored = pa.schema([f for f in self.stored_schema(df, table.names)
                            if f.name in table.names and f.name not in HISTORY_COLUMNS])
        return history_fields(stored, self.history_columns(stored))

    def _check_contract(self) -> None:
        """Refuse a table written under another key, partitioning, ordering or scope; record
        the contract on a table that has none yet (created before sinks recorded it, or by
        another tool)."""
        cfg = self._config
        partitioned_by = self._target.partition_columns()
        if partitioned_by != list(cfg.partition_by):
            raise SchemaError(f"{cfg.table_uri} is partitioned by {partitioned_by}, the config's partition_by is "
                              f"{list(cfg.partition_by)}: they must be the same")
        recorded = self._target.contract()
        if recorded is None:
            log.warning("%s has no sink contract yet: recording it in the table's properties (%s), one SET "
                        "TBLPROPERTIES commit; a sink started later with another key, partitioning, ordering or "
                        "scope is refused", cfg.table_uri,
                        ", ".join(f"{k} = {v}" for k, v in self.contract.properties().items()))
            self._target.record_contract(self.contract)
        elif recorded != self.contract:
            raise ContractMismatchError(
                f"{cfg.table_uri} records another sink contract than the config (table vs config): "
                f"{'; '.join(recorded.differences(self.contract))}. Restore the config, or change the contract "
                "deliberately with `python -m sink contract --config <file> --rewrite`, which checks the table's "
                "rows against the new one and rebuilds the index."
            )
