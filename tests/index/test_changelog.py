import dataclasses
import json
import os

import pyarrow as pa
import pyarrow.parquet as pq

from sink.index import changelog
from sink.index.entry import CHANGES_SCHEMA

HEADER = changelog.Header("table-id", "writer", 7, 4, "spec")


def entries(rows):
    return pa.Table.from_pylist([dict(zip(CHANGES_SCHEMA.names, r)) for r in rows], schema=CHANGES_SCHEMA)


ROWS = {2: [("dt=a", b"k1", 5, False, 0), ("dt=b", b"k3", 7, False, 0)], 0: [("dt=a", b"k2", 6, True, 1_700_000_000)]}


def test_each_shard_reads_back_its_own_entries(tmp_path):
    uri = str(tmp_path / "changelog")
    for shard, rows in ROWS.items():
        changelog.write(uri, 12, HEADER, shard, entries(rows))
    for shard in (0, 2):
        got = changelog.read(uri, 12, HEADER, shard)
        assert got.schema == CHANGES_SCHEMA
        assert got.to_pylist() == [{"pid": p, "key": k, "ordering": o, "deleted": d, "deleted_at": at}
                                   for p, k, o, d, at in ROWS[shard]]
    assert changelog.read(uri, 12, HEADER, 1) is None  # a shard without records wrote nothing
    folder = tmp_path / "changelog" / changelog.folder_name(12, HEADER)
    assert sorted(os.listdir(folder)) == [changelog.file_name(0), changelog.file_name(2)]  # no temporary file left


def test_a_rerun_task_replaces_its_file_with_the_same_entries(tmp_path):
    uri = str(tmp_path / "changelog")
    changelog.write(uri, 12, HEADER, 2, entries(ROWS[2]))
    changelog.write(uri, 12, HEADER, 2, entries(ROWS[2]))
    assert changelog.read(uri, 12, HEADER, 2).num_rows == 2


def test_another_table_writer_batch_sharding_or_read_version_reads_as_unknown(tmp_path):
    uri = str(tmp_path / "changelog")
    changelog.write(uri, 12, HEADER, 2, entries(ROWS[2]))
    others = [dataclasses.replace(HEADER, **change) for change in (
        {"table_id": "a re-created table"}, {"writer_id": "other"}, {"batch_id": 8}, {"num_shards": 8},
        {"spec": "other spec"})]
    for other in others:
        assert changelog.read(uri, 12, other, 2) is None
    assert changelog.read(uri, 13, HEADER, 2) is None
    assert changelog.read(str(tmp_path / "nowhere"), 12, HEADER, 2) is None


def test_two_writers_batches_of_one_id_and_read_version_keep_apart(tmp_path):
    uri = str(tmp_path / "changelog")
    other = dataclasses.replace(HEADER, writer_id="other")
    changelog.write(uri, 12, HEADER, 2, entries(ROWS[2]))
    changelog.write(uri, 12, other, 2, entries(ROWS[0]))
    assert changelog.read(uri, 12, HEADER, 2).num_rows == 2
    assert changelog.read(uri, 12, other, 2).num_rows == 1


def test_a_shard_without_changes_reads_as_empty_not_unknown(tmp_path):
    uri = str(tmp_path / "changelog")
    changelog.write(uri, 3, HEADER, 1, entries([]))
    assert changelog.read(uri, 3, HEADER, 1).num_rows == 0


def test_expire_deletes_the_batches_that_read_below_the_window_and_old_layout_files(tmp_path):
    uri = str(tmp_path / "changelog")
    for version in (1, 5, 9, 10):
        changelog.write(uri, version, HEADER, 0, entries(ROWS[0]))
    (tmp_path / "changelog" / f"{4:020d}.parquet").write_bytes(b"one file per version, as sinks wrote before")
    assert changelog.expire(uri, 9) == 3
    assert sorted(os.listdir(tmp_path / "changelog")) == [changelog.folder_name(9, HEADER),
                                                          changelog.folder_name(10, HEADER)]
    assert changelog.expire(str(tmp_path / "nowhere"), 9) == 0


def test_a_file_of_an_older_layout_reads_as_unknown(tmp_path):
    uri = str(tmp_path / "changelog")
    folder = tmp_path / "changelog" / changelog.folder_name(12, HEADER)
    folder.mkdir(parents=True)
    older = entries(ROWS[2]).drop_columns(["deleted_at"])
    header = {b"upsert_sink.changelog": json.dumps(dataclasses.asdict(HEADER)).encode()}
    pq.write_table(older.replace_schema_metadata(header), folder / changelog.file_name(2))
    assert changelog.read(uri, 12, HEADER, 2) is None
