import dataclasses
import json
import os

import pyarrow as pa
import pyarrow.parquet as pq

from sink.index import changelog
from sink.index.entry import CHANGES_SCHEMA

HEADER = changelog.Header("table-id", "writer", 7, 4, "spec")


def entries(rows):
    return pa.Table.from_pylist([dict(zip(changelog.schema().names, r)) for r in rows], schema=changelog.schema())


ROWS = [(2, "dt=a", b"k1", 5, False, 0), (0, "dt=a", b"k2", 6, True, 1_700_000_000), (2, "dt=b", b"k3", 7, False, 0),
        (3, "dt=b", b"k4", 8, False, 0)]


def test_each_shard_reads_back_its_own_entries_from_its_own_row_group(tmp_path):
    uri = str(tmp_path / "changelog")
    changelog.write(uri, 12, HEADER, entries(ROWS))
    for shard in range(4):
        got = changelog.read(uri, 12, HEADER, shard)
        assert got.schema == CHANGES_SCHEMA
        assert got.to_pylist() == [{"pid": p, "key": k, "ordering": o, "deleted": d, "deleted_at": at}
                                   for s, p, k, o, d, at in ROWS if s == shard]
    parquet = pq.ParquetFile(tmp_path / "changelog" / changelog.file_name(12))
    groups = [parquet.metadata.row_group(i).column(0).statistics for i in range(parquet.num_row_groups)]
    assert [(g.min, g.max) for g in groups] == [(0, 0), (2, 2), (3, 3)]
    assert os.listdir(tmp_path / "changelog") == [changelog.file_name(12)]  # no temporary file left


def test_another_table_writer_batch_or_sharding_or_a_missing_file_reads_as_unknown(tmp_path):
    uri = str(tmp_path / "changelog")
    changelog.write(uri, 12, HEADER, entries(ROWS))
    others = [dataclasses.replace(HEADER, **change) for change in (
        {"table_id": "a re-created table"}, {"writer_id": "other"}, {"batch_id": 8}, {"num_shards": 8},
        {"spec": "other spec"})]
    for other in others:
        assert changelog.read(uri, 12, other, 2) is None
    assert changelog.read(uri, 13, HEADER, 2) is None
    assert changelog.read(str(tmp_path / "nowhere"), 12, HEADER, 2) is None


def test_a_batch_without_changes_reads_as_empty_not_unknown(tmp_path):
    uri = str(tmp_path / "changelog")
    changelog.write(uri, 3, HEADER, entries([]))
    assert changelog.read(uri, 3, HEADER, 1).num_rows == 0


def test_expire_deletes_the_versions_below_the_window(tmp_path):
    uri = str(tmp_path / "changelog")
    for version in (1, 5, 9, 10):
        changelog.write(uri, version, HEADER, entries(ROWS[:1]))
    assert changelog.expire(uri, 9) == 2
    assert sorted(os.listdir(tmp_path / "changelog")) == [changelog.file_name(9), changelog.file_name(10)]
    assert changelog.expire(str(tmp_path / "nowhere"), 9) == 0


def test_a_file_of_an_older_layout_reads_as_unknown(tmp_path):
    uri = tmp_path / "changelog"
    uri.mkdir()
    older = entries(ROWS).drop_columns(["deleted_at"])
    header = {b"upsert_sink.changelog": json.dumps(dataclasses.asdict(HEADER)).encode()}
    pq.write_table(older.replace_schema_metadata(header), uri / changelog.file_name(12))
    assert changelog.read(str(uri), 12, HEADER, 0) is None
