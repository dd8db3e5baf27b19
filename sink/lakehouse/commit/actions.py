"""What a copy-on-write rewrite or merge-on-read commits: the stored files it reads, marks and
removes, the files it writes (`Rewrite`), and the actions, operation and metrics the sink's log
commit records of it (as Spark's MERGE names them), checked before the commit (`check_actions`):
no commit checks what it is given."""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from urllib.parse import quote, unquote

import pyarrow as pa
import pyarrow.fs as pafs
from deltalake import DeltaTable
from deltalake.transaction import AddAction

from sink import keys
from sink.delta_log.column_mapping import ColumnMapping
from sink.delta_log.deletion_vectors import Descriptor
from sink.delta_log.reading import filesystem
from sink.errors import CommitCheckError
from sink.lakehouse.commit.writes import (
    DELETE,
    INSERT,
    UPDATE,
    partition_string,
)


@dataclass(frozen=True)
class StoredFile:
    """One file of the snapshot the batch reads (its `add` action)."""

    path: str  # as the log spells it (URL-encoded)
    size: int
    partition_values: dict[str, str | None]
    deletion_vector: Descriptor | None = None  # the rows of the file the table no longer holds
    # Kept on the actions that name it again: a marked file's `add`, its `remove` (as Spark's).
    modification_time: int | None = None
    num_records: int | None = None  # its physical rows, by its statistics
    tags: dict[str, str] | None = None


@dataclass(frozen=True)
class MarkedFile:
    """A stored file kept with a new deletion vector (merge-on-read): its old one (on the
    `remove` the commit pairs with it) and more rows."""

    stored: StoredFile
    deletion_vector: Descriptor
    stats: str  # `numRecords` the physical rows, bounds not tight (rows are hidden)


@dataclass(frozen=True)
class ChangeFile:
    """A change data file the batch wrote (its `cdc` action)."""

    path: str  # relative to the table's root, not encoded
    size: int
    partition_values: dict[str, str | None]


@dataclass(frozen=True)
class WrittenFile:
    action: AddAction
    schema: pa.Schema  # as written (checked against the table's before the commit)


@dataclass(frozen=True)
class Rewrite:
    """The actions of one batch's rewrite, and how many of its updates were no-ops (the stored
    row already held exactly the update's values: a re-delivery)."""

    adds: list[WrittenFile]
    removes: list[StoredFile]
    unchanged: int = 0
    marked: list[MarkedFile] = field(default_factory=list)  # each also in `removes`, with its old vector
    changes: list[ChangeFile] = field(default_factory=list)  # the change data feed's files
    # Per writer of its new rows (the thread pool, each Spark task), per identity column the
    # value furthest along its step it handed out: the commit raises the high-water marks.
    identity_highs: list[dict[str, int]] = field(default_factory=list)
    # The table's rows it inserts, updates (not counting `unchanged`) and deletes; a key moving
    # partition (scope "global") counts as a delete and an insert.
    row_changes: dict[str, int] = field(default_factory=dict)

    @property
    def empty(self) -> bool:
        return not (self.adds or self.removes)

    @property
    def files_changed(self) -> tuple[int, int]:
        """The stored files whose rows it marks deleted, and those it replaces with new files or
        (every row deleted) removes."""
        return len(self.marked), len(self.removes) - len(self.marked)

    @property
    def partitions_rewritten(self) -> int:
        """Partitions whose files it replaces."""
        return len({tuple(sorted(f.partition_values.items())) for f in self.removes})


def log_actions(rewrite: Rewrite, mapping: ColumnMapping | None = None) -> list[dict]:
    """The rewrite's actions as the log spells them: a `remove` of each replaced or marked file
    (with the deletion vector it had), an `add` of each marked file with its new one, and of
    each new file, a `cdc` of each change file; partition values keyed by physical name
    under a column `mapping`."""
    now = int(time.time() * 1000)

    def keyed(values: Mapping[str, str | None]) -> dict[str, str | None]:
        return mapping.partition_values(values) if mapping is not None else dict(values)

    actions = []
    for f in rewrite.removes:
        remove = {"path": f.path, "deletionTimestamp": now, "dataChange": True, "extendedFileMetadata": True,
                  "partitionValues": keyed(f.partition_values), "size": f.size}
        if f.num_records is not None:
            remove["stats"] = json.dumps({"numRecords": f.num_records}, separators=(",", ":"))
        if f.tags:
            remove["tags"] = f.tags
        if f.deletion_vector is not None:
            remove["deletionVector"] = f.deletion_vector.to_json()
        actions.append({"remove": remove})
    for m in rewrite.marked:
        add = {"path": m.stored.path, "partitionValues": keyed(m.stored.partition_values), "size": m.stored.size,
               "modificationTime": m.stored.modification_time or now, "dataChange": True, "stats": m.stats,
               "deletionVector": m.deletion_vector.to_json()}
        if m.stored.tags:
            add["tags"] = m.stored.tags
        actions.append({"add": add})
    for w in rewrite.adds:
        a = w.action
        actions.append({"add": {"path": quote(a.path, safe="/="), "partitionValues": keyed(a.partition_values),
                                "size": a.size, "modificationTime": a.modification_time, "dataChange": True,
                                "stats": a.stats}})
    for c in rewrite.changes:
        actions.append({"cdc": {"path": quote(c.path, safe="/="), "partitionValues": keyed(c.partition_values),
                                "size": c.size, "dataChange": False}})
    return actions


def operation_of(rewrite: Rewrite) -> dict:
    """The commit's operation, its parameters and its metrics, as Spark names them: new rows
    alone (an identity table's append, a table with random file prefixes) read as the WRITE
    they are, anything else as a MERGE."""
    if not rewrite.removes:
        return {"operation": "WRITE", "parameters": {"mode": "Append"},
                "metrics": {"numFiles": len(rewrite.adds), "numOutputRows": _rows_written(rewrite),
                            "numOutputBytes": sum(w.action.size for w in rewrite.adds)}}
    path = "merge-on-read" if rewrite.marked else "copy-on-write"
    return {"operation": "MERGE", "parameters": {"predicate": "[]", "commitPath": path},
            "metrics": log_metrics(rewrite)}


def log_metrics(rewrite: Rewrite) -> dict[str, int]:
    """The commit's metrics, named as Spark's MERGE names them."""
    updated = sum(m.stored.deletion_vector is not None for m in rewrite.marked)
    rows = {f"numTargetRows{name}": rewrite.row_changes[change]
            for change, name in ((INSERT, "Inserted"), (UPDATE, "Updated"), (DELETE, "Deleted"))
            if change in rewrite.row_changes}
    return {**rows, "numTargetFilesAdded": len(rewrite.adds),
            "numTargetFilesRemoved": len(rewrite.removes) - len(rewrite.marked),
            "numTargetDeletionVectorsAdded": len(rewrite.marked),
            "numTargetDeletionVectorsUpdated": updated,
            "numTargetDeletionVectorsRemoved": sum(f.deletion_vector is not None for f in rewrite.removes),
            "numTargetChangeFilesAdded": len(rewrite.changes),
            "numOutputRows": _rows_written(rewrite)}


def _rows_written(rewrite: Rewrite) -> int:
    return sum(json.loads(w.action.stats)["numRecords"] for w in rewrite.adds)


def stored_files(table: DeltaTable, partition_by: Sequence[str], vectors: Mapping[str, Descriptor] | None = None,
                 tags: Mapping[str, dict[str, str]] | None = None) -> dict[str, list[StoredFile]]:
    """The snapshot's files by partition id; `vectors`, `tags`: the deletion vectors and tags
    its files carry, by decoded path (sink.delta_log.live_vectors)."""
    actions = pa.table(table.get_add_actions(flatten=False))
    values = actions.column("partition").to_pylist() if partition_by else [{}] * actions.num_rows
    vectors, tags = vectors or {}, tags or {}
    out: dict[str, list[StoredFile]] = {}
    pids: dict[tuple[str | None, ...], str] = {}  # a partition's files are many: its id is named once
    columns = [actions.column(c).to_pylist() for c in ("path", "size_bytes", "modification_time", "num_records")]
    for (path, size, modified, records), typed in zip(zip(*columns), values):
        strings = {c: partition_string(typed[c]) for c in partition_by}
        named = tuple(strings.values())
        pid = pids.get(named) or pids.setdefault(named, keys.partition_id(partition_by, named))
        decoded = unquote(path)
        out.setdefault(pid, []).append(StoredFile(path, size, strings, vectors.get(decoded), modified, records,
                                                  tags.get(decoded)))
    return out


def summed_changes(parts: Iterable[Mapping[str, int]]) -> dict[str, int]:
    """Row counts (`Rewrite.row_changes`) of several partitions or writing tasks, summed."""
    total: dict[str, int] = {}
    for part in parts:
        for change, n in part.items():
            total[change] = total.get(change, 0) + n
    return total


def check_actions(uri: str, rewrite: Rewrite, snapshot: Mapping[str, list[StoredFile]], schema: pa.Schema,
                  partition_by: Sequence[str], mapping: ColumnMapping | None = None) -> None:
    """What no commit checks, checked before committing: every added
    file (data or change file) exists at its size, every removed file is in the snapshot the batch read, partition
    values name exactly the partition columns, files hold the table's columns (physical ones
    under a column `mapping`) and types."""
    fs, root = filesystem(uri)
    expected = set(partition_by)
    data_schema = pa.schema([f for f in schema if f.name not in expected])
    if mapping is not None:
        data_schema = mapping.physical_schema(data_schema)
    for w in rewrite.adds:
        a = w.action
        info = fs.get_file_info(f"{root}/{a.path}")
        if info.type != pafs.FileType.File or info.size != a.size:
            raise CommitCheckError(f"{uri}: file {a.path} to be added is missing or not {a.size} bytes "
                                   f"(found {info.type.name}, {info.size}); nothing was committed")
        if set(a.partition_values) != expected:
            raise CommitCheckError(f"{uri}: file {a.path} names partition columns {sorted(a.partition_values)}, "
                                   f"the table's are {sorted(expected)}; nothing was committed")
        if not w.schema.equals(data_schema):
            raise CommitCheckError(f"{uri}: file {a.path} has columns {w.schema}, the table's are {data_schema}; "
                                   "nothing was committed")
    for c in rewrite.changes:
        info = fs.get_file_info(f"{root}/{c.path}")
        if info.type != pafs.FileType.File or info.size != c.size:
            raise CommitCheckError(f"{uri}: change file {c.path} to be added is missing or not {c.size} bytes "
                                   f"(found {info.type.name}, {info.size}); nothing was committed")
    read = {f.path for files in snapshot.values() for f in files}
    for f in rewrite.removes:
        if f.path not in read or set(f.partition_values) != expected:
            raise CommitCheckError(f"{uri}: file {f.path} to be removed is not a file of the version the batch read; "
                                   "nothing was committed")
