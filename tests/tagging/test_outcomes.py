"""What a tagging task counts for the driver, which may never see the records."""

import random

import pyarrow as pa

from sink import columns as C
from sink.tagging.outcomes import OUTCOMES, keys_in_several_partitions, record_partitions, summary


def records(rows):
    """(key, partition, op, write, hit, reason) rows as a tagging task outputs them."""
    names = [C.KEY, "dt", C.OP, C.WRITE, C.HIT, C.REASON]
    types = [pa.string(), pa.string(), pa.string(), pa.string(), pa.bool_(), pa.string()]
    return pa.table([pa.array([r[i] for r in rows], t) for i, t in enumerate(types)], names=names)


ROWS = [
    ("a", "d1", "insert", None, False, None),  # superseded by the update below
    ("a", "d1", "update", "insert", None, None),
    ("b", "d1", "update", "update", True, None),
    ("b", "d2", "update", "update", True, None),  # b again, in another partition
    ("c", "d2", "stale", None, True, None),
    ("d", None, "delete", "tombstone", False, None),
    ("e", None, "quarantined", None, None, "null partition column dt"),
    (None, "d1", "quarantined", None, None, "null key column id"),
]


def test_a_tasks_counts_are_what_the_driver_would_count_from_the_records():
    tagged = records(ROWS)
    pids = record_partitions(tagged, ["dt"], "partitioned")
    got = summary(tagged, pids, "partitioned", ["dt"])
    assert set(got["ops"]) == set(OUTCOMES)
    assert {k: v for k, v in got["ops"].items() if v} == {"insert": 1, "update": 2, "delete_missing": 1, "stale": 1,
                                                          "superseded": 1, "quarantined": 2}
    assert (got["hits"], got["misses"]) == (3, 2)
    assert sorted(got["pids"]) == sorted(["dt=d1", "dt=d2", pids[5].as_py()])  # the null partition's id too
    assert got["upserts_without_partition"] == 1
    assert (got["keys_in_several_partitions"], got["several_partitions_example"]) == (1, ["b", ["dt=d1", "dt=d2"]])


def test_global_scope_counts_no_key_in_several_partitions():
    tagged = records(ROWS[:4])
    got = summary(tagged, record_partitions(tagged, ["dt"], "global"), "global", ["dt"])
    assert got["keys_in_several_partitions"] == 0 and got["several_partitions_example"] is None


def test_keys_in_several_partitions_counts_against_a_plain_count():
    rng = random.Random(5)
    rows = [(f"k{rng.randrange(300)}", f"d{rng.randrange(3)}", "update", "update", True,
             "bad" if rng.random() < 0.05 else None) for _ in range(400)]
    tagged = records(rows)
    several, example = keys_in_several_partitions(tagged, record_partitions(tagged, ["dt"], "partitioned"))
    named: dict[str, set] = {}
    for key, dt, *_, reason in rows:
        if reason is None:
            named.setdefault(key, set()).add(f"dt={dt}")
    spread = {k: sorted(p) for k, p in named.items() if len(p) > 1}
    assert several == len(spread) > 0
    assert example[0] in spread and example[1] == spread[example[0]]
    assert keys_in_several_partitions(tagged.slice(0, 0), record_partitions(tagged.slice(0, 0), ["dt"],
                                                                               "partitioned")) == (0, None)
