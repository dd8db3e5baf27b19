"""A stored data file's rows, read column by column as a batch needs them (`StoredRows`): from
memory when this process wrote the file lately (`file_cache.WRITTEN`), else from its Parquet
(`HeldParquet`), its probe columns from memory when held (`file_cache.PROBED`); and the keys
compared (`row_keys`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from sink import keys
from sink.delta_log.column_mapping import ColumnMapping
from sink.lakehouse.commit import file_cache, key_locator
from sink.lakehouse.commit.key_locator import KeyLocator


class StoredRows:
    """One data file's rows in the table's `schema`, read column by column as they are needed
    (a merge-on-read batch needs a file's keys and orderings, not the rest of its bytes), each
    column once; partition columns take the log's `values` (delta-rs' files do not hold them,
    Delta's Spark engine writes them too). `source` is the file's Parquet, or its rows as this
    process wrote them (`file_cache`); under a column `mapping` its columns are read by their
    names in the file (physical names, or field ids: a rename since changes neither)."""

    def __init__(self, source: pq.ParquetFile | pa.Table | HeldParquet, schema: pa.Schema,
                 values: Mapping[str, str | None], mapping: ColumnMapping | None):
        in_file = source.schema if isinstance(source, pa.Table) else source.schema_arrow
        self._source = source
        self._names = {c: c for c in in_file.names} if mapping is None else mapping.file_columns(in_file)
        self._schema = schema
        self._values = values
        self._columns: dict[str, pa.ChunkedArray] = {}
        self.num_rows = source.num_rows if isinstance(source, pa.Table) else source.metadata.num_rows
        # A marked file's stats are its footer's (`_wide_stats`): read once.
        self.metadata = None if isinstance(source, pa.Table) else source.metadata

    def read(self, columns: Sequence[str] | None = None, rows: np.ndarray | None = None) -> pa.Table:
        """The table's `columns` (None: all of them), every physical row or those at `rows`."""
        columns = self._schema.names if columns is None else list(columns)
        self.fetch(columns)
        return pa.table([self._column(self._schema.field(c), rows) for c in columns],
                        schema=pa.schema([self._schema.field(c) for c in columns]))

    def fetch(self, columns: Sequence[str]) -> None:
        """Have the table's `columns` in memory, read once."""
        missing = self._missing(columns)
        if missing:
            self._columns.update(zip(missing, self._fetch([self._names[c] for c in missing])))

    def reads_parquet(self, columns: Sequence[str]) -> bool:
        """Whether reading the table's `columns` takes a read of its Parquet."""
        held = self.held
        return isinstance(self._source, HeldParquet) and not (
            held is not None and all(self._names[c] in held.columns for c in self._missing(columns)))

    def _missing(self, columns: Sequence[str]) -> list[str]:
        """Of `columns`, those the file holds that are not read yet."""
        return [c for c in columns if c not in self._values and c in self._names and c not in self._columns]

    @property
    def held(self) -> file_cache.ProbedColumns | None:
        """Its probe entry, when held (`hold`)."""
        return self._source.held if isinstance(self._source, HeldParquet) else None

    @property
    def locator(self) -> KeyLocator | None:
        """Its keys sorted, when held."""
        return self.held.locator if self.held is not None else None

    def values(self, name: str) -> np.ndarray | None:
        """Column `name` as read (`fetch`), as a numpy view on its buffer, when it is one chunk
        of the table's fixed-width type without nulls."""
        column = self._columns.get(name)
        kind = self._schema.field(name).type
        if (column is None or column.num_chunks != 1 or column.type != kind or column.null_count
                or not pa.types.is_primitive(kind) or pa.types.is_boolean(kind)):
            return None
        return column.chunk(0).to_numpy()

    def keys(self, key_cols: Sequence[str]) -> pa.Array:
        """Its rows' keys (`row_keys` of `key_cols`, none a partition column): as its probe entry
        holds them, when in the table's types (a small file's, hashed every batch)."""
        held = self.held.columns if self.held is not None else {}
        columns = [held.get(self._names.get(c, "")) for c in key_cols]
        if all(c is not None and c.type == self._schema.field(k).type for c, k in zip(columns, key_cols)):
            return row_keys(pa.Table.from_arrays(columns, names=list(key_cols)), key_cols)
        return row_keys(self.read(key_cols), key_cols)

    def hold(self, key_cols: Sequence[str], ordering: Sequence[str], *, keys_merged: bool = False) -> None:
        """Keep what probing the file again takes in `file_cache.PROBED`, when it was read from
        Parquet: its `ordering` columns (as far as read) and its keys, the second time sorted
        (`KeyLocator`: a file probed twice is likely probed by every batch) when it is searched
        (`key_locator.SEARCHED_ROWS`), unless they are held with its partition's (`keys_merged`)."""
        if not isinstance(self._source, HeldParquet):
            return
        held = self._source.held
        columns = dict(held.columns) if held is not None else {}
        locator = held.locator if held is not None else None
        names = [self._names[c] for c in key_cols]
        if (locator is None and held is not None and self.num_rows >= key_locator.SEARCHED_ROWS and not keys_merged
                and all(n in columns for n in names)):
            locator = KeyLocator.of(row_keys(self.read(key_cols), key_cols))
        keyed = locator is not None or keys_merged
        added = {self._names[c]: one_chunk(self._columns[c]) for c in [*key_cols, *ordering]
                 if c in self._columns and self._names[c] not in columns and not (keyed and c in key_cols)}
        if held is not None and locator is held.locator and not added:
            return
        columns = {n: c for n, c in {**columns, **added}.items() if locator is None or n not in names}
        file_cache.PROBED.put(self._source.location, held.replaced(columns, locator) if held is not None else
                              file_cache.ProbedColumns(self._source.schema_arrow, self.metadata, columns, locator))

    def _fetch(self, names: list[str]) -> list[pa.ChunkedArray]:
        if isinstance(self._source, pa.Table):
            return self._source.select(names).columns
        # One thread per file: the caller already reads a file per core (its thread pool, or
        # one Spark task per core); Arrow's reader threads on top of it cost the rewrite of
        # an events batch at 5M rows a tenth of its wall time (measured).
        return self._source.read(columns=names, use_threads=False).columns

    def _column(self, f: pa.Field, rows: np.ndarray | None) -> pa.Array | pa.ChunkedArray:
        n = self.num_rows if rows is None else len(rows)
        if f.name in self._values:  # one scalar repeated, not a list of n values: 3% of a rewrite
            return pa.repeat(pa.scalar(self._values[f.name], pa.string()), n).cast(f.type)
        if f.name in self._columns:
            column = self._columns[f.name]
            if rows is None:
                return column.cast(f.type)
            # Rows first where the types agree; a file's own type (delta-rs writes string_view,
            # which `take` has no kernel for) is cast whole first.
            return column.take(rows) if column.type == f.type else column.cast(f.type).take(rows)
        return pa.nulls(n, f.type)  # a column added since the file was written


class HeldParquet:
    """A data file's Parquet, read where its probe columns (`file_cache.PROBED`, when held) do
    not hold a column. The file is open only while a read runs (its footer read once): a
    partition's files are decided together (`file_changes`), and a partition of many small
    files must not hold a descriptor for each."""

    def __init__(self, fs: pafs.FileSystem, location: str):
        self.location = location
        self.held = file_cache.PROBED.get(location)
        self._fs = fs
        self._metadata: pq.FileMetaData | None = None if self.held is None else self.held.metadata

    @property
    def schema_arrow(self) -> pa.Schema:
        return self.held.schema if self.held is not None else self.metadata.schema.to_arrow_schema()

    @property
    def metadata(self) -> pq.FileMetaData:
        if self._metadata is None:
            with self._fs.open_input_file(self.location) as stream:
                self._metadata = pq.ParquetFile(stream).metadata
        return self._metadata

    def read(self, columns: Sequence[str], use_threads: bool = False) -> pa.Table:
        held = self.held.columns if self.held is not None else {}
        rest = [c for c in columns if c not in held]
        read = None
        if rest:
            with self._fs.open_input_file(self.location) as stream:
                read = pq.ParquetFile(stream, metadata=self._metadata).read(columns=rest, use_threads=use_threads)
        return pa.table({c: held[c] if c in held else read.column(c) for c in columns})


def one_chunk(column: pa.ChunkedArray) -> pa.ChunkedArray:
    """A column held for later batches, in one chunk: numpy reads it without a copy
    (`StoredRows.values`)."""
    return column if column.num_chunks == 1 else pa.chunked_array([column.combine_chunks()], column.type)


def row_keys(rows: pa.Table, key_cols: Sequence[str]) -> pa.Array:
    """Comparable keys: the column itself for one key column, the encoded key for several."""
    if len(key_cols) == 1:
        column = rows.column(key_cols[0])
        return column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    return keys.encode_keys(rows, key_cols)
