"""Identity values: where a batch's new rows start, and how writers share them out."""

import pyarrow as pa
import pytest

from sink.delta_log.identity import IdentityColumn, IdentityValues


@pytest.mark.parametrize("start, step, mark, first", [
    (1, 1, None, 1),  # nothing generated yet: the start
    (10, 3, 16, 19),  # the mark is a value of the column
    (10, 3, 17, 19),  # a mark between values (an explicit insert): the next value above it
    (0, -2, -4, -6),  # a negative step goes down
    (10, 3, 4, 10),  # a mark below the start: never before the start
])
def test_the_first_new_value_is_the_next_one_beyond_the_mark(start, step, mark, first):
    c = IdentityColumn("n", start, step, mark)
    assert c.value(c.first_k()) == first


def rows(n: int) -> pa.Table:
    return pa.table({"id": [f"k{i}" for i in range(n)], "n": pa.nulls(n, pa.int64())})


def test_writers_sharing_out_values_never_give_one_twice_and_report_the_furthest():
    c = IdentityColumn("n", 10, 3, 16)
    tasks = [IdentityValues([c], stride=3, offset=i) for i in range(3)]
    given = [tasks[0].fill(rows(4)), tasks[1].fill(rows(2)), tasks[0].fill(rows(1)), tasks[2].fill(rows(0))]
    values = [v for t in given for v in t.column("n").to_pylist()]
    assert len(set(values)) == len(values) == 7
    assert all(v > 16 and (v - 10) % 3 == 0 for v in values)
    assert tasks[0].high() == {"n": max(given[0]["n"].to_pylist() + given[2]["n"].to_pylist())}
    assert tasks[2].high() == {}  # gave none: raises nothing


def test_one_writer_gives_consecutive_values():
    values = IdentityValues([IdentityColumn("n", 1, 1, 5)])
    assert values.fill(rows(3)).column("n").to_pylist() == [6, 7, 8]
    assert values.fill(rows(2)).column("n").to_pylist() == [9, 10]
    assert values.high() == {"n": 10}
