"""The sink's changes to a table's metadata, committed by its own log writer (log_commit):
recording its contract's properties, adding a batch's new columns, creating a table, turning
deletion vectors on.

Not through delta-rs' `alter` and `create`: on a table with table features those write a
`protocol` action listing every feature delta-rs knows (`variantType` among them, delta-rs
1.6.6) on each change, which every reader without that feature must then refuse. Here a
metadata change is the `metaData` action alone, the protocol the owner's; the protocol changes
only where a change needs a feature the table lacks and the owner allowed it
(`allow_protocol_upgrade`): deletion vectors for merge-on-read, `timestampNtz` for a
TIMESTAMP_NTZ column. A table the sink creates gets the least protocol its schema and
properties need, as Spark's CREATE TABLE does.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import pyarrow as pa
from deltalake import CommitProperties, DeltaTable, Schema
from deltalake.exceptions import CommitFailedError

from sink.delta_log import log_commit, log_store
from sink.delta_log.features import COLUMN_MAPPING, ENABLE_DELETION_VECTORS
from sink.errors import ConfigError

DELETION_VECTORS = "deletionVectors"
TIMESTAMP_NTZ = "timestampNtz"
_MAX_COLUMN_ID = "delta.columnMapping.maxColumnId"
_ID = "delta.columnMapping.id"
_PHYSICAL_NAME = "delta.columnMapping.physicalName"
# The features a legacy protocol's versions imply (PROTOCOL.md "Table Features"), listed when
# it is upgraded to table features, as Spark lists them.
_LEGACY_WRITER = {2: ("appendOnly", "invariants"), 3: ("checkConstraints",),
                  4: ("changeDataFeed", "generatedColumns"), 5: ("columnMapping",), 6: ("identityColumns",)}
_LEGACY_READER = {2: ("columnMapping",)}
_RETRIES = 3  # a property change lost to another writer's commit is made again on the new version


def create(uri: str, schema: pa.Schema, partition_by: Sequence[str], configuration: Mapping[str, str]) -> None:
    """Version 0 of a new table, with the least protocol it needs; nothing when another writer
    created the table first (its version 0 exists)."""
    fields = json.loads(Schema.from_arrow(schema).to_json())
    features = [*([DELETION_VECTORS] if configuration.get(ENABLE_DELETION_VECTORS) == "true" else []),
                *([TIMESTAMP_NTZ] if _has_timestamp_ntz({"type": "struct", **fields}) else [])]
    protocol = ({"minReaderVersion": 3, "minWriterVersion": 7, "readerFeatures": features,
                 "writerFeatures": features} if features else {"minReaderVersion": 1, "minWriterVersion": 2})
    now = int(time.time() * 1000)
    metadata = {"id": str(uuid.uuid4()), "format": {"provider": "parquet", "options": {}},
                "schemaString": json.dumps(fields, separators=(",", ":")), "partitionColumns": list(partition_by),
                "configuration": dict(configuration), "createdTime": now}
    info = {"timestamp": now, "operation": "CREATE TABLE", "operationParameters": {
        "partitionBy": json.dumps(list(partition_by)), "properties": json.dumps(dict(configuration))},
        "isBlindAppend": True, "engineInfo": log_commit.ENGINE_INFO}
    lines = [{"commitInfo": info}, {"protocol": protocol}, {"metaData": metadata}]
    log_store.claim(uri, 0, _ndjson(lines), new=True)  # not claimed: another writer created the table first


def set_properties(table: DeltaTable, uri: str, properties: Mapping[str, str]) -> None:
    """The table's properties with `properties` set: a `metaData` action alone, made again on
    the new version when another writer committed first."""
    _retried(table, lambda: log_commit.commit(
        table, uri, [{"metaData": _metadata(table, configuration=properties)}], CommitProperties(),
        operation="SET TBLPROPERTIES", parameters={"properties": json.dumps(dict(properties))}, metrics={}))


def add_columns(table: DeltaTable, uri: str, columns: Sequence[pa.Field], *, allow_protocol_upgrade: bool) -> None:
    """`columns` added to the table's schema, nullable, in the version after the one `table`
    has loaded (CommitFailedError when another writer took it): a new one at the end, one the
    table has widened in its place by the nested fields it lacks (a history table's run
    events). Under column mapping each new field, nested ones too, gets its id and physical
    name, as Spark's ADD COLUMNS gives them. A TIMESTAMP_NTZ column on a table without
    `timestampNtz` needs `allow_protocol_upgrade`."""
    fields = json.loads(Schema.from_arrow(pa.schema(columns)).to_json())["fields"]
    schema = json.loads(table.schema().to_json())
    configuration = table.metadata().configuration
    ids = _ColumnIds(int(configuration.get(_MAX_COLUMN_ID) or 0),
                     mapped=configuration.get(COLUMN_MAPPING, "none") != "none")
    present = {f["name"]: f for f in schema["fields"]}
    for field in fields:
        if field["name"] in present:
            present[field["name"]]["type"] = _widened(present[field["name"]]["type"], field["type"], ids)
        else:
            ids.assign([field])
            schema["fields"].append(field)
    changed = {_MAX_COLUMN_ID: str(ids.top)} if ids.mapped else {}
    actions = [{"metaData": _metadata(table, configuration=changed, schema=schema)}]
    named = [f["name"] for f in fields if _has_timestamp_ntz(f["type"])]
    if named and TIMESTAMP_NTZ not in (table.protocol().writer_features or ()):
        if not allow_protocol_upgrade:
            raise ConfigError(
                f"the stream adds column(s) {named} of type TIMESTAMP_NTZ to table {uri}, whose protocol lacks the "
                "timestampNtz feature: set allow_protocol_upgrade = true for the sink to add it (readers without the "
                "feature then cannot read the table), or cast the column to TIMESTAMP in the stream's select; "
                "nothing was written")
        actions.insert(0, {"protocol": upgraded(table, TIMESTAMP_NTZ)})
    log_commit.commit(table, uri, actions, CommitProperties(), operation="ADD COLUMNS",
                      parameters={"columns": json.dumps([{"column": f} for f in fields])}, metrics={})


def enable_deletion_vectors(table: DeltaTable, uri: str) -> None:
    """`delta.enableDeletionVectors = true`, the protocol upgraded with the feature (the owner
    allowed it: `allow_protocol_upgrade`)."""
    properties = {ENABLE_DELETION_VECTORS: "true"}
    _retried(table, lambda: log_commit.commit(
        table, uri, [{"protocol": upgraded(table, DELETION_VECTORS)},
                     {"metaData": _metadata(table, configuration=properties)}], CommitProperties(),
        operation="SET TBLPROPERTIES", parameters={"properties": json.dumps(properties)}, metrics={}))


def upgraded(table: DeltaTable, feature: str) -> dict[str, Any]:
    """The table's protocol with the reader and writer feature `feature` (a legacy protocol's
    implied features listed, as Spark lists them on such an upgrade)."""
    protocol = table.protocol()
    readers = list(protocol.reader_features or ()) if protocol.min_reader_version >= 3 else \
        [f for v, names in _LEGACY_READER.items() if protocol.min_reader_version >= v for f in names]
    writers = list(protocol.writer_features or ()) if protocol.min_writer_version >= 7 else \
        [f for v, names in _LEGACY_WRITER.items() if protocol.min_writer_version >= v for f in names]
    return {"minReaderVersion": 3, "minWriterVersion": 7,
            "readerFeatures": readers + [feature] * (feature not in readers),
            "writerFeatures": writers + [feature] * (feature not in writers)}


def _metadata(table: DeltaTable, *, configuration: Mapping[str, str] = {},
              schema: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The table's `metaData` action as loaded, its properties updated by `configuration`, its
    schema `schema` (its JSON) where given."""
    current = table.metadata()
    schema = schema if schema is not None else json.loads(table.schema().to_json())
    action = {"id": current.id, "format": {"provider": "parquet", "options": {}},
              "schemaString": json.dumps(schema, separators=(",", ":")),
              "partitionColumns": list(current.partition_columns),
              "configuration": {**current.configuration, **configuration}, "createdTime": current.created_time}
    action |= {k: v for k, v in (("name", current.name), ("description", current.description)) if v is not None}
    return action


class _ColumnIds:
    """Column mapping's ids and physical names for new fields (none without column mapping);
    `top`: the last id given."""

    def __init__(self, top: int, *, mapped: bool):
        self.top, self.mapped = top, mapped

    def assign(self, fields: list[dict]) -> None:
        """Each field, nested ones too, with the next id and a physical name."""
        for field in fields if self.mapped else ():
            self.top += 1
            field["metadata"] = {**field.get("metadata", {}), _ID: self.top, _PHYSICAL_NAME: f"col-{uuid.uuid4()}"}
            self.assign(_nested_fields(field["type"]))


def _widened(old: Any, new: Any, ids: _ColumnIds) -> Any:
    """A stored field's type (schema JSON) with the nested fields `new` has and it lacks, at
    the end of their struct; the rest as stored."""
    if not (isinstance(old, dict) and isinstance(new, dict) and old.get("type") == new.get("type")):
        return old
    if old["type"] == "struct":
        by_name = {f["name"]: f for f in new["fields"]}
        kept = [{**f, "type": _widened(f["type"], by_name[f["name"]]["type"], ids)} if f["name"] in by_name else f
                for f in old["fields"]]
        added = [f for f in new["fields"] if f["name"] not in {k["name"] for k in old["fields"]}]
        ids.assign(added)
        return {**old, "fields": kept + added}
    inner = [k for k in ("elementType", "keyType", "valueType") if k in old and k in new]
    return {**old, **{k: _widened(old[k], new[k], ids) for k in inner}}


def _nested_fields(data_type: Any) -> list[dict]:
    if not isinstance(data_type, dict):
        return []
    if data_type.get("type") == "struct":
        return data_type["fields"]
    inner = [data_type.get(k) for k in ("elementType", "keyType", "valueType")]
    return [f for t in inner for f in _nested_fields(t)]


def _has_timestamp_ntz(data_type: Any) -> bool:
    """Whether a Delta type (its schema JSON) is or holds TIMESTAMP_NTZ."""
    if not isinstance(data_type, dict):
        return data_type == "timestamp_ntz"
    if data_type.get("type") == "struct":
        return any(_has_timestamp_ntz(f["type"]) for f in data_type["fields"])
    return any(_has_timestamp_ntz(data_type.get(k)) for k in ("elementType", "keyType", "valueType"))


def _retried(table: DeltaTable, commit: Callable[[], int]) -> None:
    for attempt in range(_RETRIES):
        try:
            commit()
            return
        except CommitFailedError:
            if attempt == _RETRIES - 1:
                raise
            table.update_incremental()


def _ndjson(lines: list[dict]) -> bytes:
    return "".join(json.dumps(line, separators=(",", ":")) + "\n" for line in lines).encode()
