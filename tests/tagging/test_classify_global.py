"""tag_global: keys unique across the table; the index says where each lives."""

import pyarrow as pa

from sink.index.entry import pack_located_many
from sink.tagging.classify import tag_global


def run(records, index=None):
    """records: (key, partition or None, ordering, is_delete) in arrival order;
    index: key -> (ordering, deleted, partition)."""
    index = index or {}

    def lookup(keys):
        return [pack_located_many([index[k.decode()][0]], [index[k.decode()][1]], [index[k.decode()][2]])[0]
                if k.decode() in index else None for k in keys]

    n = len(records)
    result = tag_global(pa.array([r[0] for r in records], pa.string()), pa.array([r[1] for r in records], pa.string()),
                        pa.array([r[2] for r in records], pa.int64()), pa.array([r[3] for r in records], pa.bool_()),
                        pa.array(range(n), pa.int64()), lookup)
    changes = {r["key"].decode(): (r["ordering"], r["deleted"], r["pid"]) for r in result.changes.to_pylist()}
    return (list(zip(result.op.to_pylist(), result.write.to_pylist(), result.stored_at.to_pylist(),
                     result.location.to_pylist())), changes)


def test_a_newer_record_in_another_partition_is_an_update_from_the_stored_partition():
    tags, changes = run([("a", "p2", 6, False)], {"a": (5, False, "p1")})
    assert tags == [("update", "update", "p1", "p2")]
    assert changes == {"a": (6, False, "p2")}


def test_a_stale_record_never_moves_a_key():
    tags, changes = run([("a", "p2", 4, False)], {"a": (5, False, "p1")})
    assert tags == [("stale", None, None, None)] and changes == {}


def test_a_key_only_delete_removes_the_row_where_it_lives():
    tags, changes = run([("a", None, 6, True)], {"a": (5, False, "p1")})
    assert tags == [("delete", "delete", "p1", "p1")]
    assert changes == {"a": (6, True, "p1")}


def test_a_delete_of_an_unknown_key_only_leaves_a_tombstone():
    tags, changes = run([("zz", None, 6, True), ("yy", "p3", 6, True)])
    assert [t[:2] for t in tags] == [("delete", "tombstone"), ("delete", "tombstone")]
    assert changes == {"zz": (6, True, ""), "yy": (6, True, "p3")}


def test_records_of_one_key_net_out_against_the_table_row():
    # Stored at p1; in the batch: moved to p2, then to p3: one move p1 -> p3.
    tags, changes = run([("a", "p2", 6, False), ("a", "p3", 7, False)], {"a": (5, False, "p1")})
    assert tags == [("update", None, None, None), ("update", "update", "p1", "p3")]
    # Unknown key inserted at p1 then moved to p2 within the batch: one insert at p2.
    tags, _ = run([("b", "p1", 1, False), ("b", "p2", 2, False)])
    assert tags[1] == ("update", "insert", None, "p2")
    # Stored at p1, moved to p2 in the batch, then deleted by key only: the delete removes p1's row.
    tags, changes = run([("c", "p2", 6, False), ("c", None, 7, True)], {"c": (5, False, "p1")})
    assert tags[1] == ("delete", "delete", "p1", "p1")
    assert changes == {"c": (7, True, "p1")}
