"""The sink's metadata commits: the protocol stays the owner's (no `protocol` action unless a
feature is needed and allowed), the metaData action keeps everything but what changed."""

import json

import pyarrow as pa
import pytest
from deltalake import DeltaTable, write_deltalake

from sink.delta_log import metadata_commit
from sink.errors import ConfigError
from tests.lakehouse.spark_sql_tables import SPARK_SCHEMA, spark_table


def actions(uri: str, version: int) -> dict[str, dict]:
    with open(f"{uri}/_delta_log/{version:020d}.json") as f:
        return {name: value for line in f for name, value in json.loads(line).items()}


DV = {"minReaderVersion": 3, "minWriterVersion": 7, "readerFeatures": ["deletionVectors"],
      "writerFeatures": ["deletionVectors"]}


def test_a_property_change_writes_the_metadata_alone(tmp_path):
    uri = spark_table(tmp_path / "t", DV, {"delta.enableDeletionVectors": "true"})
    metadata_commit.set_properties(DeltaTable(uri), uri, {"upsert_sink.key": '["id"]'})
    got = actions(uri, 1)
    assert sorted(got) == ["commitInfo", "metaData"]
    assert got["metaData"] == {**actions(uri, 0)["metaData"], "configuration": {
        "delta.enableDeletionVectors": "true", "upsert_sink.key": '["id"]'}}
    assert got["commitInfo"]["operation"] == "SET TBLPROPERTIES"
    table = DeltaTable(uri)
    assert (table.protocol().reader_features, table.protocol().writer_features) == (
        ["deletionVectors"], ["deletionVectors"])


def test_a_property_change_lost_to_another_writer_is_made_on_the_new_version(tmp_path):
    uri = spark_table(tmp_path / "t", {"minReaderVersion": 1, "minWriterVersion": 2}, {})
    stale = DeltaTable(uri)
    write_deltalake(uri, pa.table({"id": [1], "v": ["a"]}), mode="append")  # version 1, by another writer
    metadata_commit.set_properties(stale, uri, {"upsert_sink.scope": '"partitioned"'})
    assert sorted(actions(uri, 2)) == ["commitInfo", "metaData"]
    table = DeltaTable(uri)
    assert table.metadata().configuration == {"upsert_sink.scope": '"partitioned"'}
    assert table.to_pyarrow_table().to_pylist() == [{"id": 1, "v": "a"}]


def test_columns_added_under_column_mapping_get_ids_and_physical_names_nested_too(tmp_path):
    mapped = {"type": "struct", "fields": [
        {**f, "metadata": {"delta.columnMapping.id": i, "delta.columnMapping.physicalName": f"col-{f['name']}"}}
        for i, f in enumerate(SPARK_SCHEMA["fields"], 1)]}
    protocol = {"minReaderVersion": 2, "minWriterVersion": 5}
    uri = spark_table(tmp_path / "t", protocol, {"delta.columnMapping.mode": "name",
                                                 "delta.columnMapping.maxColumnId": "2"}, mapped)
    table = DeltaTable(uri)
    metadata_commit.add_columns(table, uri, [pa.field("w", pa.string()),
                                             pa.field("s", pa.struct([pa.field("a", pa.int32())]))],
                                allow_protocol_upgrade=False)
    got = actions(uri, 1)
    assert sorted(got) == ["commitInfo", "metaData"]
    fields = json.loads(got["metaData"]["schemaString"])["fields"]
    assert fields[:2] == mapped["fields"]
    ids = [(f["name"], f["metadata"]["delta.columnMapping.id"]) for f in [fields[2], fields[3],
                                                                         *fields[3]["type"]["fields"]]]
    assert ids == [("w", 3), ("s", 4), ("a", 5)]
    names = {f["metadata"]["delta.columnMapping.physicalName"] for f in [fields[2], fields[3]]}
    assert len(names) == 2 and all(n.startswith("col-") for n in names)
    assert got["metaData"]["configuration"]["delta.columnMapping.maxColumnId"] == "5"


def test_a_timestamp_ntz_column_needs_the_owners_leave_for_its_feature(tmp_path):
    uri = spark_table(tmp_path / "t", {"minReaderVersion": 1, "minWriterVersion": 2}, {})
    column = [pa.field("seen", pa.timestamp("us"))]
    with pytest.raises(ConfigError, match=r"adds column\(s\) \['seen'\] of type TIMESTAMP_NTZ .* lacks the "
                                          r"timestampNtz feature: set allow_protocol_upgrade = true"):
        metadata_commit.add_columns(DeltaTable(uri), uri, column, allow_protocol_upgrade=False)
    assert DeltaTable(uri).version() == 0
    metadata_commit.add_columns(DeltaTable(uri), uri, column, allow_protocol_upgrade=True)
    assert actions(uri, 1)["protocol"] == {
        "minReaderVersion": 3, "minWriterVersion": 7, "readerFeatures": ["timestampNtz"],
        "writerFeatures": ["appendOnly", "invariants", "timestampNtz"]}


def test_deletion_vectors_turned_on_list_the_legacy_features_as_spark_does(tmp_path):
    uri = spark_table(tmp_path / "t", {"minReaderVersion": 1, "minWriterVersion": 4}, {"a": "b"})
    metadata_commit.enable_deletion_vectors(DeltaTable(uri), uri)
    got = actions(uri, 1)
    assert got["protocol"] == {"minReaderVersion": 3, "minWriterVersion": 7, "readerFeatures": ["deletionVectors"],
                               "writerFeatures": ["appendOnly", "invariants", "checkConstraints", "changeDataFeed",
                                                  "generatedColumns", "deletionVectors"]}
    assert got["metaData"]["configuration"] == {"a": "b", "delta.enableDeletionVectors": "true"}


@pytest.mark.parametrize(("schema", "configuration", "protocol"), [
    (pa.schema([("id", pa.int64())]), {}, {"minReaderVersion": 1, "minWriterVersion": 2}),
    (pa.schema([("id", pa.int64())]), {"delta.enableDeletionVectors": "true"}, DV),
    (pa.schema([("id", pa.int64()), ("at", pa.list_(pa.timestamp("us")))]), {},
     {"minReaderVersion": 3, "minWriterVersion": 7, "readerFeatures": ["timestampNtz"],
      "writerFeatures": ["timestampNtz"]}),
], ids=["plain", "deletion vectors", "timestamp_ntz"])
def test_a_table_the_sink_creates_gets_the_least_protocol_it_needs(tmp_path, schema, configuration, protocol):
    uri = str(tmp_path / "t")
    metadata_commit.create(uri, schema, [], configuration)
    assert actions(uri, 0)["protocol"] == protocol
    metadata_commit.create(uri, schema, [], {"other": "creator"})  # created first by another: left as it is
    table = DeltaTable(uri)
    assert (table.version(), table.metadata().configuration) == (0, configuration)
    write_deltalake(table, pa.Table.from_pylist([], schema), mode="append")
    assert DeltaTable(uri).schema().to_arrow().names == schema.names


def test_a_stored_struct_is_widened_in_its_place_by_the_nested_fields_it_lacks(tmp_path):
    runs = {"name": "runs", "type": {"type": "array", "containsNull": True, "elementType": {
        "type": "struct", "fields": [{"name": "a", "type": "long", "nullable": True, "metadata": {
            "delta.columnMapping.id": 2, "delta.columnMapping.physicalName": "col-a"}}]}},
        "nullable": True, "metadata": {"delta.columnMapping.id": 1, "delta.columnMapping.physicalName": "col-runs"}}
    schema = {"type": "struct", "fields": [runs]}
    uri = spark_table(tmp_path / "t", {"minReaderVersion": 2, "minWriterVersion": 5},
                      {"delta.columnMapping.mode": "id", "delta.columnMapping.maxColumnId": "2"}, schema)
    wider = pa.field("runs", pa.list_(pa.struct([("a", pa.int64()), ("b", pa.string())])))
    metadata_commit.add_columns(DeltaTable(uri), uri, [wider], allow_protocol_upgrade=False)
    (got,) = json.loads(actions(uri, 1)["metaData"]["schemaString"])["fields"]
    a, b = got["type"]["elementType"]["fields"]
    assert (got["metadata"], a) == (runs["metadata"], runs["type"]["elementType"]["fields"][0])
    assert (b["name"], b["type"], b["metadata"]["delta.columnMapping.id"]) == ("b", "string", 3)
    assert actions(uri, 1)["metaData"]["configuration"]["delta.columnMapping.maxColumnId"] == "3"
