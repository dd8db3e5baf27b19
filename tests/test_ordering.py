import itertools

import numpy as np
import pyarrow as pa

from sink.delta_log.predicates import quote_ident
from sink.ordering import arrow_greater, equal, less, newer_sql

VALUES = list(itertools.product([1, 2], [1, 2], [1, 2]))  # every (a, b, c) pair of triples below


def test_less_and_equal_compare_column_by_column_like_tuples():
    pairs = list(itertools.product(VALUES, VALUES))
    a = np.array([p[0] for p in pairs])
    b = np.array([p[1] for p in pairs])
    assert less(a, b).tolist() == [x < y for x, y in pairs]
    assert equal(a, b).tolist() == [x == y for x, y in pairs]


def test_arrow_greater_compares_like_tuples_and_is_null_on_nulls():
    pairs = list(itertools.product(VALUES, VALUES))
    a = [pa.array([p[0][i] for p in pairs]) for i in range(3)]
    b = [pa.array([p[1][i] for p in pairs]) for i in range(3)]
    assert arrow_greater(a, b).to_pylist() == [x > y for x, y in pairs]
    assert arrow_greater([pa.array([None])], [pa.array([1])]).to_pylist() == [None]


def test_newer_sql_reads_as_a_tuple_comparison():
    assert newer_sql(["ts"], quote_ident, True) == "t.`ts` <= s.`ts`"
    assert newer_sql(["ts", "seq"], quote_ident, False) == \
        "(t.`ts` < s.`ts` OR (t.`ts` = s.`ts` AND t.`seq` < s.`seq`))"
