"""A primary key change under PostgreSQL's default replica identity: Debezium sends a delete of
the old key and a create of the new one whose unchanged TOASTed values are its placeholder
(`__debezium_unavailable_value`), the old key in the create's `__debezium.oldkey` header.
The new key never had those values, but the old key did: they are taken from the old key's
latest values, in the batch (its records before the change, in ordering) or else in the Delta
table (before the commit that deleted it, when the change's delete came in an earlier batch),
so the table equals the source without `REPLICA IDENTITY FULL`. A create whose old key
is known nowhere keeps the placeholder, and the job's guard quarantines it.

Each batch's schema pass says whether any message holds both the header and the placeholder
(most batches: none, and nothing more is read); the creates and the old keys' records are then
collected on the driver (a few rows), resolved in ordering order (a key changed twice in one
batch follows its chain), and joined back.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import pyarrow.compute as pc
from deltalake import DeltaTable
from pyspark.sql import DataFrame
from pyspark.sql import functions as F
from pyspark.sql.types import StringType, StructField, StructType

from sink.keys import quoted_column
from sink.routing import sql_string

HEADER = "__debezium.oldkey"
# The old key's JSON text, carried from the message's headers through the envelope's flattening.
OLD_KEY = "__debezium_oldkey"
OLD_KEY_SQL = f"CAST(try_element_at(filter(headers, h -> h.key = {sql_string(HEADER)}), 1).value AS STRING)"
_RESOLVED = "__debezium_resolved"
# How many table versions back an old key's values are looked for.
LOOKBACK = 30


def flag_sql(placeholder: str) -> str:
    """SQL over Kafka rows (read with headers): a message that changed its key and holds the
    placeholder."""
    return f"coalesce({OLD_KEY_SQL} IS NOT NULL AND instr(CAST(value AS STRING), {sql_string(placeholder)}) > 0, false)"


def resolved(records: DataFrame, *, key: Sequence[str], ordering: str, placeholder: str,
             table_uri: str) -> DataFrame:
    """`records` (flattened Debezium events with OLD_KEY) with each key change's create's
    placeholders replaced by its old key's values, where known."""
    texts = [f.name for f in records.schema.fields
             if isinstance(f.dataType, StringType) and f.name not in (*key, OLD_KEY, "op")]
    held = " OR ".join(f"{quoted_column(c)} = {sql_string(placeholder)}" for c in texts) or "false"
    creates = records.where(f"op = 'c' AND {OLD_KEY} IS NOT NULL AND ({held})").collect()
    if not creates:
        return records
    columns = [*key, ordering, "op", *texts]
    old_keys = {_key_of(json.loads(r[OLD_KEY]), key) for r in creates}
    wanted = records.sparkSession.createDataFrame([list(k) for k in old_keys],
                                                  StructType([records.schema[k] for k in key]))
    history = records.join(F.broadcast(wanted), list(key), "left_semi").select(*columns).collect()
    stored = _stored(table_uri, key, texts, old_keys)
    events = sorted([*((r, None) for r in history), *((r, _key_of(json.loads(r[OLD_KEY]), key)) for r in creates)],
                    key=lambda e: e[0][ordering])
    last: dict[tuple, dict] = {}  # each key's latest values so far (a delete keeps them: its key may move)
    fixes = []
    for row, old in events:
        if row["op"] == "d":
            continue
        k = _key_of(row, key)
        came_from = old if old is not None else k
        base = last.get(came_from, stored.get(came_from, {}))
        last[k] = values = {c: base.get(c) if row[c] == placeholder else row[c] for c in texts}
        if old is not None:
            fixes.append([*k, row[ordering], *(values[c] if row[c] == placeholder else None for c in texts)])
    fix_schema = StructType([*(records.schema[k] for k in key), records.schema[ordering],
                             *(StructField(f"{_RESOLVED}{i}", StringType()) for i in range(len(texts)))])
    fix = records.sparkSession.createDataFrame(fixes, fix_schema)
    joined = records.join(F.broadcast(fix), [*key, ordering], "left")
    out = [F.coalesce(F.col(f"{_RESOLVED}{texts.index(c)}"), F.col(quoted_column(c))).alias(c) if c in texts
           else F.col(quoted_column(c)) for c in records.columns]
    return joined.select(*out)


def _key_of(row, key: Sequence[str]) -> tuple:
    return tuple(row[k] for k in key)


def _stored(table_uri: str, key: Sequence[str], texts: list[str], keys: set[tuple]) -> dict[tuple, dict]:
    """The Delta table's latest values of `texts` for `keys`: at its current version, or, for
    a key whose delete an earlier batch committed (the key change's delete and create fell in
    two batches, or two Kafka partitions), at the newest of the LOOKBACK versions before that
    held it. None where the table does not exist."""
    if not DeltaTable.is_deltatable(table_uri):
        return {}
    table = DeltaTable(table_uri)
    found: dict[tuple, dict] = {}
    for version in range(table.version(), max(-1, table.version() - LOOKBACK), -1):
        missing = keys - found.keys()
        if not missing:
            break
        if version != table.version():
            table.load_as_version(version)
        dataset = table.to_pyarrow_dataset()
        present = [c for c in texts if c in dataset.schema.names]
        wanted = None
        for i, k in enumerate(key):
            condition = pc.field(k).isin(sorted({v[i] for v in missing}))
            wanted = condition if wanted is None else wanted & condition
        for r in dataset.to_table(columns=[*key, *present], filter=wanted).to_pylist():
            if _key_of(r, key) in missing:
                found[_key_of(r, key)] = {c: r[c] for c in present}
    return found
