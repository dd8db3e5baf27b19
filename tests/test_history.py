"""SCD type 2 history from change events: published examples and an independent oracle."""

import random
from collections.abc import Sequence

import pyarrow as pa
import pytest

from sink.history import END_AT, RUN_EVENTS, START_AT, HistoryColumns, build, collapse, events_of
from tests.examples import USER_CHANGES, USER_VERSIONS, USER_VERSIONS_EXCEPT_CITY

USERS = pa.schema([("userId", pa.int32()), ("sequenceNum", pa.int32()), ("deleted", pa.bool_()),
                   ("name", pa.string()), ("city", pa.string())])
CHANGES = USER_CHANGES  # Databricks' AUTO CDC example, stored without operation and sequenceNum


def users(tracked=("name", "city")) -> HistoryColumns:
    return HistoryColumns(key=("userId",), ordering=("sequenceNum",), delete="deleted", values=("name", "city"),
                          tracked=tuple(tracked))


def user_events(changes) -> pa.Table:
    return pa.Table.from_pylist([{"userId": u, "sequenceNum": s, "deleted": op == "DELETE", "name": n, "city": c}
                                 for u, n, c, op, s in changes], schema=USERS)


def in_batches(batches: list[pa.Table], cols: HistoryColumns):
    """Each batch rebuilt on the events the history so far keeps, as a sink does."""
    history = build(batches[0].slice(0, 0), cols)
    for batch in batches:
        history = build(pa.concat_tables([events_of(history, cols), batch.select(cols.event_columns)]), cols)
    return history


def splits(events: pa.Table, seed: int) -> list[list[pa.Table]]:
    """The events in one batch, one per event in reverse, and shuffled into three batches."""
    rows = events.to_pylist()
    shuffled = random.Random(seed).sample(rows, len(rows))
    thirds = [shuffled[i::3] for i in range(3)]
    as_table = lambda rs: pa.Table.from_pylist(rs, schema=events.schema)  # noqa: E731
    return [[events], [as_table([r]) for r in reversed(rows)], [as_table(t) for t in thirds]]


def rows(history, *columns) -> list[tuple]:
    table = history.versions
    names = columns or table.column_names
    return sorted((tuple(r[c] for c in names) for r in table.to_pylist()), key=repr)


@pytest.mark.parametrize("split", range(3))
def test_the_published_scd2_users_example(split):
    """STORED AS SCD TYPE 2: the docs' 7 rows, however the changes are batched."""
    history = in_batches(splits(user_events(CHANGES), seed=1)[split], users())
    assert rows(history, "userId", "name", "city", START_AT, END_AT) == sorted(USER_VERSIONS, key=repr)


@pytest.mark.parametrize("split", range(3))
def test_the_published_example_tracking_history_except_city(split):
    """TRACK HISTORY ON * EXCEPT (city): the docs' 4 rows; a city change updates the version."""
    history = in_batches(splits(user_events(CHANGES), seed=2)[split], users(tracked=["name"]))
    assert rows(history, "userId", "name", "city", START_AT, END_AT) == sorted(USER_VERSIONS_EXCEPT_CITY, key=repr)


# The SCD2 handler suite of Apache Spark's declarative pipelines (sql/pipelines, autocdc):
# (stored events, the batch, the versions after it as (value, START_AT, END_AT, sequence shown)).
V = pa.schema([("id", pa.int32()), ("seq", pa.int64()), ("is_delete", pa.bool_()), ("value", pa.string())])
VALUE = HistoryColumns(key=("id",), ordering=("seq",), delete="is_delete", values=("value",), tracked=("value",))


def up(value, seq, key=1):
    return {"id": key, "seq": seq, "is_delete": False, "value": value}


def rm(seq, key=1):
    return {"id": key, "seq": seq, "is_delete": True, "value": None}


HANDLER_CASES = {
    "two updates close the first": ([], [up("a", 10), up("b", 20)], [("a", 10, 20, 10), ("b", 20, None, 20)]),
    "an insert and a later delete": ([], [up("a", 10), rm(20)], [("a", 10, 20, 10)]),
    "insert, update, delete, re-insert": (
        [], [up("a", 10), up("b", 20), rm(30), up("c", 40)],
        [("a", 10, 20, 10), ("b", 20, 30, 20), ("c", 40, None, 40)]),
    "a repeated value is one version shown from its last event": ([], [up("a", 10), up("a", 20)],
                                                                  [("a", 10, None, 20)]),
    "a late event older than the history": ([up("a", 10)], [up("b", 5)], [("b", 5, 10, 5), ("a", 10, None, 10)]),
    "a late update splits a version": (
        [up("a", 10), up("c", 20)], [up("b", 15)], [("a", 10, 15, 10), ("b", 15, 20, 15), ("c", 20, None, 20)]),
    "a late delete shortens a version": (
        [up("a", 10), up("b", 30)], [rm(20)], [("a", 10, 20, 10), ("b", 30, None, 30)]),
    "a late delete inside a trailing closed version": ([up("a", 10), rm(20)], [rm(15)], [("a", 10, 15, 10)]),
    "two late events split two versions": (
        [up("a", 1), up("b", 5), up("c", 10), up("d", 20)], [up("x", 7), up("y", 15)],
        [("a", 1, 5, 1), ("b", 5, 7, 5), ("x", 7, 10, 7), ("c", 10, 15, 10), ("y", 15, 20, 15),
         ("d", 20, None, 20)]),
    "a re-insert after a delete leaves a gap": ([rm(20)], [up("x", 30)], [("x", 30, None, 30)]),
    "a late event splits an unchanged run": (
        [up("Alice", 5), up("Alice", 10), up("Alice", 15), up("Charlie", 20)], [up("Bob", 12)],
        [("Alice", 5, 12, 10), ("Bob", 12, 15, 12), ("Alice", 15, 20, 15), ("Charlie", 20, None, 20)]),
    "a late upsert before a remembered delete ends at it": ([rm(20)], [up("x", 10)], [("x", 10, 20, 10)]),
    "identical duplicates collapse": ([up("a", 10)], [up("a", 10), up("a", 10)], [("a", 10, None, 10)]),
    "at one sequence a delete beats an upsert": ([], [up("a", 10), rm(10)], []),
    "an event after a delete leaves the closed run as it was": (
        [up("a", 10), up("a", 11), rm(12)], [up("b", 20)], [("a", 10, 12, 11), ("b", 20, None, 20)]),
    "a deleted key's delete alone writes no version": ([], [rm(5)], []),
}


@pytest.mark.parametrize("case", HANDLER_CASES)
def test_the_declarative_pipelines_handler_cases(case):
    stored, batch, expected = HANDLER_CASES[case]
    table = pa.Table.from_pylist(stored + batch, schema=V)
    for split in splits(table, seed=3):
        history = in_batches(split, VALUE)
        assert rows(history, "value", START_AT, END_AT, "seq") == sorted(expected, key=repr), case


def test_a_version_keeps_its_runs_earlier_events_and_a_delete_closing_nothing_is_free():
    history = build(pa.Table.from_pylist([rm(5), up("a", 10), up("a", 11), rm(12), rm(13)], schema=V), VALUE)
    assert [(e["seq"], e["is_delete"]) for e in history.free.to_pylist()] == [(5, True), (13, True)]
    assert history.versions.column(RUN_EVENTS).to_pylist() == [[{"seq": 10}]]


TRACKED = pa.schema([("id", pa.int32()), ("seq", pa.int64()), ("is_delete", pa.bool_()), ("name", pa.string()),
                     ("score", pa.int32())])
NAME = HistoryColumns(key=("id",), ordering=("seq",), delete="is_delete", values=("name", "score"),
                      tracked=("name",))


def test_untracked_changes_update_the_version_without_opening_one():
    """The handler suite's tracked-name cases: score is untracked."""
    events = pa.Table.from_pylist([
        {"id": 1, "seq": 39, "is_delete": False, "name": "alice", "score": 39},
        {"id": 1, "seq": 41, "is_delete": False, "name": "alice", "score": 41},
        {"id": 1, "seq": 42, "is_delete": False, "name": "bob", "score": 42},
        {"id": 1, "seq": 43, "is_delete": False, "name": "carol", "score": 43},
    ], schema=TRACKED)
    for split in splits(events, seed=4):
        assert rows(in_batches(split, NAME), "name", "score", START_AT, END_AT) == [
            ("alice", 41, 39, 42), ("bob", 42, 42, 43), ("carol", 43, 43, None)]


def test_a_late_tracked_change_inside_an_untracked_run_restores_the_values_before_it():
    """Only a kept event can say that 'alice' scored 39 until the late 'bob' at 40."""
    first = pa.Table.from_pylist([{"id": 1, "seq": 39, "is_delete": False, "name": "alice", "score": 39},
                                  {"id": 1, "seq": 41, "is_delete": False, "name": "alice", "score": 41}],
                                 schema=TRACKED)
    late = pa.Table.from_pylist([{"id": 1, "seq": 40, "is_delete": False, "name": "bob", "score": 40}],
                                schema=TRACKED)
    assert rows(in_batches([first, late], NAME), "name", "score", START_AT, END_AT) == [
        ("alice", 39, 39, 40), ("alice", 41, 41, None), ("bob", 40, 40, 41)]


def test_upserts_at_one_sequence_keep_the_greatest_values_whatever_the_order():
    a, b = up("a", 10), up("b", 10)
    for order in ([a, b], [b, a]):
        for split in ([order], [[order[0]], [order[1]]]):
            history = in_batches([pa.Table.from_pylist(s, schema=V) for s in split], VALUE)
            assert rows(history, "value", START_AT, END_AT) == [("b", 10, None)]


COMPOSITE = pa.schema([("region", pa.string()), ("id", pa.int32()), ("major", pa.int32()), ("minor", pa.int32()),
                       ("is_delete", pa.bool_()), ("value", pa.string())])
BY_STRUCT = HistoryColumns(key=("region", "id"), ordering=("major", "minor"), delete="is_delete", values=("value",),
                           tracked=("value",))


def test_composite_keys_and_a_struct_sequence():
    """Keys of two columns; `SEQUENCE BY STRUCT(major, minor)`: START_AT and END_AT are structs."""
    def event(region, major, minor, value, delete=False):
        return {"region": region, "id": 1, "major": major, "minor": minor, "is_delete": delete, "value": value}
    events = pa.Table.from_pylist([event("eu", 1, 2, "b"), event("eu", 1, 1, "a"), event("us", 1, 1, "a"),
                                   event("eu", 2, 0, None, delete=True)], schema=COMPOSITE)
    for split in splits(events, seed=5):
        history = in_batches(split, BY_STRUCT)
        assert history.versions.schema.field(START_AT).type == pa.struct([("major", pa.int32()),
                                                                          ("minor", pa.int32())])
        assert rows(history, "region", "value", START_AT, END_AT) == sorted([
            ("eu", "a", {"major": 1, "minor": 1}, {"major": 1, "minor": 2}),
            ("eu", "b", {"major": 1, "minor": 2}, {"major": 2, "minor": 0}),
            ("us", "a", {"major": 1, "minor": 1}, None),
        ], key=repr)


def oracle(events: list[dict], tracked: Sequence[str], fill: bool = False) -> list[tuple]:
    """History as intervals: between two consecutive sequences of a key the key holds the
    event at the first (absent after a delete; with `fill`, its nulls take the values held
    before it); adjacent intervals whose tracked values agree are one version, which shows
    its last interval's event."""
    result = []
    for key in {e["id"] for e in events}:
        at: dict[int, dict] = {}
        for e in events:
            if e["id"] != key:
                continue
            held = at.get(e["seq"])
            rank = lambda x: (x["is_delete"], [(v is not None, v) for v in (x["name"], x["score"])])  # noqa: E731
            if held is None or rank(e) > rank(held):
                at[e["seq"]] = e
        seqs = sorted(at)
        held = None
        for s in seqs:
            if at[s]["is_delete"]:
                held = None
            elif fill:
                held = at[s] = {**at[s], **{c: held[c] for c in ("name", "score") if held and at[s][c] is None}}
        intervals = [(s, seqs[i + 1] if i + 1 < len(seqs) else None, at[s]) for i, s in enumerate(seqs)]
        merged: list[list] = []  # [start, end, event]
        previous = None
        for start, end, e in intervals:
            if e["is_delete"]:
                previous = None
                continue
            if previous is not None and all(previous[c] == e[c] for c in tracked):
                merged[-1][1:] = [end, e]
            else:
                merged.append([start, end, e])
            previous = e
        result += [(key, e["name"], e["score"], e["seq"], start, end) for start, end, e in merged]
    return sorted(result, key=repr)


@pytest.mark.parametrize("seed", range(200))
def test_any_batching_and_arrival_order_gives_the_oracles_history(seed):
    """With nulls filled (ignore_null_updates) in every other case."""
    rnd = random.Random(seed)
    tracked = rnd.choice([("name",), ("name", "score")])
    fill = seed % 2 == 1
    cols = HistoryColumns(key=("id",), ordering=("seq",), delete="is_delete", values=("name", "score"),
                          tracked=tracked, fill_nulls=fill)
    events = [{"id": rnd.randint(1, 3), "seq": rnd.randint(1, 12), "is_delete": rnd.random() < 0.25,
               "name": rnd.choice(["a", "b", None]), "score": rnd.choice([1, 2, None])}
              for _ in range(rnd.randint(1, 25))]
    for e in events:
        if e["is_delete"]:
            e["name"] = e["score"] = None
    rnd.shuffle(events)
    cuts = sorted({*rnd.sample(range(1, len(events)), min(len(events) - 1, rnd.randint(0, 3))), len(events)})
    batches = [pa.Table.from_pylist(events[a:b], schema=TRACKED) for a, b in zip([0, *cuts], cuts)]
    history = in_batches(batches, cols)
    assert rows(history, "id", "name", "score", "seq", START_AT, END_AT) == oracle(events, tracked, fill)
    # The history keeps every event it was built from.
    all_events = pa.Table.from_pylist(events, schema=TRACKED)
    assert events_of(history, cols).to_pylist() == collapse(all_events, cols).to_pylist()


def test_no_events_and_one_event():
    assert build(pa.Table.from_pylist([], schema=V), VALUE).versions.num_rows == 0
    assert rows(build(pa.Table.from_pylist([up("a", 1)], schema=V), VALUE)) == [(1, "a", 1, 1, None, [])]
