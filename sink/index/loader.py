"""Reading one partition's index entries (this shard's keys only) from the Delta tables."""

from __future__ import annotations

from collections.abc import Sequence

import pyarrow as pa
import pyarrow.compute as pc
from deltalake import DeltaTable

from sink import keys
from sink.index.entry import Entry
from sink.lakehouse.predicates import partition_predicate


def read_partition(
    table: DeltaTable,
    tombstones: DeltaTable | None,
    pid: str,
    key_cols: Sequence[str],
    ordering: str,
    shard: int,
    num_shards: int,
) -> tuple[list[bytes], list[Entry]]:
    """Entries of partition `pid` for `shard`: live rows of `table` at its loaded version,
    overlaid with tombstones newer than the row (or of keys the table lacks)."""
    types = {f.name: f.type for f in pa.schema(table.schema().to_arrow())}
    predicate = partition_predicate(keys.partition_values(pid), types)
    entries = _read_entries(table, predicate, key_cols, ordering, shard, num_shards)
    result = {k: Entry(o, False) for k, o in entries}
    if tombstones is not None:
        for k, o in _read_entries(tombstones, predicate, key_cols, ordering, shard, num_shards):
            current = result.get(k)
            # Equal ordering: the row stands (a delete that won a tie would have removed it).
            if current is None or o > current.ordering:
                result[k] = Entry(o, True)
    return list(result.keys()), list(result.values())


def _read_entries(dt, predicate, key_cols, ordering, shard, num_shards) -> list[tuple[bytes, int]]:
    columns = [*key_cols, ordering]
    data = pa.table(dt.scan(columns=columns, predicate=predicate))
    if data.num_rows == 0:
        return []
    data = pa.table({c: _plain(data.column(c)) for c in columns})
    encoded = keys.encode_keys(data, key_cols)
    in_shard = pc.equal(keys.shards_of(encoded, num_shards), shard)
    encoded = encoded.filter(in_shard)
    orderings = keys.ordering_values(data.column(ordering).combine_chunks().filter(in_shard))
    return [(k.encode(), o) for k, o in zip(encoded.to_pylist(), orderings.to_pylist())]


def _plain(col: pa.ChunkedArray) -> pa.ChunkedArray:
    """delta-rs scans give string_view; the key functions expect plain strings."""
    if pa.types.is_string_view(col.type) or pa.types.is_large_string(col.type):
        return col.cast(pa.string())
    return col
