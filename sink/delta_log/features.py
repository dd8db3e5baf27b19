"""Which table features keep a table's updates on MERGE instead of the copy-on-write rewrite.

A commit takes what it is given and checks almost nothing: files written by hand would skip
what these features require of every writer (docs: "The copy-on-write commit and
delta-rs"), so such tables stay on delta-rs' MERGE, which honours them; except for what the
sink's own commits write (deletion vectors, the change data feed, physical names) and the
row checks the batch makes itself before writing (`row_checks`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection, Iterator

from deltalake import DeltaTable

from sink.delta_log.identity import IdentityColumn

ENABLE_DELETION_VECTORS = "delta.enableDeletionVectors"
ENABLE_CHANGE_DATA_FEED = "delta.enableChangeDataFeed"
COLUMN_MAPPING = "delta.columnMapping.mode"
APPEND_ONLY = "delta.appendOnly"
# Table property prefix -> why the rewrite cannot honour it.
_PROPERTIES = {
    ENABLE_DELETION_VECTORS: "deletion vectors (a rewrite's remove cannot carry the file's deletion vector)",
    COLUMN_MAPPING: "column mapping (files must use physical column names and ids)",
    ENABLE_CHANGE_DATA_FEED: "change data feed (a rewrite cannot write the change files)",
    "delta.constraints.": "CHECK constraints (a rewrite does not evaluate them)",
}
_CONSTRAINT = "delta.constraints."
_INVARIANTS = "delta.invariants"
_DOUBLE_QUOTED = re.compile(r'"([^"`]+)"')
# A table that supports deletion vectors may hold files that carry one, even with the property off.
_DELETION_VECTORS = "deletionVectors"
GENERATION_EXPRESSION = "delta.generationExpression"  # a generated column's field metadata: its SQL
_FIELD_METADATA = {
    _INVARIANTS: "column invariants (a rewrite does not enforce them)",
    GENERATION_EXPRESSION: "generated columns (a rewrite does not compute them)",
}
# Writer features delta-rs (1.6.6) does not write at all: it refuses the commit ("Unsupported
# table features required: [RowTracking, DomainMetadata]"), or the sink's checks misread the
# table (an identity column looks like a column the stream dropped).
_UNWRITABLE_FEATURES = {
    "rowTracking": "row tracking (delta-rs does not assign row ids)",
    "domainMetadata": "domain metadata (delta-rs does not write it; row tracking and liquid clustering use it)",
    "identityColumns": "identity columns (delta-rs does not generate their values)",
}
IDENTITY_COLUMNS = "identityColumns"
# The table features delta-rs (1.6.6) and the sink's own commits write as PROTOCOL.md asks of
# a writer; any other a table lists is refused before the first write (`unwritable_reason`),
# rather than failing its commit like a lost race.
_WRITTEN_FEATURES = frozenset({
    "appendOnly", "invariants", "checkConstraints", "changeDataFeed", "generatedColumns", "columnMapping",
    "deletionVectors", "timestampNtz", "v2Checkpoint", "vacuumProtocolCheck", "variantType",
})
_FEATURE_NAMES = {"inCommitTimestamp": "in-commit timestamps", "typeWidening": "type widening",
                  "typeWidening-preview": "type widening", "clustering": "liquid clustering",
                  "allowColumnDefaults": "column defaults", "icebergCompatV1": "Iceberg compatibility",
                  "icebergCompatV2": "Iceberg compatibility", "collations-preview": "collations"}
_OFF = ("false", "none", "")
_UNREADABLE = (_PROPERTIES[ENABLE_DELETION_VECTORS], _PROPERTIES[COLUMN_MAPPING])
# What the sink checks on every row it writes, before writing it (`row_checks`): honoured where it does.
ROW_CHECKS = (_CONSTRAINT, _INVARIANTS, GENERATION_EXPRESSION)


def merge_only_reason(table: DeltaTable, *, honoured: Collection[str] = ()) -> str | None:
    """Why this table's updates must go through MERGE, or None when a rewrite may commit them;
    `honoured`: the features (their table property or field metadata key: ENABLE_DELETION_VECTORS,
    ENABLE_CHANGE_DATA_FEED, ROW_CHECKS, COLUMN_MAPPING) the sink's commit honours, which then
    need no MERGE.

    Reads the snapshot's protocol, properties and field metadata (no I/O): what is in use, not
    what the protocol merely allows (legacy protocols, writer versions 2-6, list no features).
    """
    reasons = {**_PROPERTIES, **_FIELD_METADATA}
    skipped = {reasons[p] for p in honoured if p in reasons}
    return next((r for r in _reasons(table) if r not in skipped), None)


def supports_deletion_vectors(table: DeltaTable) -> bool:
    """Its files may carry deletion vectors (the feature is listed, whether or not new ones may
    be written)."""
    return _DELETION_VECTORS in (table.protocol().writer_features or ())


def change_data_feed(table: DeltaTable) -> bool:
    """Writers must write the changes of rows they replace or delete (PROTOCOL.md "Writer
    Requirements for AddCDCFile")."""
    return (table.metadata().configuration.get(ENABLE_CHANGE_DATA_FEED) or "").lower() == "true"


def writes_deletion_vectors(table: DeltaTable) -> bool:
    """Writers may mark rows deleted in deletion vectors: the feature is supported and on
    (PROTOCOL.md: new vectors only while `delta.enableDeletionVectors` is true)."""
    enabled = table.metadata().configuration.get(ENABLE_DELETION_VECTORS) or ""
    return supports_deletion_vectors(table) and enabled.lower() == "true"


def v2_checkpoints(table: DeltaTable) -> bool:
    """The table takes v2 checkpoints only (UUID-named, with sidecars), which delta-rs does not
    write and the sink's deletion-vector replay (sink.delta_log.live_vectors) does not read."""
    return "v2Checkpoint" in (table.protocol().writer_features or ())


def append_only(table: DeltaTable) -> bool:
    """The table takes inserts only: no commit may remove a file with `dataChange` (PROTOCOL.md
    "Append-only Tables")."""
    return (table.metadata().configuration.get(APPEND_ONLY) or "").lower() == "true"


def unreadable_reason(table: DeltaTable) -> str | None:
    """Why this table's data files cannot be read as plain Parquet files (a deletion vector
    hides rows, column mapping renames columns), or None when they can."""
    return next((r for r in _reasons(table) if r in _UNREADABLE), None)


def unwritable_reason(table: DeltaTable, *, honoured: Collection[str] = ()) -> str | None:
    """Why delta-rs cannot write this table at all (the features Delta's Spark engine keeps),
    or None when it can; `honoured`: those the caller writes itself (IDENTITY_COLUMNS: the
    sink's log commit generates identity values)."""
    features = table.protocol().writer_features or ()
    reason = next((r for f, r in _UNWRITABLE_FEATURES.items() if f in features and f not in honoured), None)
    # An identity column on a protocol without a feature list (writer version 6) names no feature.
    if reason is None and IDENTITY_COLUMNS not in honoured and identity_columns(table):
        reason = _UNWRITABLE_FEATURES[IDENTITY_COLUMNS]
    listed = [*(table.protocol().reader_features or ()), *features]
    unknown = next((f for f in listed if f not in _WRITTEN_FEATURES and f not in _UNWRITABLE_FEATURES), None)
    if reason is None and unknown is not None:
        reason = f"{_FEATURE_NAMES.get(unknown, 'a table feature')} (the {unknown} feature)"
    return reason


def check_constraints(table: DeltaTable) -> dict[str, str]:
    """The table's CHECK constraints: name -> Spark SQL expression (a row breaks one where it is
    false or null, as Delta checks them). delta-rs records a constraint in DataFusion's SQL,
    where `"userId"` names a column (Spark would read a string): a double-quoted name of one of
    the table's columns becomes a backquoted one."""
    columns = {f.name for f in table.schema().fields}

    def spark_sql(expression: str) -> str:
        return _DOUBLE_QUOTED.sub(lambda m: f"`{m[1]}`" if m[1] in columns else m[0], expression)

    return {key.removeprefix(_CONSTRAINT): spark_sql(value) for key, value in table.metadata().configuration.items()
            if key.startswith(_CONSTRAINT) and value}


def row_checks(table: DeltaTable) -> dict[str, str]:
    """What every row written to the table must meet, as Delta's writers check it: label (what
    a violation names: "CHECK constraint <name>", "invariant on column <c>", "generated column
    <c>") -> Spark SQL boolean, a row breaking it where it is false or null. A generated column's
    value must equal its expression, null for null (Delta checks `c <=> (expression)`)."""
    checks = {f"CHECK constraint {name}": expr for name, expr in check_constraints(table).items()}
    for f in table.schema().fields:
        metadata = f.metadata or {}
        if _INVARIANTS in metadata:
            invariant = json.loads(str(metadata[_INVARIANTS]))["expression"]["expression"]
            checks[f"invariant on column {f.name}"] = invariant
        if GENERATION_EXPRESSION in metadata:
            checks[f"generated column {f.name}"] = f"`{f.name}` <=> ({metadata[GENERATION_EXPRESSION]})"
    return checks


def mentions(expression: str, column: str) -> bool:
    """Whether the SQL `expression` may read `column` (as a word or backquoted, any case):
    erring towards yes, as a string literal holding the name counts too."""
    name = re.escape(column)
    return re.search(rf"`{name}`|(?<![\w`]){name}(?![\w`])", expression, re.IGNORECASE) is not None


def identity_columns(table: DeltaTable) -> list[str]:
    """The table's identity columns: their values are the engine's, never the stream's."""
    return [c.name for c in IdentityColumn.of(table)]


def _reasons(table: DeltaTable) -> Iterator[str]:
    if supports_deletion_vectors(table):
        yield _PROPERTIES[ENABLE_DELETION_VECTORS]
    for key, value in table.metadata().configuration.items():
        for prefix, reason in _PROPERTIES.items():
            if key.startswith(prefix) and (prefix.endswith(".") or (value or "").lower() not in _OFF):
                yield reason
    for f in table.schema().fields:
        for key in f.metadata or {}:
            if key in _FIELD_METADATA:
                yield _FIELD_METADATA[key]
