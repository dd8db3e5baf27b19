"""A history table's global-scope entries list every partition a key's events named."""

import pyarrow as pa

from sink.index.entry import changes_schema, pack_located_many
from sink.index.history_locations import SEPARATOR, partition_lists, split, widen


def changes(rows):
    """(pid, key, ordering, deleted, deleted_at) rows as a changes table."""
    return pa.Table.from_pylist([dict(zip(changes_schema(1).names, r)) for r in rows], schema=changes_schema(1))


def test_a_batch_widens_changed_keys_and_keys_whose_only_events_were_late():
    stored = {b"a": ("p1", 10, False, 0), b"b": ("p1" + SEPARATOR + "p3", 20, True, 7)}
    looked_up = [b"a", b"b", b"c"]
    raws = [None if k not in stored else pack_located_many([stored[k][1]], [stored[k][2]], [stored[k][0]],
                                                          stored[k][3])[0] for k in looked_up]
    # a: updated in p2; b: a late upsert in p2 changed no entry (its delete is newer);
    # c: new, deleted without a partition.
    tagged = changes([("p2", b"a", 11, False, 0), ("", b"c", 5, True, 99)])
    keys = pa.array([b"a", b"b", b"c"], pa.binary())
    partitions = pa.array(["p2", "p2", None])
    out, located = widen(tagged, keys, partitions, looked_up, raws, width=1)
    assert sorted(out.to_pylist(), key=lambda r: r["key"]) == [
        {"pid": "p1\np2", "key": b"a", "ordering": 11, "deleted": False, "deleted_at": 0},
        {"pid": "p1\np2\np3", "key": b"b", "ordering": 20, "deleted": True, "deleted_at": 7},  # as it was
        {"pid": "", "key": b"c", "ordering": 5, "deleted": True, "deleted_at": 99},
    ]
    assert located.to_pylist() == ["p1", "p1\np3", None]


def test_a_key_whose_events_name_only_partitions_it_lists_is_written_as_it_was():
    """Another replica of the shard may list less (one built from the table lists only the
    partitions holding rows): the entry goes to the changelog all the same."""
    raws = pack_located_many([3], [False], ["p1" + SEPARATOR + "p2"])
    out, located = widen(changes([]), pa.array([b"a", b"b"], pa.binary()), pa.array(["p2", None]), [b"a", b"b"],
                         [*raws, *pack_located_many([4], [True], ["p1"])], width=1)
    # b: a delete naming no partition adds none, and its entry did not change: nothing to tell.
    assert out.to_pylist() == [{"pid": "p1\np2", "key": b"a", "ordering": 3, "deleted": False, "deleted_at": 0}]
    assert located.to_pylist() == ["p1\np2", "p1"]


def test_partition_lists_are_sorted_distinct_and_skip_nulls():
    lists = partition_lists(pa.array([b"k", b"k", b"k", b"j"]), pa.array(["p2", "p1", "p2", None]))
    assert dict(zip(*(c.to_pylist() for c in lists.columns))) == {b"k": "p1\np2"}
    assert split("") == [] and split(None) == [] and split("p1\np2") == ["p1", "p2"]
