"""The `deltalake` (delta-rs) engine: commits run on the driver from Arrow, or, for writes
the executors kept, in one Spark task (sink.lakehouse.engines.merge_task)."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
from deltalake import CommitProperties, DeltaTable, Transaction, write_deltalake
from deltalake.exceptions import CommitFailedError

from sink.delta_log import checkpoints, log_commit, metadata_commit
from sink.delta_log.contract import Contract
from sink.delta_log.features import (
    ENABLE_DELETION_VECTORS,
    GENERATION_EXPRESSION,
    supports_deletion_vectors,
    unwritable_reason,
    writes_deletion_vectors,
)
from sink.delta_log.identity import IdentityValues
from sink.delta_log.live_vectors import LiveDeletionVectors
from sink.delta_log.predicates import partitions_predicate, quote_ident
from sink.delta_log.reading import CommitSummary, filesystem, read_app_versions, read_commit
from sink.delta_log.schema import pending, with_added
from sink.errors import ConfigError, UnsupportedTableError
from sink.lakehouse.commit import actions, rewrite, versions
from sink.lakehouse.commit.writes import (
    PARTIAL_COLUMN,
    REWRITE_MARKED_SHARE,
    WRITE_COLUMN,
    Writes,
    changing,
    commit_properties,
    distinct_partitions,
)
from sink.lakehouse.engines import append, merge, merge_task, open_tables
from sink.lakehouse.engines.merge_clauses import UpsertSpec, upsert_clauses
from sink.lakehouse.engines.update_modes import MERGE_ON_READ, UpdateModes
from sink.ordering import columns_of

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

__all__ = ["COMMIT_KINDS", "PARTIAL_COLUMN", "WRITE_COLUMN", "CommitFailedError", "CommitOutcome", "DeltaTarget",
           "append_once", "rows_in"]

log = logging.getLogger(__name__)

# How a batch's commit landed: new keys only, files rewritten, rows marked in deletion vectors
# (and their new versions written), or a MERGE (the fallback).
COMMIT_KINDS = ("append", "rewrite", MERGE_ON_READ, "merge")

@dataclass(frozen=True)
class CommitOutcome:
    mode: str  # one of COMMIT_KINDS
    version: int
    merge_partitions: int  # partitions holding updated or deleted keys
    unchanged: int = 0  # updates that changed nothing: the stored row already held them
    files_marked: int = 0  # stored files whose rows it marked deleted (merge-on-read)
    files_rewritten: int = 0  # stored files it replaced with new ones


class DeltaTarget(UpdateModes):
    """The target table, as seen by one sink; how its updates commit: `UpdateModes`."""

    def __init__(self, uri: str, partition_by: Sequence[str], commit_mode: str = "auto", *,
                 allow_protocol_upgrade: bool = False, checks_rows: bool = False,
                 rewrite_marked_share: float = REWRITE_MARKED_SHARE):
        """`checks_rows`: the batch checks every row it writes against the table's CHECK
        constraints, invariants and generated columns (`features.row_checks`) before it is
        written, so those need no MERGE. `rewrite_marked_share`: see `Writes`."""
        self.uri, self.partition_by, self.commit_mode = uri, list(partition_by), commit_mode
        self.allow_protocol_upgrade, self.checks_rows = allow_protocol_upgrade, checks_rows
        self.rewrite_marked_share = rewrite_marked_share
        self._dt: DeltaTable | None = None
        self._merge_reason: str | None = None  # logged once per reason
        self._vectors = LiveDeletionVectors(uri)

    def open_or_create(self, schema: pa.Schema, contract: Contract) -> DeltaTable:
        """Open the table; create it, empty, from the stream's schema and with the sink's
        contract when it does not exist."""
        if self._dt is None:
            _refuse_foreign_location(self.uri)
            if DeltaTable.is_deltatable(self.uri):
                self._dt = DeltaTable(self.uri)
                self._turn_on_deletion_vectors()
            else:
                vectors = {ENABLE_DELETION_VECTORS: "true"} if self.commit_mode == MERGE_ON_READ else {}
                metadata_commit.create(self.uri, schema, self.partition_by, {**contract.properties(), **vectors})
                self._dt = DeltaTable(self.uri)
        return self._dt

    def _turn_on_deletion_vectors(self) -> None:
        """commit_mode = "merge-on-read" on a table without deletion vectors: turn them on
        where the config allows the protocol upgrade, else refuse, naming both ways."""
        if self.commit_mode != MERGE_ON_READ or writes_deletion_vectors(self.table):
            return
        if not self.allow_protocol_upgrade:
            raise ConfigError(
                f"commit_mode = 'merge-on-read' needs deletion vectors, which table {self.uri} does not write: "
                f"turn them on (ALTER TABLE delta.`{self.uri}` SET TBLPROPERTIES ('{ENABLE_DELETION_VECTORS}' = "
                "'true'): a protocol upgrade to reader version 3 and writer version 7, which readers without "
                "deletion-vector support cannot read), or set allow_protocol_upgrade = true for the sink to do it, "
                "or commit_mode = 'auto'; nothing was written")
        log.warning("%s: turning deletion vectors on (commit_mode = 'merge-on-read', allow_protocol_upgrade): the "
                    "table's protocol goes to reader version 3, writer version 7", self.uri)
        metadata_commit.enable_deletion_vectors(self.table, self.uri)
        self.refresh()

    def contract(self) -> Contract | None:
        return Contract.from_properties(self.table.metadata().configuration)

    def partition_columns(self) -> list[str]:
        return list(self.table.metadata().partition_columns)

    def record_contract(self, contract: Contract) -> None:
        """Write the contract into the table's properties (a metadata-only commit)."""
        metadata_commit.set_properties(self.table, self.uri, contract.properties())
        self.refresh()

    def check_writable(self) -> None:
        """UnsupportedTableError, naming the feature, for a table delta-rs cannot write."""
        reason = unwritable_reason(self._read())
        if reason is not None:
            raise UnsupportedTableError(f"{self.uri} uses {reason}: delta-rs cannot write it; engine = 'delta-spark', "
                                        "or 'auto' in a session with Delta's extension, writes it through Spark; "
                                        "nothing was written")

    def attach(self, spark) -> None:
        """delta-rs commits without Spark."""

    def filled_columns(self) -> list[str]:
        return []  # a table with identity columns is refused (check_writable)

    def merges_on_executors(self) -> bool:
        """Updates this engine MERGEs are MERGEd from one Spark task (sink.lakehouse.engines.merge_task)."""
        return self.update_mode() == "merge"

    def exists(self) -> bool:
        return self._dt is not None or DeltaTable.is_deltatable(self.uri)

    def _read(self) -> DeltaTable:
        """The open table, or else its latest version, for the checks made before the sink
        opens it (the job's `validate`, a Connect client's `close`)."""
        return self._dt or DeltaTable(self.uri)

    @property
    def table(self) -> DeltaTable:
        if self._dt is None:
            raise RuntimeError("open_or_create() first")
        return self._dt

    def refresh(self) -> None:
        self.table.update_incremental()

    def refresh_if_open(self) -> None:
        """Read the open table's latest version (an unopened one is read at its latest)."""
        if self._dt is not None:
            self.refresh()

    def stored_files(self) -> dict[str, list[actions.StoredFile]]:
        """The loaded version's files by partition id, with the deletion vectors (and tags)
        they carry."""
        table = self.table
        if not supports_deletion_vectors(table):
            return actions.stored_files(table, self.partition_by)
        # Tags matter where a file is added again with a new vector: merge-on-read.
        vectors = self._vectors.at(table.version())
        return actions.stored_files(table, self.partition_by, vectors, self._vectors.tags)

    def version(self) -> int:
        return self.table.version()

    def table_id(self) -> str:
        return self._read().metadata().id

    def generated_columns(self) -> dict[str, str]:
        fields = self._read().schema().fields
        return {f.name: str(f.metadata[GENERATION_EXPRESSION]) for f in fields
                if GENERATION_EXPRESSION in (f.metadata or {})}

    def arrow_schema(self) -> pa.Schema:
        return pa.schema(self._read().schema().to_arrow())

    def transaction_version(self, app_id: str) -> int | None:
        return self.table.transaction_version(app_id)

    def commit(
        self,
        rows: pa.Table,
        key_cols: Sequence[str],
        ordering: str | Sequence[str],
        app_id: str,
        batch_id: int,
        custom_metadata: Mapping[str, str],
        incoming_wins_ties: bool,
        added_columns: Sequence[pa.Field] = (),
    ) -> CommitOutcome:
        """Commit one batch's writes in one transaction carrying (app_id, batch_id).

        `rows` has the table's columns plus WRITE_COLUMN (insert/update/delete/tombstone), and
        PARTIAL_COLUMN when updates are partial (ignore_null_updates).
        Only inserts (tombstones change nothing in the table) -> append, even an empty
        one, so the app transaction is recorded; otherwise one commit rewriting the files that
        hold updated or deleted keys (`rewrite`), or one MERGE pruned to their partitions.
        `added_columns` (nullable) join the table's schema in a commit just before.
        Raises CommitFailedError when another writer won the race.
        """
        before = self.version()
        rows = rows.filter(pc.not_equal(rows.column(WRITE_COLUMN), "tombstone"))
        updating = changing(rows)
        mode = self.update_mode() if pc.any(updating).as_py() else "append"
        if mode == "merge":
            self._check_claimable_by_delta_rs("its updates through delta-rs' MERGE")
        added_columns, schema = self._schema_adding(added_columns)
        self._add_columns(added_columns, before)  # first: the files written below are mapped by the new schema
        props = commit_properties(app_id, batch_id, custom_metadata, mode)
        identity = self.written_identity()
        writes = Writes(rows, schema, list(key_cols), columns_of(ordering), self.partition_by, incoming_wins_ties,
                        props, merge_on_read=mode == MERGE_ON_READ, change_data=self.change_data_feed(),
                        column_mapping=self.column_mapping(), identity=IdentityValues(identity) if identity else None,
                        layout=self.file_layout(), rewrite_marked_share=self.rewrite_marked_share)
        if mode == "append" and not identity and self.appends_through_delta_rs(writes.layout):
            append.commit(self.table, writes)
            self.refresh()
            return CommitOutcome("append", self._after_commit(app_id, batch_id, before), 0)
        partitions = distinct_partitions(rows.filter(updating), self.partition_by)
        if mode in ("append", "rewrite", MERGE_ON_READ):  # an append that generates identity values too
            done = rewrite.commit(self.table, self.uri, writes, self.stored_files(), vectors=self._vectors)
            unchanged, files = done.unchanged, done.files_changed
        else:
            unchanged, files = merge.commit(self.table, writes, partitions), (0, 0)
        self._record_batch(app_id, batch_id, writes.schema, props)
        return CommitOutcome(mode, self._after_commit(app_id, batch_id, before), len(partitions), unchanged, *files)

    def commit_source(self, source: DataFrame, partitions: Sequence[Mapping[str, str]], updates: int, *,
                      key_cols: Sequence[str], ordering: Sequence[str], partial: bool, incoming_wins_ties: bool,
                      app_id: str, batch_id: int, custom_metadata: Mapping[str, str],
                      added_columns: Sequence[pa.Field] = (), unchanged: bool = False) -> CommitOutcome:
        """The batch's writes as the executors hold them (`source`: the table's columns,
        WRITE_COLUMN and, when `partial`, PARTIAL_COLUMN), appended or MERGEd (pruned to
        `partitions`, those holding updated or deleted keys) by delta-rs in one Spark task:
        no row of it comes to this process."""
        self._check_claimable_by_delta_rs("its writes through delta-rs from one Spark task")
        before = self.version()
        added_columns, schema = self._schema_adding(added_columns)
        self._add_columns(added_columns, before)
        spec = UpsertSpec(schema, schema.names, key_cols, ordering, self.partition_by, incoming_wins_ties, partial,
                          unchanged)
        task = merge_task.MergeTask(self.uri, self.version(), schema,
                                    upsert_clauses(spec, partitions) if partitions else None, partial, app_id,
                                    batch_id, dict(custom_metadata))
        outcome = merge_task.run(task, source if partitions else source.select(*map(quote_ident, schema.names)))
        if outcome.conflict is not None:
            raise CommitFailedError(outcome.conflict)
        mode = "merge" if partitions else "append"
        self._record_batch(app_id, batch_id, schema, commit_properties(app_id, batch_id, custom_metadata, mode))
        return CommitOutcome(mode, self._after_commit(app_id, batch_id, before), len(partitions),
                             max(0, updates - outcome.updated))

    def commit_written(self, written: actions.Rewrite, app_id: str, batch_id: int,
                       custom_metadata: Mapping[str, str], added_columns: Sequence[pa.Field] = (),
                       partitions_changed: int = 0) -> CommitOutcome:
        """Commit files written elsewhere (Spark tasks) in one transaction carrying (app_id,
        batch_id): "rewrite" when it removes files, else "append". The removes must be files of
        the loaded version, which the commit lands right after, or it fails (CommitFailedError)."""
        before = self.version()
        added_columns, schema = self._schema_adding(added_columns)
        mode = (MERGE_ON_READ if self.update_mode() == MERGE_ON_READ else "rewrite") if written.removes else "append"
        props = commit_properties(app_id, batch_id, custom_metadata, mode)
        self._add_columns(added_columns, before)
        rewrite.commit_rewrite(self.table, self.uri, written, self.stored_files(), schema, self.partition_by, props,
                               vectors=self._vectors)
        self._record_batch(app_id, batch_id, schema, props)
        return CommitOutcome(mode, self._after_commit(app_id, batch_id, before), partitions_changed, written.unchanged,
                             *written.files_changed)

    def commit_history(self, writes: versions.HistoryWrites, app_id: str, batch_id: int,
                       custom_metadata: Mapping[str, str], added_columns: Sequence[pa.Field] = (),
                       ) -> tuple[CommitOutcome, versions.HistoryRewrite | versions.HistoryMerge]:
        """SCD type 2: commit the batch's keys' rebuilt histories in one transaction carrying
        (app_id, batch_id): "rewrite" when it replaces files, else "append" (even an empty
        one, so the app transaction is recorded); `added_columns` (in `writes.schema`) join
        the table just before. A table with a feature the rewrite cannot honour (a change
        data feed, constraints, invariants, generated columns) commits through a MERGE
        ("merge"). Raises CommitFailedError when another writer won the race;
        UnsupportedTableError when the table's files cannot be read as they are (deletion
        vectors, column mapping)."""
        self._check_history_readable()
        before = self.version()
        snapshot = self.stored_files()
        if self.history_update_mode() == "merge":
            self._check_claimable_by_delta_rs("its rebuilt histories through delta-rs' MERGE")
            merged = versions.merge_rows(self.uri, snapshot, writes)
            props = commit_properties(app_id, batch_id, custom_metadata, "merge")
            self._add_columns(added_columns, before)
            if merged.source.num_rows:
                merge.commit_history(self.table, merged, writes.key_cols, self.partition_by, writes.schema, props)
            self._record_batch(app_id, batch_id, writes.schema, props)
            return CommitOutcome("merge", self._after_commit(app_id, batch_id, before), len(merged.partitions)), merged
        done = versions.rewrite_files(self.uri, snapshot, writes)
        mode = "rewrite" if done.rewrite.removes else "append"
        props = commit_properties(app_id, batch_id, custom_metadata, mode)
        self._add_columns(added_columns, before)
        rewrite.commit_rewrite(self.table, self.uri, done.rewrite, snapshot, writes.schema, self.partition_by, props,
                               vectors=self._vectors)
        self._record_batch(app_id, batch_id, writes.schema, props)
        landed = self._after_commit(app_id, batch_id, before)
        return CommitOutcome(mode, landed, done.rewrite.partitions_rewritten, 0, *done.rewrite.files_changed), done

    def _schema_adding(self, added_columns: Sequence[pa.Field]) -> tuple[list[pa.Field], pa.Schema]:
        """Of the batch's new columns, those the table still lacks, and its schema with them."""
        present = self.arrow_schema()
        added = pending(added_columns, present)
        return added, with_added(present, added)

    def _add_columns(self, added_columns: Sequence[pa.Field], before: int) -> None:
        """Add the batch's new columns in a metadata commit right after version `before`.
        Not MERGE's merge_schema: delta-rs 1.6.6 then gives the table a new id (every replica
        would rebuild); nor its `alter` (metadata_commit says why). It keeps the id and changes
        no row; like the batch's commit it lands right after the checked version or fails, and
        the commit goes on from it."""
        if not added_columns:
            return
        metadata_commit.add_columns(self.table, self.uri, added_columns,
                                    allow_protocol_upgrade=self.allow_protocol_upgrade)
        self.table.load_as_version(before + 1)

    def _record_batch(self, app_id: str, batch_id: int, schema: pa.Schema, props: CommitProperties) -> None:
        """After a commit that may have written nothing (a MERGE then writes no version, a
        rewrite whose stored rows are all newer has nothing to commit): record the batch
        anyway, with an empty append."""
        self.refresh()
        recorded = self.transaction_version(app_id)
        if recorded is None or recorded < batch_id:
            if self.written_identity() or self._external_log:  # a table delta-rs does not write
                log_commit.commit(self.table, self.uri, [], props, operation="WRITE", parameters={"mode": "Append"},
                                  metrics={})
            else:
                write_deltalake(self.table, schema.empty_table(), mode="append", commit_properties=props,
                                post_commithook_properties=checkpoints.NO_HOOKS)
            self.refresh()

    def commits_since(self, version: int) -> list[CommitSummary]:
        """The commits after `version` up to the loaded one (a gone log entry reads as a
        commit that may have changed anything)."""
        return [read_commit(self.uri, v, self.partition_by, self.partition_log_keys()) or CommitSummary(v, {}, None, {})
                for v in range(version + 1, self.version() + 1)]

    def _after_commit(self, app_id: str, batch_id: int, after: int) -> int:
        """The version carrying (app_id, batch_id), committed after version `after` (the
        latest version may already be another writer's); then a checkpoint where Spark would
        have put one over the batch's versions."""
        landed = self._version_carrying(app_id, batch_id, after)
        # After the lookup: the checkpoint's cleanup may remove the batch's own log entry.
        checkpoints.checkpoint_if_due(self.table, self.uri, after + 1)
        return self.version() if landed is None else landed

    def _version_carrying(self, app_id: str, batch_id: int, after: int) -> int | None:
        """The version after `after` whose app transaction is (app_id, batch_id), if any."""
        return next((v for v in range(after + 1, self.version() + 1)
                     if (read_app_versions(self.uri, v) or {}).get(app_id) == batch_id), None)


def rows_in(table: DeltaTable, pids: Sequence[str], columns: Sequence[str]) -> pa.Table:
    """`columns` of the rows of `table` (at its loaded version) in these partitions (ids as
    `keys.partition_id` names them)."""
    schema = pa.schema(table.schema().to_arrow())
    if not pids:
        return pa.schema([f for f in schema if f.name in columns]).empty_table()
    where = partitions_predicate(pids, {f.name: f.type for f in schema})
    return pa.table(table.scan(columns=list(columns), predicate=where))


def append_once(
    uri: str, rows: pa.Table, partition_by: Sequence[str], app_id: str, batch_id: int,
    schema_mode: str | None = None, owner: str = "",
) -> bool:
    """Append `rows` to a side table (quarantine, tombstones) unless this batch already did;
    `schema_mode="merge"` adds columns an older table lacks. Returns True when it wrote.
    `owner`: the table is kept open for it between calls (sink.lakehouse.engines.open_tables).
    """
    if rows.num_rows == 0:
        return False
    if not DeltaTable.is_deltatable(uri):
        _append(uri, rows, partition_by, app_id, batch_id, schema_mode)
        return True
    with open_tables.lend(uri, owner) as table:
        done = table.transaction_version(app_id)
        if done is not None and done >= batch_id:
            return False
        _append(table, rows, partition_by, app_id, batch_id, schema_mode)
    return True


def _append(table: str | DeltaTable, rows: pa.Table, partition_by: Sequence[str], app_id: str, batch_id: int,
            schema_mode: str | None) -> None:
    write_deltalake(
        table,
        rows,
        mode="append",
        partition_by=list(partition_by) or None,
        schema_mode=schema_mode,
        commit_properties=CommitProperties(app_transactions=[Transaction(app_id, batch_id)]),
    )


def _refuse_foreign_location(uri: str) -> None:
    """The table location must be a Delta table, a new or empty folder: never a file, nor a
    folder of other data (a `_delta_log` would be created inside it)."""
    fs, path = filesystem(uri)
    info = fs.get_file_info(path)
    if info.type == pafs.FileType.File:
        raise ConfigError(f"table_uri = {uri!r} is a file, not a folder: point it at a Delta table's folder, "
                          "or at a new one for the sink to create")
    if info.type != pafs.FileType.Directory:
        return
    names = {entry.base_name for entry in fs.get_file_info(pafs.FileSelector(path))}
    if names and "_delta_log" not in names:
        raise ConfigError(f"table_uri = {uri!r} is a folder that holds files but no Delta table (no _delta_log): "
                          "the sink creates its table only in a new or empty folder")
