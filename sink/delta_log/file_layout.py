"""What a table's properties ask of the data files a writer adds: which columns carry
statistics, where a file goes, how large it may grow. Read once per batch from the table's
configuration; the sink's file writer (sink.lakehouse.commit.data_files) follows it.

- `delta.dataSkippingStatsColumns` (comma-separated names) or else
  `delta.dataSkippingNumIndexedCols` (the first N leaf columns, -1 for all; 32 by default):
  the columns a file's `minValues`/`maxValues`/`nullCount` cover, as Spark collects them.
- `delta.randomizeFilePrefixes`: files under a random folder of `delta.randomPrefixLength`
  characters (2 by default) instead of their partition's, as Spark writes them for object
  stores that throttle by key prefix.
- `delta.targetFileSize` (bytes, or with a unit: `128mb`): a file larger than that is split,
  by its rows' in-memory size, which Parquet's encoding only shrinks.
"""

from __future__ import annotations

import random
import re
import string
from collections.abc import Collection, Mapping
from dataclasses import dataclass

import pyarrow as pa

DEFAULT_INDEXED_COLUMNS = 32
DEFAULT_PREFIX_LENGTH = 2
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "m": 1 << 20, "mb": 1 << 20, "g": 1 << 30, "gb": 1 << 30}
_SIZE = re.compile(r"^\s*(\d+)\s*([a-z]*)\s*$")


@dataclass(frozen=True)
class FileLayout:
    indexed_columns: int = DEFAULT_INDEXED_COLUMNS
    # Names as the files hold them (physical under column mapping), in lower case: Spark
    # resolves the property's names regardless of case.
    stats_columns: frozenset[str] | None = None
    random_prefix_length: int = 0  # 0: files go under their partition's folder
    target_file_size: int | None = None

    @classmethod
    def of(cls, configuration: Mapping[str, str], physical: Mapping[str, str] | None = None) -> FileLayout:
        """The layout a table's `configuration` asks for; `physical`: its column mapping's
        physical names, which the files' statistics use."""
        named = configuration.get("delta.dataSkippingStatsColumns")
        stats_columns = None
        if named is not None:
            names = (n.strip().strip("`").lower() for n in named.split(","))
            in_files = {c.lower(): p for c, p in (physical or {}).items()}
            stats_columns = frozenset(in_files.get(n, n).lower() for n in names if n)
        prefix = 0
        if configuration.get("delta.randomizeFilePrefixes", "false").lower() == "true":
            prefix = integer_property(configuration, "delta.randomPrefixLength", DEFAULT_PREFIX_LENGTH, least=1)
        return cls(integer_property(configuration, "delta.dataSkippingNumIndexedCols", DEFAULT_INDEXED_COLUMNS,
                                    least=-1),
                   stats_columns, prefix, byte_size(configuration.get("delta.targetFileSize")))

    def stats_fields(self, schema: pa.Schema, skip: Collection[str] = ()) -> list[pa.Field]:
        """The fields of a file's `schema` (not counting `skip`, the partition columns) whose
        statistics the table asks for."""
        fields = [f for f in schema if f.name not in skip]
        if self.stats_columns is not None:
            return [f for f in fields if f.name.lower() in self.stats_columns]
        if self.indexed_columns < 0:
            return fields
        chosen, left = [], self.indexed_columns
        for f in fields:
            if left <= 0:
                break
            chosen.append(f)
            left -= leaf_count(f.type)
        return chosen

    def folder(self, partition_folder: str) -> str:
        """Where a new file goes: a random prefix, or its partition's folder."""
        if not self.random_prefix_length:
            return partition_folder
        return "".join(random.choices(string.ascii_letters + string.digits, k=self.random_prefix_length)) + "/"

    def split(self, rows: pa.Table) -> list[pa.Table]:
        """`rows` as the files to write: one, or pieces of about the target size."""
        if self.target_file_size is None or rows.nbytes <= self.target_file_size or rows.num_rows < 2:
            return [rows]
        pieces = min(rows.num_rows, -(-rows.nbytes // self.target_file_size))
        step = -(-rows.num_rows // pieces)
        return [rows.slice(start, step) for start in range(0, rows.num_rows, step)]


def leaf_count(t: pa.DataType) -> int:
    """Columns a type counts for `dataSkippingNumIndexedCols`: a struct its leaves, any other one."""
    if pa.types.is_struct(t):
        return sum(leaf_count(t.field(i).type) for i in range(t.num_fields))
    return 1


def byte_size(value: str | None) -> int | None:
    """`delta.targetFileSize` in bytes (`134217728`, `128mb`); None where unset or unreadable."""
    m = _SIZE.match((value or "").lower())
    if m is None or m[2] not in _UNITS or int(m[1]) <= 0:
        return None
    return int(m[1]) * _UNITS[m[2]]


def integer_property(configuration: Mapping[str, str], key: str, default: int, *, least: int) -> int:
    """A table property holding a whole number of at least `least`; `default` where it is
    unset or holds anything else (its other writers refuse such a value, the sink need not)."""
    try:
        number = int(configuration.get(key) or default)
    except ValueError:
        return default
    return number if number >= least else default


DEFAULT_LAYOUT = FileLayout()  # a table that sets none of the properties
