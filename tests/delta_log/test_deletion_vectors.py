"""The deletion-vector format, against the protocol's bytes and against what Spark writes."""

import uuid
from pathlib import Path

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest
from deltalake import DeltaTable
from pyroaring import BitMap64

from sink.delta_log import deletion_vectors as dv
from sink.delta_log.live_vectors import LiveDeletionVectors
from sink.errors import DeletionVectorError

# delta-io/delta's spark/src/test/resources/delta/table-with-dv-small: a file written by Spark
# holding one vector (rows 0 and 9), and its descriptor in the table's log.
SPARK_FILE = bytes.fromhex("01" "00000024" "d1d33964" "0100000000000000" "00000000" "3a300000" "01000000"
                           "00000100" "10000000" "0000" "0900" "2a671846")
SPARK_DESCRIPTOR = {"storageType": "u", "pathOrInlineDv": "WYbkwCTB$gH)J7t?$/sK", "offset": 1, "sizeInBytes": 36,
                    "cardinality": 2}
SPARK_FILE_ID = uuid.UUID("b6a98cdd-7843-470d-8897-708cdffa38c5")
LOCAL = pafs.LocalFileSystem()


def test_z85_spells_a_file_id_as_spark_does_and_reads_it_back():
    assert dv.z85_encode(SPARK_FILE_ID.bytes) == SPARK_DESCRIPTOR["pathOrInlineDv"]
    assert uuid.UUID(bytes=dv.z85_decode(SPARK_DESCRIPTOR["pathOrInlineDv"])) == SPARK_FILE_ID


def test_z85_refuses_what_is_not_z85():
    with pytest.raises(DeletionVectorError, match="not a multiple of 5"):
        dv.z85_decode("abcd")
    with pytest.raises(DeletionVectorError, match="not Z85: '~'"):
        dv.z85_decode("abcd~")


def test_a_vector_serialises_to_sparks_bytes():
    assert dv.serialize(BitMap64([0, 9])) == SPARK_FILE[5:41]
    assert dv.deserialize(SPARK_FILE[5:41]) == BitMap64([0, 9])


def test_a_file_spark_wrote_reads_as_its_rows(tmp_path):
    (tmp_path / f"deletion_vector_{SPARK_FILE_ID}.bin").write_bytes(SPARK_FILE)
    assert list(dv.read(LOCAL, str(tmp_path), dv.Descriptor.from_json(SPARK_DESCRIPTOR))) == [0, 9]


def test_a_file_written_holds_every_vector_at_its_offset_framed_as_sparks(tmp_path):
    vectors = [BitMap64([0, 9]), BitMap64([3, 2**33 + 5]), BitMap64(range(0, 100_000, 3))]
    descriptors = dv.write_file(LOCAL, str(tmp_path), vectors)
    assert [dv.read(LOCAL, str(tmp_path), d) for d in descriptors] == vectors
    (written,) = tmp_path.glob("deletion_vector_*.bin")
    assert written.read_bytes()[:41] == SPARK_FILE[:41]  # version, size, the same bitmap bytes
    assert descriptors[0].to_json() == {**SPARK_DESCRIPTOR, "pathOrInlineDv": descriptors[0].path_or_inline_dv}
    assert [d.cardinality for d in descriptors] == [2, 2, 33_334]


def test_a_damaged_vector_is_refused_naming_what_disagrees(tmp_path):
    (descriptor,) = dv.write_file(LOCAL, str(tmp_path), [BitMap64([1, 2, 3])])
    (written,) = tmp_path.glob("deletion_vector_*.bin")
    intact = written.read_bytes()
    written.write_bytes(intact[:-6] + bytes([intact[-6] ^ 0xFF]) + intact[-5:])
    with pytest.raises(DeletionVectorError, match="CRC-32 does not match"):
        dv.read(LOCAL, str(tmp_path), descriptor)
    written.write_bytes(intact)
    with pytest.raises(DeletionVectorError, match="3 rows, its descriptor says 4"):
        dv.read(LOCAL, str(tmp_path), dv.Descriptor.from_json({**descriptor.to_json(), "cardinality": 4}))


@pytest.mark.spark
def test_vectors_spark_writes_read_as_the_rows_spark_deleted(spark, tmp_path):
    uri = str(tmp_path / "t")
    spark.sql(f"CREATE TABLE delta.`{uri}` (id BIGINT, v STRING) USING delta "
              "TBLPROPERTIES ('delta.enableDeletionVectors' = 'true', 'delta.checkpointInterval' = '3')")
    spark.range(0, 40).selectExpr("id", "'x' AS v").coalesce(1).write.format("delta").mode("append").save(uri)
    spark.sql(f"DELETE FROM delta.`{uri}` WHERE id % 7 = 0")
    spark.sql(f"DELETE FROM delta.`{uri}` WHERE id = 11")  # a second vector for the file: the union
    table = DeltaTable(uri)
    live = LiveDeletionVectors(uri).at(table.version())
    (path, descriptor), = live.items()
    deleted = dv.read(LOCAL, uri, descriptor)
    rows = pq.read_table(Path(uri) / path, columns=["id"]).column("id").to_pylist()
    assert sorted(rows[p] for p in deleted) == [0, 7, 11, 14, 21, 28, 35]
    (selection,) = pa.table(table.deletion_vectors()).column("selection_vector").to_pylist()
    assert [i for i, kept in enumerate(selection) if not kept] == list(deleted)
    # Past a checkpoint (interval 3): read from it, the same vector.
    spark.sql(f"DELETE FROM delta.`{uri}` WHERE id = 12")
    table.update_incremental()
    assert any(p.name.endswith(".checkpoint.parquet") for p in (Path(uri) / "_delta_log").iterdir())
    (descriptor,) = LiveDeletionVectors(uri).at(table.version()).values()
    assert sorted(rows[p] for p in dv.read(LOCAL, uri, descriptor)) == [0, 7, 11, 12, 14, 21, 28, 35]


@pytest.mark.parametrize("rows", [[], [0], [3, 1, 2**40 + 5, 7]])
def test_positions_are_the_sets_rows_ascending(rows):
    assert dv.positions(BitMap64(rows)).tolist() == sorted(rows)
