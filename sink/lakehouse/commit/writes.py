"""One batch's writes as every commit path (append, merge, rewrite) takes them."""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property

import pyarrow as pa
import pyarrow.compute as pc
from deltalake import CommitProperties, Transaction

from sink import keys
from sink.delta_log.column_mapping import ColumnMapping
from sink.delta_log.file_layout import DEFAULT_LAYOUT, FileLayout
from sink.delta_log.identity import IdentityValues
from sink.delta_log.reading import USER_METADATA, commit_record
from sink.lakehouse.commit.unchanged import has_unchanged

WRITE_COLUMN = "__sink_write"
# ignore_null_updates: on an update, whether its null columns keep the stored values.
PARTIAL_COLUMN = "__sink_partial"
INSERT, UPDATE, DELETE = "insert", "update", "delete"
# The share of a file's rows marked deleted from which merge-on-read rewrites the file instead
# (the option `rewrite_marked_share`; sink.lakehouse.commit.merge_on_read.rewrites).
REWRITE_MARKED_SHARE = 0.5


@dataclass(frozen=True)
class Writes:
    """`rows`: one per key and partition, the table's columns in `schema` (its types and order,
    new columns included) plus WRITE_COLUMN (insert/update/delete) and, for partial updates,
    PARTIAL_COLUMN. Committed with `props` (the app transaction; no retries; None in the Spark
    tasks that write a batch's files, whose driver commits them). `merge_on_read`: replaced
    and deleted rows are marked in deletion vectors, not rewritten, but in a file where at
    least `rewrite_marked_share` of the rows would be marked (then rewritten); `change_data`: the table
    has a change data feed, whose files the rewrite writes (sink.lakehouse.commit.change_data);
    `column_mapping`: the table's, under which its files are read and written; `identity`: the
    values for the table's identity columns in new rows (updated rows keep the stored ones)."""

    rows: pa.Table
    schema: pa.Schema
    key_cols: list[str]
    ordering: list[str]
    partition_by: list[str]
    incoming_wins_ties: bool
    props: CommitProperties | None
    merge_on_read: bool = False
    change_data: bool = False
    column_mapping: ColumnMapping | None = None
    identity: IdentityValues | None = None
    layout: FileLayout = DEFAULT_LAYOUT  # what the table's properties ask of new files
    rewrite_marked_share: float = REWRITE_MARKED_SHARE

    @property
    def partial(self) -> bool:
        return PARTIAL_COLUMN in self.rows.column_names

    @cached_property
    def holds_unchanged(self) -> bool:
        """Some value of the batch is the UNCHANGED marker (unchanged_value; most batches hold
        none): checked once, not per file."""
        return has_unchanged(self.rows)

    def table_rows(self) -> pa.Table:
        """The rows as the table stores them (no write columns)."""
        return conform(self.rows, self.schema)

    def partition_ids(self) -> pa.Array:
        return keys.partition_ids(self.rows, self.partition_by)


def changing(rows: pa.Table) -> pa.Array:
    """Per row of `rows` (with WRITE_COLUMN): an update or a delete."""
    return pc.is_in(rows.column(WRITE_COLUMN), pa.array([UPDATE, DELETE]))


def conform(rows: pa.Table, schema: pa.Schema) -> pa.Table:
    """The table's columns, in its order and types (Spark's Arrow types can differ slightly;
    a column `rows` lacks, e.g. one added since its file was written, reads as nulls)."""
    return pa.table([rows.column(f.name).cast(f.type) if f.name in rows.column_names
                     else pa.nulls(rows.num_rows, f.type) for f in schema], schema=schema)


def distinct_partitions(rows: pa.Table, partition_by: Sequence[str]) -> list[dict[str, str]]:
    """The partitions `rows` fall in, as Delta partition strings ('' for null, as
    `predicates.partition_predicate` takes it)."""
    if not partition_by:
        return [{}]
    distinct = rows.select(list(partition_by)).group_by(list(partition_by)).aggregate([])
    return [{c: partition_string(rec[c]) or "" for c in partition_by} for rec in distinct.to_pylist()]


def partition_string(value) -> str | None:
    """A partition value as Delta's log writes it (null stays null)."""
    if value is None:
        return None
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def commit_properties(app_id: str, batch_id: int, custom_metadata: Mapping[str, str], mode: str) -> CommitProperties:
    """No retries: the commit lands on the version after the loaded one, the one its tags were
    checked against, or fails (the caller checks what landed and decides). The commit's kind
    is in its metadata: a rewrite's operation reads WRITE, as an append's. The metadata is in
    the commit info and, as Spark commits carry it, as JSON in its userMetadata."""
    recorded = commit_record(app_id, batch_id, custom_metadata, mode)
    # txnId: the commit attempt's id, as Spark's commit info carries it (delta-rs' has none).
    metadata = {**recorded, USER_METADATA: json.dumps(recorded), "txnId": str(uuid.uuid4())}
    return CommitProperties(app_transactions=[Transaction(app_id, batch_id)], custom_metadata=metadata,
                            max_commit_retries=0)
