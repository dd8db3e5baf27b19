"""SQL text for Delta predicates, shared by both engines."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import pyarrow as pa

from sink import columns as C
from sink import keys

# Partitions named in a MERGE's ON clause at most; beyond, the clause names none.
MAX_PARTITION_LITERALS = 2000
# Keys a scan's predicate names at most (`keys_predicate`); beyond, the scan filters nothing.
MAX_KEY_LITERALS = 2000


def quote_ident(name: str) -> str:
    return "`" + name.replace("`", "``") + "`"


def sql_literal(value: str, arrow_type: pa.DataType) -> str:
    """A Delta partition string as a SQL literal of the column's type."""
    if pa.types.is_integer(arrow_type):
        return str(int(value))
    if pa.types.is_boolean(arrow_type):
        return "true" if value.lower() == "true" else "false"
    quoted = "'" + value.replace("'", "''") + "'"
    if pa.types.is_date(arrow_type):
        return f"DATE {quoted}"
    return quoted


def partition_predicate(
    values: Mapping[str, str], types: Mapping[str, pa.DataType], alias: str | None = None
) -> str:
    """`col = literal AND ...` selecting one partition (TRUE for an unpartitioned table). An
    empty value is the null partition (`col IS NULL`): Delta stores an empty string as null."""
    prefix = f"{alias}." if alias else ""
    terms = [f"{prefix}{quote_ident(c)} = {sql_literal(v, types[c])}" if v else f"{prefix}{quote_ident(c)} IS NULL"
             for c, v in values.items()]
    return " AND ".join(terms) if terms else "TRUE"


def partitions_predicate(pids: Sequence[str], types: Mapping[str, pa.DataType]) -> str | None:
    """A scan predicate selecting the partitions `pids` (ids as `keys.partition_id` names
    them); None past MAX_PARTITION_LITERALS, bounded like the MERGE's: the scan reads all."""
    if len(pids) > MAX_PARTITION_LITERALS:
        return None
    return " OR ".join(f"({partition_predicate(keys.partition_values(p), types)})" for p in pids)


def keys_predicate(wanted: Sequence[bytes], key_cols: Sequence[str], types: Mapping[str, pa.DataType]) -> str | None:
    """A scan predicate selecting the rows of the `wanted` keys (encoded, `keys.encode_keys`),
    for a read of a few keys of a partition (a peek, the sampled verification): the scan then
    hands back those rows, not every row's key to encode and compare (10M rows: 0.75 s
    against 0.14 s, measured). None, the scan filters nothing, where a key column is neither
    an integer nor a string (their encoded text is their literal), a key is not of this
    spec, or more than MAX_KEY_LITERALS are wanted. The caller still filters exactly."""
    if not wanted or len(wanted) > MAX_KEY_LITERALS or not all(
            c in types and _named_by_text(types[c]) for c in key_cols):
        return None
    try:
        values = [keys.decode_key(k, key_cols) for k in wanted]
        if len(key_cols) == 1:
            c = key_cols[0]
            literals = ", ".join(sorted({sql_literal(v[c], types[c]) for v in values}))
            return f"{quote_ident(c)} IN ({literals})"
        terms = sorted({" AND ".join(f"{quote_ident(c)} = {sql_literal(v[c], types[c])}" for c in key_cols)
                        for v in values})
    except (ValueError, UnicodeDecodeError):
        return None
    return " OR ".join(f"({t})" for t in terms)


def _named_by_text(kind: pa.DataType) -> bool:
    """A key column whose encoded text is its SQL literal's value."""
    return (pa.types.is_integer(kind) or pa.types.is_string(kind) or pa.types.is_large_string(kind)
            or pa.types.is_string_view(kind))


def merge_predicate(
    key_cols: Sequence[str],
    partition_cols: Sequence[str],
    partitions: Sequence[Mapping[str, str]],
    types: Mapping[str, pa.DataType],
    target: str = "t",
    source: str = "s",
) -> str:
    """ON clause: key and partition equality plus the literal list of partitions to scan.

    The literal list is what lets the engine prune the target scan to the partitions
    the index says hold updated or deleted keys. Above MAX_PARTITION_LITERALS it is left
    out (the MERGE scans every partition): delta-rs crashes on IN-lists of ~30k literals.
    """
    eq = [f"{target}.{quote_ident(c)} = {source}.{quote_ident(c)}" for c in C.distinct(key_cols, partition_cols)]
    if partition_cols:
        if not partitions:
            raise ValueError("a MERGE on a partitioned table needs at least one partition")
        if len(partitions) > MAX_PARTITION_LITERALS:
            return " AND ".join(eq)
        if len(partition_cols) == 1:
            col = partition_cols[0]
            literals = sorted({sql_literal(p[col], types[col]) for p in partitions})
            eq.append(f"{target}.{quote_ident(col)} IN ({', '.join(literals)})")
        else:
            alternatives = sorted({partition_predicate(p, types, target) for p in partitions})
            eq.append("(" + " OR ".join(f"({a})" for a in alternatives) + ")")
    return " AND ".join(eq)
