import random
from typing import NamedTuple

import pyarrow as pa
import pytest

from sink.index.entry import Entry
from sink.tagging.classify import tag

P = "dt=2025-01-01"


def run(records, index=None, incoming_wins=True, **expiry):
    """records: (key, ordering, is_delete) in arrival order; index: key -> Entry."""
    index = index or {}
    looked_up = []

    def lookup(pid, keys):
        looked_up.append((pid, list(keys)))
        return [None if k.decode() not in index else index[k.decode()].pack() for k in keys]

    n = len(records)
    result = tag(
        pa.array([r[0] for r in records], pa.string()),
        pa.array([P] * n, pa.string()),
        pa.array([r[1] for r in records], pa.int64()),
        pa.array([r[2] for r in records], pa.bool_()),
        pa.array(range(n), pa.int64()),
        lookup,
        incoming_wins,
        **expiry,
    )
    return Tagged(result.op.to_pylist(), result.write.to_pylist(), result.hit.to_pylist(),
                  result.changes_dict()), looked_up


class Tagged(NamedTuple):
    op: list
    write: list
    hit: list
    changes: dict


def test_new_key_is_insert_known_key_update_older_stale():
    result, _ = run(
        [("new", 5, False), ("known", 5, False), ("old", 5, False)],
        index={"known": Entry(4), "old": Entry(6)},
    )
    assert result.op == ["insert", "update", "stale"]
    assert result.write == ["insert", "update", None]
    assert result.hit == [False, True, True]
    assert result.changes == {P: {b"new": Entry(5), b"known": Entry(5)}}


def test_delete_of_live_key_deletes_and_of_unknown_key_leaves_a_tombstone():
    result, _ = run([("live", 7, True), ("ghost", 7, True)], index={"live": Entry(3)})
    assert result.op == ["delete", "delete"]
    assert result.write == ["delete", "tombstone"]
    assert result.changes == {P: {b"live": Entry(7, True), b"ghost": Entry(7, True)}}


def test_older_update_of_a_deleted_key_stays_deleted():
    result, _ = run([("k", 4, False)], index={"k": Entry(5, deleted=True)})
    assert result.op == ["stale"]
    assert result.write == [None]
    assert result.changes == {}


def test_newer_update_of_a_deleted_key_reinserts():
    result, _ = run([("k", 6, False)], index={"k": Entry(5, deleted=True)})
    assert result.op == ["insert"]
    assert result.write == ["insert"]


def test_ties_follow_the_policy():
    incoming, _ = run([("k", 5, False)], index={"k": Entry(5)}, incoming_wins=True)
    existing, _ = run([("k", 5, False)], index={"k": Entry(5)}, incoming_wins=False)
    assert (incoming.op, existing.op) == (["update"], ["stale"])


def test_in_batch_duplicates_are_one_insert_then_updates_and_the_highest_wins():
    # Arrival order 3, 1, 2: applied in ordering order, so 1 inserts, 2 and 3 update.
    result, lookups = run([("k", 3, False), ("k", 1, False), ("k", 2, False)])
    assert result.op == ["update", "insert", "update"]
    assert result.write == ["insert", None, None]  # one table write, on the winning record
    assert result.changes == {P: {b"k": Entry(3)}}
    assert lookups == [(P, [b"k"])]  # one lookup per distinct key


def test_equal_ordering_in_a_batch_later_arrival_wins():
    result, _ = run([("k", 2, False), ("k", 2, True)])
    assert result.op == ["insert", "delete"]
    assert result.write == [None, "tombstone"]  # inserted and deleted in one batch: the table never sees it


def test_delete_then_newer_insert_in_one_batch_is_an_update_of_a_live_key():
    result, _ = run([("k", 6, True), ("k", 7, False)], index={"k": Entry(5)})
    assert result.op == ["delete", "insert"]
    assert result.write == [None, "update"]
    assert result.changes == {P: {b"k": Entry(7)}}


def test_stale_records_in_a_batch_do_not_hide_a_newer_one():
    result, _ = run([("k", 1, False), ("k", 9, False)], index={"k": Entry(5)})
    assert result.op == ["stale", "update"]
    assert result.write == [None, "update"]


def test_empty_input():
    result, lookups = run([])
    assert (result.op, result.changes, lookups) == ([], {}, [])


def reference(records, index, incoming_wins):
    """Record by record, in (ordering, arrival) order per key: the rule the docs state."""
    op, write, changes = [None] * len(records), [None] * len(records), {}
    by_key = {}
    for i, (k, _, _) in enumerate(records):
        by_key.setdefault(k, []).append(i)
    for k, rows in by_key.items():
        rows.sort(key=lambda i: (records[i][1], i))
        state = index.get(k)
        live = state is not None and not state.deleted
        last = None
        for i in rows:
            o, d = records[i][1], records[i][2]
            if state is not None and (o < state.ordering or (o == state.ordering and not incoming_wins)):
                op[i] = "stale"
                continue
            op[i] = "delete" if d else ("insert" if state is None or state.deleted else "update")
            state, last = Entry(o, d), i
        if last is not None:
            write[last] = ("delete" if live else "tombstone") if state.deleted else ("update" if live else "insert")
            changes[k.encode()] = state
    return op, write, changes


@pytest.mark.parametrize("seed", range(20))
def test_matches_a_record_by_record_reference(seed):
    rng = random.Random(seed)
    keys = [f"k{i}" for i in range(rng.randint(1, 40))]
    index = {k: Entry(rng.randint(0, 9), rng.random() < 0.2) for k in keys if rng.random() < 0.5}
    records = [(rng.choice(keys), rng.randint(0, 9), rng.random() < 0.2) for _ in range(rng.randint(1, 80))]
    incoming = rng.random() < 0.5
    result, _ = run(records, index, incoming)
    op, write, changes = reference(records, index, incoming)
    assert result.op == op
    assert result.write == write
    assert result.changes == ({P: changes} if changes else {})


def test_a_delete_older_than_the_ttl_no_longer_shields_its_key_and_new_deletes_are_stamped():
    index = {"old": Entry(9, True, deleted_at=1000), "recent": Entry(9, True, deleted_at=5000)}
    late = [("old", 3, False), ("recent", 3, False), ("gone", 4, True)]
    result, _ = run(late, index, now=6000, expire_before=2000)
    assert result.op == ["insert", "stale", "delete"]
    assert result.write == ["insert", None, "tombstone"]
    assert result.hit == [True, True, False]  # the index answered for "old"; its answer had expired
    assert result.changes == {P: {b"old": Entry(3), b"gone": Entry(4, True, deleted_at=6000)}}
    # Without a TTL the oldest delete still wins.
    assert run(late, index, now=6000)[0].op == ["stale", "stale", "delete"]


def tag_two(records, index, incoming_wins=True):
    """records: (key, (a, b), is_delete) in arrival order; index: key -> Entry((a, b), deleted)."""
    n = len(records)
    result = tag(
        pa.array([r[0] for r in records], pa.string()), pa.array([P] * n, pa.string()),
        [pa.array([r[1][0] for r in records], pa.int64()), pa.array([r[1][1] for r in records], pa.int64())],
        pa.array([r[2] for r in records], pa.bool_()), pa.array(range(n), pa.int64()),
        lambda pid, keys: [index[k.decode()].pack() if k.decode() in index else None for k in keys], incoming_wins)
    return result.op.to_pylist(), result.changes_dict().get(P, {})


def test_two_ordering_columns_break_ties_on_the_first_with_the_second():
    index = {"k": Entry((5, 3)), "j": Entry((5, 3), True)}
    ops, changes = tag_two([("k", (5, 2), False), ("k", (5, 4), False), ("j", (4, 9), False), ("n", (1, 1), True)],
                           index)
    assert ops == ["stale", "update", "stale", "delete"]
    assert changes == {b"k": Entry((5, 4)), b"n": Entry((1, 1), True)}


def test_two_ordering_columns_equal_records_applied_one_by_one():
    rng = random.Random(11)
    for _ in range(300):
        index = {k: Entry((rng.randrange(3), rng.randrange(3)), rng.random() < 0.3)
                 for k in "abc" if rng.random() < 0.7}
        records = [(rng.choice("abc"), (rng.randrange(3), rng.randrange(3)), rng.random() < 0.2)
                   for _ in range(rng.randrange(1, 9))]
        incoming_wins = rng.random() < 0.5
        state = {k: (e.ordering, e.deleted) for k, e in index.items()}
        expected_ops = [None] * len(records)
        for i, (key, values, deleting) in sorted(enumerate(records), key=lambda r: (r[1][0], r[1][1], r[0])):
            stored = state.get(key)
            if stored is not None and (values < stored[0] or (values == stored[0] and not incoming_wins)):
                expected_ops[i] = "stale"
                continue
            expected_ops[i] = "delete" if deleting else "insert" if stored is None or stored[1] else "update"
            state[key] = (values, deleting)
        ops, changes = tag_two(records, index, incoming_wins)
        assert ops == expected_ops, (records, index)
        applied = {r[0] for r, op in zip(records, expected_ops) if op != "stale"}
        assert {k.decode(): (e.ordering, e.deleted) for k, e in changes.items()} == {k: state[k] for k in applied}


def test_a_delete_kept_in_the_shield_makes_older_upserts_of_its_key_stale_in_any_partition():
    """The shield holds deletes that named no partition and found no row (sink.tagging.placement):
    a key missing from its own partition, or held there as an older delete, takes it."""
    shield = "dt="
    stored = {(P, "old-tombstone"): Entry(2, True), (shield, "old-tombstone"): Entry(5, True),
              (shield, "k"): Entry(5, True), (P, "live"): Entry(1), (shield, "live"): Entry(5, True)}

    def lookup(pid, ks):
        return [None if (pid, k.decode()) not in stored else stored[pid, k.decode()].pack() for k in ks]

    records = [("k", 3), ("k2", 3), ("old-tombstone", 4), ("live", 3)]
    result = tag(pa.array([k for k, _ in records]), pa.array([P] * 4), pa.array([o for _, o in records], pa.int64()),
                 pa.array([False] * 4), pa.array(range(4), pa.int64()), lookup,
                 shield=(shield, lambda ks: lookup(shield, ks)))
    # k: older than its kept delete; k2: no delete kept; the row of "live" stands as the index says.
    assert result.op.to_pylist() == ["stale", "insert", "stale", "update"]
    later = tag(pa.array(["k"]), pa.array([P]), pa.array([6], pa.int64()), pa.array([False]), pa.array([0], pa.int64()),
                lookup, shield=(shield, lambda ks: lookup(shield, ks)))
    assert (later.op.to_pylist(), later.write.to_pylist()) == (["insert"], ["insert"])
    assert later.changes_dict() == {P: {b"k": Entry(6)}}


@pytest.mark.parametrize("seed", range(10))
def test_several_partitions_each_tagged_against_its_own_entries_one_lookup_each(seed):
    rng = random.Random(seed)
    pids = [f"dt=2025-01-0{i}" for i in range(1, rng.randint(2, 6))]
    keys = [f"k{i}" for i in range(rng.randint(1, 30))]
    index = {p: {k: Entry(rng.randint(0, 9), rng.random() < 0.2) for k in keys if rng.random() < 0.5} for p in pids}
    records = [(rng.choice(pids), rng.choice(keys), rng.randint(0, 9), rng.random() < 0.2)
               for _ in range(rng.randint(1, 120))]
    incoming = rng.random() < 0.5
    calls = []

    def lookup(pid, looked_up):
        calls.append(pid)
        return [None if k.decode() not in index[pid] else index[pid][k.decode()].pack() for k in looked_up]

    result = tag(pa.array([r[1] for r in records]), pa.array([r[0] for r in records]),
                 pa.array([r[2] for r in records], pa.int64()), pa.array([r[3] for r in records]),
                 pa.array(range(len(records)), pa.int64()), lookup, incoming)
    assert sorted(calls) == sorted({r[0] for r in records})
    expected_changes = {}
    for pid in pids:
        at = [i for i, r in enumerate(records) if r[0] == pid]
        op, write, changes = reference([records[i][1:] for i in at], index[pid], incoming)
        assert [result.op.to_pylist()[i] for i in at] == op
        assert [result.write.to_pylist()[i] for i in at] == write
        if changes:
            expected_changes[pid] = changes
    assert result.changes_dict() == expected_changes
