"""Ordering by several columns (`ordering = ["a", "b"]`): values compared in order, the first
column first, the next one only on a tie (AUTO CDC's `SEQUENCE BY STRUCT(a, b)`, Paimon's
`sequence.field` lists).

Every path holds a record's ordering as one int64 per column (`keys.ordering_values`):
numpy rows of shape (n, width) in tagging and the index entries, one Arrow column per
ordering column in loads, and SQL over the stored columns in the MERGE guard.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from sink import columns as C


def columns_of(ordering: str | Sequence[str]) -> list[str]:
    """The ordering columns of an `ordering` value: one column's name, or several in order."""
    return [ordering] if isinstance(ordering, str) else list(ordering)


def helper_columns(width: int) -> list[str]:
    """The batch's helper columns carrying the ordering values (one per ordering column)."""
    return [C.ORDERING] + [f"{C.ORDERING}_{i}" for i in range(1, width)]


def less(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Row-wise a < b of (n, width) int64 arrays, compared column by column."""
    result = np.zeros(len(a), bool)
    tied = np.ones(len(a), bool)
    for i in range(a.shape[1]):
        result |= tied & (a[:, i] < b[:, i])
        tied &= a[:, i] == b[:, i]
    return result


def equal(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.all(a == b, axis=1)


def stack(arrays: Sequence[pa.Array | pa.ChunkedArray]) -> np.ndarray:
    """Aligned int64 columns as one (n, width) array."""
    return np.column_stack([np.asarray(a.to_numpy(zero_copy_only=False), np.int64) for a in arrays])


def arrow_greater(a: Sequence[pa.ChunkedArray | pa.Array], b: Sequence[pa.ChunkedArray | pa.Array]):
    """Row-wise a > b of aligned Arrow int64 columns (null where a value is null)."""
    result = pc.greater(a[-1], b[-1])
    for x, y in zip(reversed(a[:-1]), reversed(b[:-1])):
        result = pc.or_kleene(pc.greater(x, y), pc.and_kleene(pc.equal(x, y), result))
    return result


def newer_sql(columns: Sequence[str], quote, incoming_wins_ties: bool, target: str = "t", source: str = "s") -> str:
    """SQL: the source row's ordering is newer than the target's (or equal, when incoming
    records win ties), column by column."""
    last = "<=" if incoming_wins_ties else "<"
    clause = f"{target}.{quote(columns[-1])} {last} {source}.{quote(columns[-1])}"
    for c in reversed(columns[:-1]):
        t, s = f"{target}.{quote(c)}", f"{source}.{quote(c)}"
        clause = f"({t} < {s} OR ({t} = {s} AND {clause}))"
    return clause
