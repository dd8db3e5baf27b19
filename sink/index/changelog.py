"""The index changelog: for each commit of this sink, the index entries it changed, by shard.

A shard's tagging task stages its batch's entries in the replica of the executor it ran
on. When the shard's next task runs on another executor, that replica did not stage the
batch; instead of reloading every partition the batch touched, it applies the batch's
entries from here: cost proportional to the shard's changes, not to its partitions.

Layout: `<changelog_uri>/<table version:020d>.parquet`, written by the driver after the
commit lands, one row group per shard (a reader picks its shard's row groups by the
`shard` column's statistics and reads nothing else), with a header in the file metadata
saying which writer, batch and sharding it belongs to. Files older than the retention
window are deleted; a replica further behind falls back to invalidating partitions.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import asdict, dataclass

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from sink.index.entry import changes_schema, width_of
from sink.lakehouse.log import filesystem


def schema(width: int = 1) -> pa.Schema:
    """A file's columns: the shard, then the entries (`changes_schema(width)`)."""
    return pa.schema([pa.field("shard", pa.int32()), *changes_schema(width)])

_HEADER = b"upsert_sink.changelog"


@dataclass(frozen=True)
class Header:
    """Whose entries a file holds: a reader uses them only if all of this matches its own."""

    table_id: str  # the Delta table's metadata id: a re-created table never reads an old file
    writer_id: str
    batch_id: int
    num_shards: int
    spec: str  # the replica spec (key, partition and ordering columns)


def file_name(version: int) -> str:
    return f"{version:020d}.parquet"


def write(uri: str, version: int, header: Header, entries: pa.Table) -> None:
    """Write the entries (`schema(width)` rows) of the commit at `version`; visible only once
    complete."""
    fs, base = filesystem(uri)
    fs.create_dir(base, recursive=True)
    layout = schema(width_of(entries.column_names))
    entries = entries.select(layout.names).cast(layout).sort_by("shard")
    layout = layout.with_metadata({_HEADER: json.dumps(asdict(header)).encode()})
    final = f"{base}/{file_name(version)}"
    # Object stores publish an object when its upload completes; a local file needs a rename.
    local = isinstance(fs, pafs.LocalFileSystem)
    target = f"{base}/.{file_name(version)}.{uuid.uuid4().hex}.tmp" if local else final
    with fs.open_output_stream(target) as out, pq.ParquetWriter(out, layout) as writer:
        shards = entries.column("shard")
        for shard in pc.unique(shards).to_pylist():
            rows = entries.filter(pc.equal(shards, shard))
            writer.write_table(rows, row_group_size=max(rows.num_rows, 1))
    if local:
        fs.move(target, final)


def read(uri: str, version: int, header: Header, shard: int) -> pa.Table | None:
    """The entries (`changes_schema` rows) of `shard` in the commit at `version`, or None when
    there is no file for it, or the file belongs to another writer, batch or sharding."""
    fs, base = filesystem(uri)
    try:
        source = fs.open_input_file(f"{base}/{file_name(version)}")
    except OSError:  # not there: written by no one, lost in a crash, or expired
        return None
    with source:
        parquet = pq.ParquetFile(source)
        written = (parquet.schema_arrow.metadata or {}).get(_HEADER)
        layout = schema(width_of(parquet.schema_arrow.names))
        if written is None or json.loads(written) != asdict(header) or parquet.schema_arrow.names != layout.names:
            return None  # another writer's, or an older layout
        groups = [i for i in range(parquet.num_row_groups) if _may_hold(parquet.metadata.row_group(i), shard)]
        rows = parquet.read_row_groups(groups, columns=layout.names) if groups else layout.empty_table()
    entries = changes_schema(width_of(layout.names))
    return rows.filter(pc.equal(rows.column("shard"), shard)).select(entries.names).cast(entries)



def _may_hold(group: pq.RowGroupMetaData, shard: int) -> bool:
    stats = group.column(0).statistics
    return stats is None or not stats.has_min_max or stats.min <= shard <= stats.max


def expire(uri: str, below: int) -> int:
    """Delete the files of versions below `below`; returns how many went."""
    fs, base = filesystem(uri)
    try:
        infos = fs.get_file_info(pafs.FileSelector(base, allow_not_found=True))
    except FileNotFoundError:
        return 0
    old = [i.path for i in infos if i.base_name.endswith(".parquet") and i.base_name[:20].isdigit()
           and int(i.base_name[:20]) < below]
    for path in old:
        fs.delete_file(path)
    return len(old)

