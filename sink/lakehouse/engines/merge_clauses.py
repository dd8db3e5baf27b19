"""A MERGE's clauses, engine-independent: delta-rs runs them through its TableMerger
(sink.lakehouse.engines.merge), delta-spark as `MERGE INTO` SQL (sink.lakehouse.engines.delta_spark). Target
alias `t`, source alias `s`; the first matching WHEN MATCHED clause applies."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc

from sink.delta_log.predicates import merge_predicate, quote_ident
from sink.history import START_AT
from sink.lakehouse.commit.unchanged import UNCHANGED, has_unchanged, is_text
from sink.lakehouse.commit.versions import ACTION_COLUMN, HistoryMerge
from sink.lakehouse.commit.writes import PARTIAL_COLUMN, WRITE_COLUMN, Writes
from sink.ordering import newer_sql


@dataclass(frozen=True)
class MergeClauses:
    on: str
    delete: str  # WHEN MATCHED AND <delete> THEN DELETE
    updates: tuple[tuple[Mapping[str, str], str], ...]  # WHEN MATCHED AND <condition> THEN UPDATE SET <values>
    insert: tuple[Mapping[str, str], str]  # WHEN NOT MATCHED AND <condition> THEN INSERT <values>

    def sql(self, target: str, source: str) -> str:
        """`MERGE INTO` text (Spark SQL) of these clauses, `target` and `source` as named in SQL."""
        def assigned(values: Mapping[str, str]) -> str:
            return ", ".join(f"t.{c} = {v}" for c, v in values.items())
        values, condition = self.insert
        return "\n".join([
            f"MERGE INTO {target} AS t USING {source} AS s ON {self.on}",
            f"WHEN MATCHED AND {self.delete} THEN DELETE",
            *(f"WHEN MATCHED AND {c} THEN UPDATE SET {assigned(v)}" for v, c in self.updates),
            f"WHEN NOT MATCHED AND {condition} THEN INSERT ({', '.join(values)}) VALUES ({', '.join(values.values())})",
        ])


def upsert_source(writes: Writes) -> pa.Table:
    """The MERGE's source: the rows as the table stores them, their write, and whether partial."""
    rows = writes.rows
    source = writes.table_rows().append_column(WRITE_COLUMN, rows.column(WRITE_COLUMN))
    if writes.partial:
        source = source.append_column(PARTIAL_COLUMN, pc.fill_null(rows.column(PARTIAL_COLUMN), False))
    return source


@dataclass(frozen=True)
class UpsertSpec:
    """What an upsert MERGE is built from: the table's columns (with the batch's new ones),
    those the MERGE writes (not an identity column: its values are the engine's), the
    key, ordering and partition columns, the tie rule, whether updates are partial
    (the source then has PARTIAL_COLUMN), and whether string values may be UNCHANGED (the
    stored value stays: unchanged_value)."""

    schema: pa.Schema
    columns: Sequence[str]
    key_cols: Sequence[str]
    ordering: Sequence[str]
    partition_by: Sequence[str]
    incoming_wins_ties: bool
    partial: bool
    unchanged: bool = False

    @classmethod
    def of(cls, writes: Writes, columns: Sequence[str]) -> UpsertSpec:
        return cls(writes.schema, columns, writes.key_cols, writes.ordering, writes.partition_by,
                   writes.incoming_wins_ties, writes.partial, has_unchanged(writes.rows))


def upsert_clauses(spec: UpsertSpec, partitions: Sequence[Mapping[str, str]]) -> MergeClauses:
    """The batch's MERGE, matched on key and partition and pruned to `partitions` (those
    holding updated or deleted keys). Updates that change nothing match no clause: no file
    is rewritten for them."""
    types = {f.name: f.type for f in spec.schema}
    values = {quote_ident(c): f"s.{quote_ident(c)}" for c in spec.columns}
    updated = values
    if spec.unchanged:  # only a matched row can keep its value: inserts never hold UNCHANGED
        text = {quote_ident(f.name) for f in spec.schema if is_text(f)}
        updated = {c: f"CASE WHEN {v} = '{UNCHANGED}' THEN t.{c} ELSE {v} END" if c in text else v
                   for c, v in values.items()}
    w = f"s.{quote_ident(WRITE_COLUMN)}"
    # Guard on ordering too: the index already decided, this keeps a stale
    # replica from ever overwriting a newer row.
    newer = newer_sql(list(spec.ordering), quote_ident, spec.incoming_wins_ties)
    updates = []
    whole = f"{w} <> 'delete'"
    if spec.partial:  # partial updates keep stored values
        kept = {c: f"coalesce({v}, t.{c})" for c, v in updated.items()}
        partial = f"s.{quote_ident(PARTIAL_COLUMN)}"
        updates.append((kept, f"{w} <> 'delete' AND {partial} AND {newer} AND {_differs(kept)}"))
        whole = f"{w} <> 'delete' AND NOT {partial}"
    updates.append((updated, f"{whole} AND {newer} AND {_differs(updated)}"))
    return MergeClauses(on=merge_predicate(spec.key_cols, spec.partition_by, partitions, types),
                        delete=f"{w} = 'delete' AND {newer}", updates=tuple(updates),
                        insert=(values, f"{w} <> 'delete'"))


def history_clauses(merge: HistoryMerge, key_cols: Sequence[str], partition_by: Sequence[str],
                    schema: pa.Schema, columns: Sequence[str]) -> MergeClauses:
    """A history table's MERGE (sink.lakehouse.commit.versions.merge_rows): versions match on key,
    partition and START_AT; "drop" rows delete, "keep" rows update or insert."""
    types = {f.name: f.type for f in schema}
    start = quote_ident(START_AT)
    values = {quote_ident(c): f"s.{quote_ident(c)}" for c in columns}
    action = f"s.{quote_ident(ACTION_COLUMN)}"
    return MergeClauses(
        on=f"{merge_predicate(key_cols, partition_by, merge.partitions, types)} AND t.{start} = s.{start}",
        delete=f"{action} = 'drop'", updates=((values, f"{action} = 'keep'"),), insert=(values, f"{action} = 'keep'"))


def updates_in(rows: pa.Table) -> int:
    """The updates among `rows` (by their WRITE_COLUMN)."""
    return pc.sum(pc.cast(pc.equal(rows.column(WRITE_COLUMN), "update"), "int64")).as_py() or 0


def _differs(values: Mapping[str, str]) -> str:
    """SQL: the row the update would write differs from the stored one in some column."""
    return "NOT (" + " AND ".join(f"(t.{c} IS NOT DISTINCT FROM {v})" for c, v in values.items()) + ")"
