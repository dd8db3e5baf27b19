"""A table with `delta.appendOnly = true` takes inserts only (PROTOCOL.md "Append-only
Tables"): a key whose records would update or delete its stored row is set aside inside the
tagging task, all its records in the batch, and the shard tagged again without them, so the
table gets their inserts only; they go to quarantine with a reason naming the key
(append_only_changes = "quarantine"), or fail the batch (AppendOnlyError, "fail")."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from sink.errors import AppendOnlyError
from sink.tagging.classify import DELETE, UPDATE

_CHANGES = pa.array([UPDATE, DELETE])


def stored_row_changes(rows: pa.Table, groups: pa.Array, write: pa.Array, *, key_cols: Sequence[str], table_uri: str,
                       fails: bool) -> tuple[np.ndarray, list[str]] | None:
    """The records to set aside (a mask), and why; None: no key changes a stored row.
    `groups`: each record's key (with its partition where keys are unique per partition);
    `write`: what each key's last record writes. `fails`: AppendOnlyError instead."""
    changing = pc.fill_null(pc.is_in(write, _CHANGES), False)
    if not pc.any(changing).as_py():
        return None
    kinds = dict(zip(groups.filter(changing).to_pylist(), write.filter(changing).to_pylist()))
    aside = pc.is_in(groups, pa.array(list(kinds), groups.type)).to_numpy(zero_copy_only=False)
    at = np.flatnonzero(aside)
    named = groups.take(pa.array(at)).to_pylist()
    keys_ = rows.select(list(key_cols)).take(pa.array(at)).to_pylist() if key_cols else named
    reasons = [f"append-only table: the key's records would {kinds[g]} its stored row {k!r} ({table_uri} has "
               "delta.appendOnly = true: inserts only)" for g, k in zip(named, keys_)]
    if fails:
        raise AppendOnlyError(f"{reasons[0]}; append_only_changes = 'fail': nothing was written")
    return aside, reasons
