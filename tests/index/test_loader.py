"""Reading a shard's entries from the tables: a global keyspace batch by batch, handed on in
chunks; a partition whole, or for some keys."""

import pyarrow as pa
import pytest
from deltalake import DeltaTable, write_deltalake

from sink import keys
from sink.index.entry import Entry, unpack_located_many
from sink.index.loader import read_global, read_partition
from sink.keys import UNPARTITIONED

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


def test_a_partition_read_for_some_keys_gives_exactly_their_entries_of_the_whole_read(tmp_path):
    """What a peek reads (sink.tagging.executor._peek) is what a load would hold for those keys:
    live rows, rows a newer tombstone deletes, keys with a tombstone only, in either shard."""
    uri, tomb_uri = str(tmp_path / "t"), str(tmp_path / "tomb")
    live = [{"id": f"k{i}", "dt": "2025-01-01", "ts": i} for i in range(40)]
    write_deltalake(uri, pa.Table.from_pylist(live), partition_by=["dt"])
    write_deltalake(uri, pa.Table.from_pylist([{"id": "k3", "dt": "2025-01-01", "ts": 50}]), partition_by=["dt"],
                    mode="append")  # a second row of k3, newer: one entry per key
    tombs = [{"id": "k5", "dt": "2025-01-01", "ts": 99}, {"id": "k6", "dt": "2025-01-01", "ts": 1},
             {"id": "gone", "dt": "2025-01-01", "ts": 7}]  # newer than the row, older, no row at all
    write_deltalake(tomb_uri, pa.Table.from_pylist(tombs), partition_by=["dt"])
    table, tombstones = DeltaTable(uri), DeltaTable(tomb_uri)
    wanted = [b"k3", b"k5", b"k6", b"gone", b"absent", b"k17", b"k22"]
    entries: dict[bytes, Entry] = {}
    for shard in range(SHARDS):
        whole = dict(zip(*read_partition(table, tombstones, "dt=2025-01-01", ["id"], "ts", shard, SHARDS)))
        some = dict(zip(*read_partition(table, tombstones, "dt=2025-01-01", ["id"], "ts", shard, SHARDS,
                                        pa.array(wanted, pa.binary()))))
        assert some == {k: raw for k, raw in whole.items() if k in wanted}
        assert set(some) == {k for k in wanted if k != b"absent" and keys.shard_of(k, SHARDS) == shard}
        entries.update({k: Entry.unpack(raw) for k, raw in some.items()})
    assert (entries[b"k3"].values(), entries[b"k3"].deleted) == ((50,), False)
    assert (entries[b"k5"].values(), entries[b"k5"].deleted) == ((5,), False)
    assert (entries[b"k6"].values(), entries[b"k6"].deleted) == ((6,), False)
    assert (entries[b"gone"].values(), entries[b"gone"].deleted) == ((7,), True)


def test_a_read_for_some_keys_of_a_composite_key_scans_only_their_rows(tmp_path, monkeypatch):
    """Keys named in the scan's predicate (`keys_predicate`): the same entries as the whole
    read, a quote and a colon in a value included, and the scan returns only their rows."""
    uri = str(tmp_path / "t")
    rows = [{"tenant": f"t'{i % 3}:x", "n": i, "ts": i * 10} for i in range(30)]
    write_deltalake(uri, pa.Table.from_pylist(rows))
    table = DeltaTable(uri)
    wanted = keys.encode_keys(pa.Table.from_pylist([rows[4], rows[17], {"tenant": "none", "n": 4, "ts": 0}]),
                              ["tenant", "n"]).cast(pa.binary())
    scanned = []
    scan = DeltaTable.scan

    def counted(self, *args, **kwargs):
        out = pa.table(scan(self, *args, **kwargs))
        scanned.append(out.num_rows)
        return out

    monkeypatch.setattr(DeltaTable, "scan", counted)
    for shard in range(SHARDS):
        whole = dict(zip(*read_partition(table, None, UNPARTITIONED, ["tenant", "n"], "ts", shard, SHARDS)))
        some = dict(zip(*read_partition(table, None, UNPARTITIONED, ["tenant", "n"], "ts", shard, SHARDS, wanted)))
        assert some == {k: raw for k, raw in whole.items() if k in wanted.to_pylist()}
    assert scanned == [30, 2, 30, 2]


@pytest.mark.parametrize("colliding", [False, True])
def test_a_key_stored_twice_in_a_partition_is_read_once_at_its_newest_row(tmp_path, monkeypatch, colliding):
    """Keys are told distinct by their hashes: a collision (forced here) only takes the exact
    path, which keeps each key's newest row."""
    uri = str(tmp_path / "t")
    write_deltalake(uri, pa.table({"id": [f"k{i}" for i in range(40)], "ts": list(range(40))}))
    write_deltalake(uri, pa.table({"id": ["k3", "k8"], "ts": [100, 1]}), mode="append")
    if colliding:
        monkeypatch.setattr("sink.index.loader._all_distinct", lambda hashed: False)  # as two equal hashes make it
    found = {}
    for shard in range(SHARDS):
        got, raws = read_partition(DeltaTable(uri), None, UNPARTITIONED, ["id"], "ts", shard, SHARDS)
        assert got == sorted(got)  # the order an SST file is written in
        found.update({k: Entry.unpack(r) for k, r in zip(got, raws)})
    expected = {f"k{i}".encode(): Entry(i) for i in range(40)} | {b"k3": Entry(100)}
    assert found == expected
