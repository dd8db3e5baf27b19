"""The `deltalake` (delta-rs) engine: commits run on the driver from Arrow."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
from deltalake import CommitProperties, DeltaTable, Schema, Transaction, write_deltalake
from deltalake.exceptions import CommitFailedError

from sink import keys
from sink.errors import ConfigError
from sink.lakehouse.contract import Contract
from sink.lakehouse.log import CommitSummary, filesystem, read_commit
from sink.lakehouse.predicates import MAX_PARTITION_LITERALS, merge_predicate, partition_predicate, quote_ident
from sink.ordering import columns_of, newer_sql

__all__ = ["CommitFailedError", "CommitOutcome", "DeltaTarget", "append_once"]

WRITE_COLUMN = "__sink_write"
# ignore_null_updates: on an update, whether its null columns keep the stored values.
PARTIAL_COLUMN = "__sink_partial"


@dataclass(frozen=True)
class CommitOutcome:
    mode: str  # "append" or "merge"
    version: int
    merge_partitions: int


class DeltaTarget:
    """The target table, as seen by one sink."""

    def __init__(self, uri: str, partition_by: Sequence[str]):
        self.uri = uri
        self.partition_by = list(partition_by)
        self._dt: DeltaTable | None = None

    def open_or_create(self, schema: pa.Schema, contract: Contract) -> DeltaTable:
        """Open the table; create it, empty, from the stream's schema and with the sink's
        contract when it does not exist."""
        if self._dt is None:
            _refuse_foreign_location(self.uri)
            if DeltaTable.is_deltatable(self.uri):
                self._dt = DeltaTable(self.uri)
            else:
                self._dt = DeltaTable.create(
                    self.uri, schema, partition_by=self.partition_by or None, mode="ignore",
                    configuration=contract.properties(), raise_if_key_not_exists=False,
                )
        return self._dt

    def contract(self) -> Contract | None:
        return Contract.from_properties(self.table.metadata().configuration)

    def partition_columns(self) -> list[str]:
        return list(self.table.metadata().partition_columns)

    def record_contract(self, contract: Contract) -> None:
        """Write the contract into the table's properties (a metadata-only commit)."""
        self.table.alter.set_table_properties(contract.properties(), raise_if_not_exists=False)
        self.refresh()

    def exists(self) -> bool:
        return self._dt is not None or DeltaTable.is_deltatable(self.uri)

    @property
    def table(self) -> DeltaTable:
        if self._dt is None:
            raise RuntimeError("open_or_create() first")
        return self._dt

    def refresh(self) -> None:
        self.table.update_incremental()

    def version(self) -> int:
        return self.table.version()

    def table_id(self) -> str:
        return self.table.metadata().id

    def arrow_schema(self) -> pa.Schema:
        if self._dt is None:
            return pa.schema(DeltaTable(self.uri).schema().to_arrow())
        return pa.schema(self.table.schema().to_arrow())

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
        one, so the app transaction is recorded; otherwise one pruned MERGE. `added_columns`
        (nullable) join the table's schema in the append's commit, or just before the MERGE.
        Raises CommitFailedError when another writer won the race.
        """
        # No retries: the commit lands on the version after this snapshot, the one its tags
        # were checked against, or fails (the caller checks what landed and decides).
        props = CommitProperties(
            app_transactions=[Transaction(app_id, batch_id)], custom_metadata=dict(custom_metadata),
            max_commit_retries=0,
        )
        before = self.version()
        present = self.arrow_schema()
        added_columns = [f for f in added_columns if f.name not in present.names]  # a retry may have added them
        schema = pa.schema([*present, *added_columns])
        evolve = {"schema_mode": "merge"} if added_columns else {}
        writes = rows.column(WRITE_COLUMN)
        table_rows = rows.filter(pc.not_equal(writes, "tombstone"))
        changing = table_rows.filter(pc.is_in(table_rows.column(WRITE_COLUMN), pa.array(["update", "delete"])))
        if changing.num_rows == 0:
            write_deltalake(self.table, _conform(table_rows, schema), mode="append", commit_properties=props,
                            **evolve)
            self.refresh()
            return CommitOutcome("append", self._landed(app_id, batch_id, before), 0)
        partitions = _distinct_partitions(changing, self.partition_by)
        if added_columns:
            # Not MERGE's merge_schema: delta-rs 1.6.6 then gives the table a new id (every replica
            # would rebuild). A metadata commit just before keeps it and changes no row; like the
            # MERGE it lands right after the checked version or fails, and the MERGE goes on from it.
            self.table.alter.add_columns(Schema.from_arrow(pa.schema(added_columns)).fields,
                                         commit_properties=CommitProperties(max_commit_retries=0))
            self.table.load_as_version(before + 1)
        self._merge(table_rows, schema, key_cols, ordering, partitions, props, incoming_wins_ties)
        self.refresh()
        recorded = self.transaction_version(app_id)
        if recorded is None or recorded < batch_id:
            # The MERGE changed nothing (delta-rs then writes no version): record the batch anyway.
            write_deltalake(self.table, schema.empty_table(), mode="append", commit_properties=props, **evolve)
            self.refresh()
        return CommitOutcome("merge", self._landed(app_id, batch_id, before), len(partitions))

    def rows_in(self, pids: Sequence[str], columns: Sequence[str]) -> pa.Table:
        """`columns` of the rows in these partitions (ids as `keys.partition_id` names them)."""
        if not pids:
            return pa.schema([f for f in self.arrow_schema() if f.name in columns]).empty_table()
        types = {f.name: f.type for f in self.arrow_schema()}
        # Bounded like the MERGE's predicate: past the limit, the scan reads every partition.
        where = None if len(pids) > MAX_PARTITION_LITERALS else " OR ".join(
            f"({partition_predicate(keys.partition_values(p), types)})" for p in pids)
        return pa.table(self.table.scan(columns=list(columns), predicate=where))

    def commits_since(self, version: int) -> list[CommitSummary]:
        """The commits after `version` up to the loaded one (a gone log entry reads as a
        commit that may have changed anything)."""
        return [read_commit(self.uri, v, self.partition_by) or CommitSummary(v, {}, None, {})
                for v in range(version + 1, self.version() + 1)]

    def _landed(self, app_id: str, batch_id: int, after: int) -> int:
        """The version carrying (app_id, batch_id), committed after version `after`: the
        latest version may already be another writer's."""
        return next((c.version for c in self.commits_since(after) if c.app_versions.get(app_id) == batch_id),
                    self.version())

    def _merge(self, rows, schema, key_cols, ordering, partitions, props, incoming_wins_ties) -> None:
        types = {f.name: f.type for f in schema}
        source = _conform(rows, schema).append_column(WRITE_COLUMN, rows.column(WRITE_COLUMN))
        partial = PARTIAL_COLUMN in rows.column_names
        if partial:
            source = source.append_column(PARTIAL_COLUMN, pc.fill_null(rows.column(PARTIAL_COLUMN), False))
        predicate = merge_predicate(key_cols, self.partition_by, partitions, types)
        columns = {quote_ident(f.name): f"s.{quote_ident(f.name)}" for f in schema}
        w = f"s.{quote_ident(WRITE_COLUMN)}"
        # Guard on ordering too: the index already decided, this keeps a stale
        # replica from ever overwriting a newer row.
        newer = newer_sql(columns_of(ordering), quote_ident, incoming_wins_ties)
        merge = (self.table.merge(source, predicate, source_alias="s", target_alias="t", commit_properties=props)
                 .when_matched_delete(predicate=f"{w} = 'delete' AND {newer}"))
        if partial:  # the first matching clause applies: partial updates keep stored values
            merge = merge.when_matched_update(
                updates={c: f"coalesce({v}, t.{c})" for c, v in columns.items()},
                predicate=f"{w} <> 'delete' AND s.{quote_ident(PARTIAL_COLUMN)} AND {newer}")
        (
            merge.when_matched_update(updates=columns, predicate=f"{w} <> 'delete' AND {newer}")
            .when_not_matched_insert(updates=columns, predicate=f"{w} <> 'delete'")
            .execute()
        )


def append_once(
    uri: str, rows: pa.Table, partition_by: Sequence[str], app_id: str, batch_id: int,
    schema_mode: str | None = None,
) -> bool:
    """Append `rows` to a side table (quarantine, tombstones) unless this batch already did;
    `schema_mode="merge"` adds columns an older table lacks. Returns True when it wrote.
    """
    if rows.num_rows == 0:
        return False
    if DeltaTable.is_deltatable(uri):
        done = DeltaTable(uri).transaction_version(app_id)
        if done is not None and done >= batch_id:
            return False
    write_deltalake(
        uri,
        rows,
        mode="append",
        partition_by=list(partition_by) or None,
        schema_mode=schema_mode,
        commit_properties=CommitProperties(app_transactions=[Transaction(app_id, batch_id)]),
    )
    return True


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


def _conform(rows: pa.Table, schema: pa.Schema) -> pa.Table:
    """The table's columns, in its order and types (Spark's Arrow types can differ slightly)."""
    return pa.table([rows.column(f.name).cast(f.type) for f in schema], schema=schema)


def _distinct_partitions(rows: pa.Table, partition_by: Sequence[str]) -> list[dict[str, str]]:
    if not partition_by:
        return [{}]
    distinct = rows.select(list(partition_by)).group_by(list(partition_by)).aggregate([])
    out = []
    for rec in distinct.to_pylist():
        out.append({c: _partition_string(rec[c]) for c in partition_by})
    return out


def _partition_string(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)
