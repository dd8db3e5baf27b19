import pyarrow as pa
import pytest

from sink.delta_log.predicates import (
    MAX_KEY_LITERALS,
    MAX_PARTITION_LITERALS,
    keys_predicate,
    merge_predicate,
    partition_predicate,
    partitions_predicate,
    sql_literal,
)
from sink.keys import encode_keys, partition_id

TYPES = {"dt": pa.string(), "day": pa.date32(), "n": pa.int32(), "flag": pa.bool_()}


def test_literals_follow_the_column_type():
    assert sql_literal("it's", pa.string()) == "'it''s'"
    assert sql_literal("2025-01-02", pa.date32()) == "DATE '2025-01-02'"
    assert sql_literal("42", pa.int64()) == "42"
    assert sql_literal("true", pa.bool_()) == "true"


def test_an_empty_partition_value_is_the_null_partition():
    assert partition_predicate({"dt": "", "n": "3"}, TYPES) == "`dt` IS NULL AND `n` = 3"


def test_single_partition_column_gets_a_literal_in_list():
    pred = merge_predicate(["id"], ["dt"], [{"dt": "2025-01-02"}, {"dt": "2025-01-01"}, {"dt": "2025-01-02"}], TYPES)
    assert pred == "t.`id` = s.`id` AND t.`dt` = s.`dt` AND t.`dt` IN ('2025-01-01', '2025-01-02')"


def test_several_partition_columns_get_an_or_of_ands():
    pred = merge_predicate(["id"], ["day", "n"], [{"day": "2025-01-01", "n": "3"}], TYPES)
    assert pred.endswith("AND ((t.`day` = DATE '2025-01-01' AND t.`n` = 3))")


def test_unpartitioned_tables_have_no_partition_list():
    assert merge_predicate(["a", "b"], [], [{}], TYPES) == "t.`a` = s.`a` AND t.`b` = s.`b`"


def test_partitioned_merge_without_partitions_is_refused():
    with pytest.raises(ValueError):
        merge_predicate(["id"], ["dt"], [], TYPES)


def test_partition_predicate():
    assert partition_predicate({"dt": "x", "n": "1"}, TYPES) == "`dt` = 'x' AND `n` = 1"
    assert partition_predicate({}, TYPES) == "TRUE"


def test_a_partition_list_above_the_limit_is_left_out_rather_than_crash_delta_rs():
    at_limit = [{"dt": f"p{i}"} for i in range(MAX_PARTITION_LITERALS)]
    assert merge_predicate(["id"], ["dt"], at_limit, TYPES).count("'p") == MAX_PARTITION_LITERALS
    over = at_limit + [{"dt": "one-more"}]
    assert merge_predicate(["id"], ["dt"], over, TYPES) == "t.`id` = s.`id` AND t.`dt` = s.`dt`"


def test_a_scan_of_several_partitions_selects_each_and_reads_all_past_the_bound():
    pids = [partition_id(["dt", "n"], ["2025-01-02", "7"]), partition_id(["dt", "n"], [None, "8"])]
    assert partitions_predicate(pids, TYPES) == \
        "(`dt` = '2025-01-02' AND `n` = 7) OR (`dt` IS NULL AND `n` = 8)"
    assert partitions_predicate(pids * (MAX_PARTITION_LITERALS // 2 + 1), TYPES) is None


def _encoded(rows: list[dict], key_cols: list[str], types: dict) -> list[bytes]:
    table = pa.Table.from_pylist(rows, schema=pa.schema([(c, types[c]) for c in key_cols]))
    return encode_keys(table, key_cols).cast(pa.binary()).to_pylist()


def test_wanted_keys_are_named_as_literals_of_their_columns():
    types = {"id": pa.string(), "n": pa.int64(), "tenant": pa.large_string()}
    assert keys_predicate(_encoded([{"id": "it's"}, {"id": "a"}, {"id": "a"}], ["id"], types), ["id"], types) == (
        "`id` IN ('a', 'it''s')")
    assert keys_predicate(_encoded([{"n": -7}, {"n": 12}], ["n"], types), ["n"], types) == "`n` IN (-7, 12)"
    wanted = _encoded([{"tenant": "x:y", "n": 1}, {"tenant": "b", "n": 22}], ["tenant", "n"], types)
    assert keys_predicate(wanted, ["tenant", "n"], types) == (
        "(`tenant` = 'b' AND `n` = 22) OR (`tenant` = 'x:y' AND `n` = 1)")


def test_keys_that_cannot_be_named_leave_the_scan_unfiltered():
    types = {"id": pa.string(), "n": pa.int64(), "day": pa.date32(), "amount": pa.decimal128(10, 2)}
    assert keys_predicate([], ["id"], types) is None
    assert keys_predicate([b"2025-01-01"], ["day"], types) is None  # its text is not its literal
    assert keys_predicate([b"1.50"], ["amount"], types) is None
    assert keys_predicate([b"k1"], ["missing"], types) is None  # e.g. a tombstone table without it
    assert keys_predicate([b"seven"], ["n"], types) is None  # not a key of this spec
    assert keys_predicate([b"no colon"], ["id", "n"], types) is None
    assert keys_predicate([b"%d" % i for i in range(MAX_KEY_LITERALS + 1)], ["n"], types) is None
    assert keys_predicate([b"%d" % i for i in range(MAX_KEY_LITERALS)], ["n"], types) is not None
