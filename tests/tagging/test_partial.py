import random

import pyarrow as pa
import pytest

from sink.errors import UnchangedValueError
from sink.index.entry import Entry
from sink.lakehouse.commit.unchanged import UNCHANGED, keep_unchanged
from sink.tagging.classify import tag
from sink.tagging.partial import fill_from_stored, fold_nulls, unsent_records

P = "dt=2025-01-01"
VALUES = ["a", "b"]


MARKER = "__debezium_unavailable_value"


def tagged(records, stored):
    """records: (key, ordering, is_delete, a, b) in arrival order; stored: key -> (ordering, a, b)
    of live rows. The records as rows, their keys, orderings and arrivals, and their tags."""
    index = {k: Entry(o).pack() for k, (o, _, _) in stored.items()}
    n = len(records)
    keys = pa.array([r[0] for r in records], pa.string())
    orderings = pa.array([r[1] for r in records], pa.int64())
    arrivals = pa.array(range(n), pa.int64())
    result = tag(keys, pa.array([P] * n, pa.string()), orderings, pa.array([r[2] for r in records]), arrivals,
                 lambda pid, ks: [index.get(k.decode()) for k in ks])
    rows = pa.table({"k": keys, "a": pa.array([r[3] for r in records], pa.int64()),
                     "b": pa.array([r[4] for r in records], pa.string())})
    return rows, keys, orderings, arrivals, result


def fold(records, stored, **options):
    """Each record's (write, partial, a, b) after tagging and folding (`tagged`'s records and
    stored rows; `options`: fold_nulls' nulls_kept and unchanged)."""
    rows, keys, orderings, arrivals, result = tagged(records, stored)
    rows, partial = fold_nulls(rows, VALUES, keys, [orderings], arrivals, result.op, result.write, **options)
    return list(zip(result.write.to_pylist(), partial.to_pylist(), rows.column("a").to_pylist(),
                    rows.column("b").to_pylist()))


def merged(records, stored, nulls_kept=True, unchanged=None):
    """The table after the batch: what the commit makes of each write (coalesce with the stored
    row when partial, under `nulls_kept`; UNCHANGED from the stored row)."""
    table = {k: (a, b) for k, (_, a, b) in stored.items()}
    folded = fold(records, stored, nulls_kept=nulls_kept, unchanged=unchanged)
    for (key, *_), (write, partial, a, b) in zip(records, folded):
        if write == "delete":
            del table[key]
        elif write == "update" and partial:
            old = table[key]
            if nulls_kept:
                a, b = (a if a is not None else old[0], b if b is not None else old[1])
            table[key] = (a, old[1] if b == UNCHANGED else b)
        elif write in ("insert", "update"):
            assert b != UNCHANGED, "a write that cannot keep the stored value must have failed the batch"
            table[key] = (a, b)
    return table


def applied_one_by_one(records, stored, nulls_kept=True, unchanged=None):
    """Independent oracle: each record applied alone, in (ordering, arrival) order; older than
    the key's current ordering is stale; an update's nulls (under `nulls_kept`) and its
    `unchanged` values keep the current values. A row left holding `unchanged` (its key had no
    row to keep it from): UnchangedValueError."""
    state = {k: (o, False, (a, b)) for k, (o, a, b) in stored.items()}
    for _, (key, o, deleting, a, b) in sorted(enumerate(records), key=lambda ir: (ir[1][0], ir[1][1], ir[0])):
        if key in state and o < state[key][0]:
            continue
        current = state.get(key)
        if deleting:
            state[key] = (o, True, None)
        elif current is None or current[1]:
            state[key] = (o, False, (a, b))
        else:
            old = current[2]
            if nulls_kept:
                a, b = (a if a is not None else old[0], b if b is not None else old[1])
            state[key] = (o, False, (a, old[1] if unchanged is not None and b == unchanged else b))
    table = {k: row for k, (_, deleted, row) in state.items() if not deleted}
    if unchanged is not None and any(b == unchanged for _, b in table.values()):
        raise UnchangedValueError(unchanged)
    return table


def test_paimon_partial_update_example_in_one_batch():
    # Paimon's partial-update merge engine: <1, 23.0, 10, NULL>, <1, NULL, NULL, 'This is a book'>,
    # <1, 25.2, NULL, NULL> give <1, 25.2, 10, 'This is a book'> (here one number column, a).
    records = [("1", 1, False, 23, "x"), ("1", 2, False, None, "This is a book"), ("1", 3, False, 25, None)]
    assert fold(records, {})[2] == ("insert", True, 25, "This is a book")
    assert merged(records, {}) == {"1": (25, "This is a book")}


def test_a_delete_in_the_batch_makes_the_next_upsert_replace_the_row_whole():
    stored = {"1": (1, 10, "kept?")}
    records = [("1", 2, False, 11, None), ("1", 3, True, None, None), ("1", 4, False, 12, None)]
    out = fold(records, stored)
    assert out[2] == ("update", False, 12, None)  # values from before the delete do not carry over
    assert merged(records, stored) == {"1": (12, None)}


def test_stale_records_give_no_values():
    stored = {"1": (5, 10, "stored")}
    records = [("1", 4, False, 99, "stale"), ("1", 6, False, None, None)]
    assert fold(records, stored)[1] == ("update", True, None, None)
    assert merged(records, stored) == {"1": (10, "stored")}


def test_single_records_are_left_as_they_are():
    records = [("1", 1, False, None, "b"), ("2", 1, False, 3, None)]
    assert [r[2:] for r in fold(records, {"1": (0, 1, "x")})] == [(None, "b"), (3, None)]


def test_random_batches_equal_records_applied_one_by_one():
    rng = random.Random(7)
    for _ in range(300):
        stored = {str(k): (rng.randrange(5), rng.choice([None, 1]), rng.choice([None, "s"]))
                  for k in range(4) if rng.random() < 0.6}
        records = [(str(rng.randrange(4)), rng.randrange(8), rng.random() < 0.2,
                    rng.choice([None, rng.randrange(100)]), rng.choice([None, f"r{rng.randrange(9)}"]))
                   for _ in range(rng.randrange(1, 12))]
        assert merged(records, stored) == applied_one_by_one(records, stored), (records, stored)


def test_unchanged_values_keep_the_stored_value_and_nulls_are_written():
    stored = {"1": (1, 10, "toasted")}
    records = [("1", 2, False, None, MARKER)]
    assert fold(records, stored, nulls_kept=False, unchanged=MARKER) == [("update", True, None, UNCHANGED)]
    assert merged(records, stored, nulls_kept=False, unchanged=MARKER) == {"1": (None, "toasted")}


def test_an_unchanged_value_for_a_key_without_a_stored_row_fails_naming_key_and_column():
    with pytest.raises(UnchangedValueError, match="column 'b' of the record for key '2' holds unchanged_value"):
        fold([("2", 1, False, 5, MARKER)], {}, nulls_kept=False, unchanged=MARKER)
    # Deleted earlier in the batch: nothing stored to keep either.
    with pytest.raises(UnchangedValueError, match="key '1'"):
        fold([("1", 2, True, None, None), ("1", 3, False, 5, MARKER)], {"1": (1, 1, "x")}, nulls_kept=False,
             unchanged=MARKER)


def random_case(rng: random.Random):
    """Stored rows of a few keys, and a batch of their records, some holding MARKER."""
    stored = {str(k): (rng.randrange(5), rng.choice([None, 1]), rng.choice([None, "s"]))
              for k in range(4) if rng.random() < 0.6}
    records = [(str(rng.randrange(4)), rng.randrange(8), rng.random() < 0.2,
                rng.choice([None, rng.randrange(100)]), rng.choice([None, MARKER, f"r{rng.randrange(9)}"]))
               for _ in range(rng.randrange(1, 12))]
    return stored, records


@pytest.mark.parametrize("nulls_kept", [True, False])
def test_random_batches_with_unchanged_values_equal_records_applied_one_by_one(nulls_kept):
    rng = random.Random(11)
    failed = 0
    for _ in range(400):
        stored, records = random_case(rng)
        try:
            expected = applied_one_by_one(records, stored, nulls_kept, MARKER)
        except UnchangedValueError:
            failed += 1
            with pytest.raises(UnchangedValueError):
                merged(records, stored, nulls_kept, MARKER)
            continue
        assert merged(records, stored, nulls_kept, MARKER) == expected, (records, stored)
    assert 0 < failed < 400  # both outcomes were drawn


def set_aside(records, stored, nulls_kept):
    """unsent_records of a batch: which records it sets aside, and their reasons."""
    rows, keys, orderings, arrivals, result = tagged(records, stored)
    return unsent_records(rows, VALUES, keys, [orderings], arrivals, result.op, result.write, nulls_kept=nulls_kept,
                          unchanged=MARKER, key_cols=["k"])


def test_an_unsent_value_without_a_stored_row_is_set_aside_naming_key_and_column():
    # Key 2 is new; key 1 is stored; key 3 is new, but its later record sends the value.
    records = [("2", 1, False, 5, MARKER), ("1", 1, False, 6, MARKER), ("3", 1, False, 7, MARKER),
               ("3", 2, False, 8, "sent")]
    aside, reasons = set_aside(records, {"1": (0, 1, "x")}, nulls_kept=False)
    assert aside.tolist() == [True, False, False, False]
    assert reasons == ["unsent value: column 'b' holds unchanged_value '__debezium_unavailable_value' (the source did "
                       "not send it), and no stored row of key {'k': '2'} is there to keep it from (the key is new "
                       "to the table, or deleted earlier in the batch)"]
    assert set_aside(records[1:], {"1": (0, 1, "x")}, nulls_kept=False) is None


@pytest.mark.parametrize("nulls_kept", [True, False])
def test_random_batches_without_their_unsent_records_equal_the_rest_applied_one_by_one(nulls_kept):
    """What is set aside holds the placeholder; the rest folds, as the oracle applies it."""
    rng = random.Random(12)
    aside_drawn = 0
    for _ in range(400):
        stored, records = random_case(rng)
        found = set_aside(records, stored, nulls_kept)
        if found is None:
            continue
        aside_drawn += 1
        assert all(r[4] == MARKER for r, a in zip(records, found[0]) if a)
        rest = [r for r, a in zip(records, found[0]) if not a]
        assert merged(rest, stored, nulls_kept, MARKER) == applied_one_by_one(rest, stored, nulls_kept, MARKER)
    assert aside_drawn > 20


def test_keep_unchanged_takes_string_columns_from_the_stored_rows():
    schema = pa.schema([("n", pa.int64()), ("s", pa.string())])
    old = pa.table({"n": [1, 2], "s": ["old-1", "old-2"]}, schema=schema)
    columns = keep_unchanged([pa.array([7, 8]), pa.array([UNCHANGED, None])], old, schema)
    assert [c.to_pylist() for c in columns] == [[7, 8], ["old-1", None]]


def test_fill_from_stored_takes_unchanged_always_and_nulls_where_kept():
    rows = pa.table({"k": [1, 2], "a": pa.array([None, None], pa.int64()), "s": [UNCHANGED, "new"]})
    stored = pa.table({"k": [1, 2], "a": [10, 20], "s": ["s1", "s2"]})
    out = fill_from_stored(rows, pa.array(["p", "p"]), stored, pa.array(["p", "p"]), ["k"], ["a", "s"],
                           nulls_kept=pa.array([False, True]))
    assert out.column("a").to_pylist() == [None, 20]
    assert out.column("s").to_pylist() == ["s1", "new"]


def test_fill_from_stored_takes_nulls_from_the_row_in_the_named_partition():
    rows = pa.table({"k": [1, 2, 3], "a": [None, 5, None], "b": pa.array([[1], None, None])})
    stored = pa.table({"k": [1, 1, 2, 3], "a": [10, 20, 30, 40], "b": pa.array([[7], [8], [9], None])})
    out = fill_from_stored(rows, pa.array(["p=old", "p=old", "p=gone"]), stored,
                           pa.array(["p=other", "p=old", "p=old", "p=old"]), ["k"], ["a", "b"])
    assert out.column("a").to_pylist() == [20, 5, None]
    assert out.column("b").to_pylist() == [[1], [9], None]
