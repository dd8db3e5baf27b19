import numpy as np
import pyarrow as pa

from sink.tagging.placement import place_deletes, unplaced_deletes

NULL = "m="


def test_unplaced_deletes_are_deletes_with_any_null_partition_column():
    rows = pa.table({"m": ["a", None, None, "b", "c"], "n": [1, 1, None, None, 2]})
    deletes = pa.array([True, True, False, True, None])
    assert unplaced_deletes(rows, ["m", "n"], deletes).tolist() == [False, True, False, True, False]
    assert unplaced_deletes(rows, [], deletes).tolist() == [False] * 5


def place(keys, pids, deletes, live):
    unplaced = np.array([p is None and d for p, d in zip(pids, deletes)])
    return place_deletes(pa.array(keys, pa.string()), pa.array(pids, pa.string()), unplaced, np.array(deletes),
                         live, NULL, ["m"])


def test_a_delete_goes_where_its_key_lives_and_nowhere_means_the_null_partition():
    placement = place(["a", "b", "c"], [None, None, "m=1"], [True, True, False], [["m=2"], []])
    assert placement.pids.to_pylist() == ["m=2", NULL, "m=1"]
    assert (placement.located, placement.unknown, placement.ambiguous.tolist()) == (1, 1, [False, False, False])


def test_the_batchs_own_upserts_of_the_key_count_as_where_it_lives():
    # "a" is stored nowhere but this batch upserts it in m=3; "b" is stored in m=1 and upserted in m=1 again.
    placement = place(["a", "a", "b", "b"], [None, "m=3", None, "m=1"], [True, False, True, False],
                      [[], ["m=1"]])
    assert placement.pids.to_pylist() == ["m=3", "m=3", "m=1", "m=1"]
    assert placement.located == 2


def test_a_key_in_several_partitions_is_ambiguous_with_a_reason_naming_them():
    placement = place(["a", "a", "b"], [None, "m=3", None], [True, False, True], [["m=1"], ["m=1", "m=2"]])
    assert placement.ambiguous.tolist() == [True, False, True]
    assert placement.reasons == [
        "ambiguous delete without a partition: null m, and the key has rows in 2 partitions (m=1, m=3); "
        "scope = 'global' keeps one row per key",
        "ambiguous delete without a partition: null m, and the key has rows in 2 partitions (m=1, m=2); "
        "scope = 'global' keeps one row per key"]
    assert (placement.located, placement.unknown) == (0, 0)
