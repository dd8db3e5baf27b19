import pyarrow as pa
import pytest

from sink.delta_log.predicates import (
    MAX_PARTITION_LITERALS,
    merge_predicate,
    partition_predicate,
    partitions_predicate,
    sql_literal,
)
from sink.keys import partition_id

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
