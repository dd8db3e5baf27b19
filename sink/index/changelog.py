"""The index changelog: for each batch of this sink, the index entries it changed, by shard.

A shard's tagging task stages its batch's entries in the replica of the executor it ran
on. When the shard's next task runs on another executor, that replica did not stage the
batch; instead of reloading every partition the batch touched, it applies the batch's
entries from here: cost proportional to the shard's changes, not to its partitions.

Layout: `<changelog_uri>/<read version:020d>-<batch>-<writer hash>/<shard:05d>.parquet`,
written by each shard's tagging task before the batch commits (no entry passes through the
driver), with a header in the file metadata saying which writer, batch and sharding it
belongs to. A re-run task writes the same entries (tags are a function of the version read),
and a batch tagged again reads a newer version, so it writes elsewhere: a reader takes the
file of the version the commit that landed was tagged against (`READ_VERSION_PROPERTY`).
Entries read below the retention window are deleted; a replica further behind falls back to
invalidating partitions.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import asdict, dataclass

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import xxhash

from sink.delta_log.reading import filesystem
from sink.index.entry import changes_schema, width_of

_HEADER = b"upsert_sink.changelog"


@dataclass(frozen=True)
class Header:
    """Whose entries a file holds: a reader uses them only if all of this matches its own."""

    table_id: str  # the Delta table's metadata id: a re-created table never reads an old file
    writer_id: str
    batch_id: int
    num_shards: int
    spec: str  # the replica spec (key, partition and ordering columns)


def folder_name(read_version: int, header: Header) -> str:
    """Where one batch's entries go: by the version it read, its batch and writer (writers share
    the changelog, and two of them may tag a batch of the same id against the same version)."""
    return f"{read_version:020d}-{header.batch_id}-{xxhash.xxh64_hexdigest(header.writer_id.encode())}"


def file_name(shard: int) -> str:
    return f"{shard:05d}.parquet"


def write(uri: str, read_version: int, header: Header, shard: int, entries: pa.Table) -> None:
    """Write one shard's entries (`schema(width)` rows without `shard`) of the batch tagged
    against `read_version`; visible only once complete."""
    fs, base = filesystem(uri)
    folder = f"{base}/{folder_name(read_version, header)}"
    fs.create_dir(folder, recursive=True)
    layout = changes_schema(width_of(entries.column_names))
    entries = entries.select(layout.names).cast(layout)
    layout = layout.with_metadata({_HEADER: json.dumps(asdict(header)).encode()})
    final = f"{folder}/{file_name(shard)}"
    # Object stores publish an object when its upload completes; a local file needs a rename.
    local = isinstance(fs, pafs.LocalFileSystem)
    target = f"{folder}/.{file_name(shard)}.{uuid.uuid4().hex}.tmp" if local else final
    with fs.open_output_stream(target) as out:
        pq.write_table(entries.replace_schema_metadata(layout.metadata), out)
    if local:
        fs.move(target, final)


def read(uri: str, read_version: int, header: Header, shard: int) -> pa.Table | None:
    """The entries (`changes_schema` rows) of `shard` in the batch tagged against
    `read_version`, or None when there is no file for it, or the file belongs to another
    writer, batch or sharding."""
    fs, base = filesystem(uri)
    try:
        source = fs.open_input_file(f"{base}/{folder_name(read_version, header)}/{file_name(shard)}")
    except OSError:  # not there: written by no one, lost in a crash, or expired
        return None
    with source:
        parquet = pq.ParquetFile(source)
        written = (parquet.schema_arrow.metadata or {}).get(_HEADER)
        layout = changes_schema(width_of(parquet.schema_arrow.names))
        if written is None or json.loads(written) != asdict(header) or parquet.schema_arrow.names != layout.names:
            return None  # another writer's, or an older layout
        return parquet.read(columns=layout.names).cast(layout)


def expire(uri: str, below: int) -> int:
    """Delete the entries of batches that read a version below `below` (and files of the
    older one-file-per-version layout); returns how many batches' entries went."""
    fs, base = filesystem(uri)
    try:
        infos = fs.get_file_info(pafs.FileSelector(base, allow_not_found=True))
    except FileNotFoundError:
        return 0
    old = [i for i in infos if i.base_name[:20].isdigit() and int(i.base_name[:20]) < below]
    for info in old:
        if info.type == pafs.FileType.Directory:
            fs.delete_dir(info.path)
        else:
            fs.delete_file(info.path)
    return len(old)
