"""The tombstone table's upkeep: one row per key, and deletes past `tombstone_ttl_hours` dropped.

Every batch appends its deletes (one row per key and batch), so the table grows with every
delete. Compaction rewrites it in one overwrite commit: the rows of batches the target
table holds shrink to the newest per `SinkConfig.tombstone_key` (per key and partition in
partitioned scope: what a partition load reads; every delete of a history table), minus
those expired under the TTL; rows of batches not committed
yet are kept as they are. A batch appending meanwhile is not lost: the overwrite removes
only the files it read.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from deltalake import CommitProperties, DeltaTable, write_deltalake

from sink.config import SinkConfig
from sink.index.loader import TOMBSTONE_DELETED_AT, committed, expired_rows
from sink.ordering import columns_of


@dataclass(frozen=True)
class Compaction:
    rows_before: int
    rows_after: int
    expired: int  # newest rows of their key, older than the TTL
    superseded: int  # older rows of a key with a newer one
    pending: int  # rows of batches the table does not hold yet, kept as they are
    version: int | None  # the tombstone table's version after the rewrite (None: nothing to rewrite)


def latest_per_key(rows: pa.Table, key_cols: Sequence[str], ordering: str | Sequence[str]) -> pa.Table:
    """One row per distinct `key_cols`: the one with the highest `ordering` (columns compared
    in order), then the latest deleted-at (when the rows have it), then the first in input
    order; in input order."""
    if rows.num_rows < 2:
        return rows
    position = "__position"
    ranking = [(c, "descending") for c in columns_of(ordering)]
    if TOMBSTONE_DELETED_AT in rows.column_names:
        ranking.append((TOMBSTONE_DELETED_AT, "descending"))
    ranked = rows.select(list(dict.fromkeys([*key_cols, *(c for c, _ in ranking)]))).append_column(
        position, pa.array(np.arange(rows.num_rows)))
    ranked = ranked.sort_by([*ranking, (position, "ascending")])
    kept = ranked.group_by(list(key_cols), use_threads=False).aggregate([(position, "first")])
    first = kept.column(f"{position}_first")
    return rows.take(pc.take(first, pc.sort_indices(first)))


def compact(cfg: SinkConfig, now: float) -> Compaction | None:
    """Compact `cfg`'s tombstone table as of `now`; None when there is none."""
    uri = cfg.resolved_tombstone_uri
    if not DeltaTable.is_deltatable(uri):
        return None
    table = DeltaTable(cfg.table_uri)  # read first: a batch committing later stays pending
    tombstones = DeltaTable(uri)
    rows = pa.table(tombstones.to_pyarrow_table())
    done = committed(table, rows)
    pending, held = rows.filter(pc.invert(done)), rows.filter(done)
    newest = latest_per_key(held, cfg.tombstone_key, cfg.ordering_columns)
    kept = newest.filter(pc.invert(expired_rows(newest, cfg.tombstone_ttl_seconds, now)))
    report = Compaction(rows.num_rows, pending.num_rows + kept.num_rows, newest.num_rows - kept.num_rows,
                        held.num_rows - newest.num_rows, pending.num_rows, None)
    if report.rows_after == report.rows_before:
        return report
    write_deltalake(tombstones, pa.concat_tables([pending, kept]).cast(rows.schema), mode="overwrite",
                    partition_by=list(cfg.partition_by) or None,
                    commit_properties=CommitProperties(custom_metadata={"upsert_sink.operation": "compact tombstones"}))
    tombstones.update_incremental()
    return Compaction(**{**report.__dict__, "version": tombstones.version()})
