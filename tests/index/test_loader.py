"""Reading a shard's global keyspace: batch by batch from the table, handed on in chunks."""

import pyarrow as pa
import pytest
from deltalake import DeltaTable, write_deltalake

from sink import keys
from sink.index.entry import unpack_located_many
from sink.index.loader import read_global

SHARDS = 2


@pytest.mark.parametrize("overlapping", [False, True])
def test_a_global_keyspace_comes_in_bounded_ascending_chunks_with_each_keys_newest_row(tmp_path, overlapping):
    uri = str(tmp_path / "t")
    rows = []
    for part in range(4):  # four commits, so the table is scanned as several batches
        ids = range(part, 60, 2) if overlapping else range(60 * part, 60 * part + 30)
        batch = [{"id": f"k{i}", "dt": f"2025-01-0{1 + part}", "ts": 10 * part + i % 7} for i in ids]
        write_deltalake(uri, pa.Table.from_pylist(batch), partition_by=["dt"], mode="append")
        rows += batch
    # Overlapping commits put keys in several partitions: the newest row wins.
    expected: dict[bytes, tuple[int, str]] = {}
    for r in rows:
        k = r["id"].encode()
        if keys.shard_of(k, SHARDS) == 0 and (k not in expected or r["ts"] > expected[k][0]):
            expected[k] = (r["ts"], f"dt={r['dt']}")
    several = sum(len({r["dt"] for r in rows if r["id"].encode() == k}) > 1 for k in expected)

    read = read_global(DeltaTable(uri), None, ["id"], ["dt"], "ts", shard=0, num_shards=SHARDS)
    chunks = list(read.chunks(size=7))
    got_keys = [k for ks, _ in chunks for k in ks]
    assert [len(ks) for ks, _ in chunks[:-1]] == [7] * (len(chunks) - 1) and 0 < len(chunks[-1][0]) <= 7
    assert got_keys == sorted(expected)  # ascending across chunks: disjoint key ranges
    present, orderings, deleted, _, locations = unpack_located_many([r for _, rs in chunks for r in rs])
    assert present.all() and not deleted.any()
    assert dict(zip(got_keys, zip(orderings[:, 0].tolist(), locations))) == expected
    assert read.keys_in_several_partitions == several
    assert (several > 0) == overlapping
