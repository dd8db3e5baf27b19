"""Reading one Delta commit from the log: app transactions and partitions touched."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow.fs as pafs

from sink import keys

# Commit metadata the sink writes beside its app transaction.
SHARDS_PROPERTY = "upsert_sink.shards"  # shards that had records in the batch
NUM_SHARDS_PROPERTY = "upsert_sink.num_shards"
READ_VERSION_PROPERTY = "upsert_sink.read_version"  # the table version the batch was tagged against
COMMIT_KIND_PROPERTY = "upsert_sink.commit"  # append, rewrite or merge
APP_TRANSACTION_PROPERTY = "upsert_sink.app_transaction"  # "<writer id>:<batch id>", as its txn action
# The table version up to which other writers' commits were recorded before the batch was
# tagged (sink.batch.other_writers): a restarted sink reads the log on from there.
OTHER_WRITERS_SEEN_PROPERTY = "upsert_sink.other_writers_seen"
RESTORE = "RESTORE"
USER_METADATA = "userMetadata"  # the commit info's field Spark's DESCRIBE HISTORY shows


@dataclass(frozen=True)
class CommitSummary:
    version: int
    app_versions: dict[str, int]
    # Partition ids whose data the commit changed; None when it cannot be told (then: all).
    partitions: frozenset[str] | None
    commit_info: dict[str, Any]

    def sink_shards(self) -> frozenset[int] | None:
        """Shards that had records in the sink batch this commit carries, if recorded."""
        raw = self.commit_info.get(SHARDS_PROPERTY)
        if raw is None:
            return None
        return frozenset(int(s) for s in str(raw).split(",") if s)

    @property
    def by_sink(self) -> bool:
        """Written by an upsert sink (of any writer id)."""
        return SHARDS_PROPERTY in self.commit_info

    @property
    def changes_data(self) -> bool:
        """Whether the commit changed rows (a compaction or a property change does not)."""
        return self.partitions is None or bool(self.partitions)

    @property
    def operation(self) -> str:
        return str(self.commit_info.get("operation", "commit"))

    @property
    def timestamp_ms(self) -> int:
        """When it was committed (the commit info's time, else 0)."""
        raw = self.commit_info.get("inCommitTimestamp", self.commit_info.get("timestamp"))
        return int(raw) if raw is not None else 0

    def restored_version(self) -> int | None:
        """The version a RESTORE commit brought the table back to, when it names one (Spark's
        `TO VERSION AS OF`, delta-rs' `restore(version)`); None otherwise."""
        if self.operation != RESTORE:
            return None
        raw = _parameters(self.commit_info).get("version")
        return None if raw in (None, "null", "") else int(raw)

    def describe(self) -> str:
        """The commit for log lines and errors: `version 12 (DELETE)`."""
        return f"version {self.version} ({self.operation})"

    def author(self) -> str:
        """Who made the commit, for messages: a writer id, else the operation."""
        apps = ", ".join(f"writer {a!r}" for a in self.app_versions)
        return apps or f"a {self.commit_info.get('operation', 'commit')} (version {self.version})"

    def sink_int(self, name: str) -> int | None:
        """An integer the sink recorded in the commit's metadata (NUM_SHARDS_PROPERTY, ...)."""
        raw = self.commit_info.get(name)
        return None if raw is None else int(raw)


def _parameters(info: Mapping[str, Any]) -> dict[str, Any]:
    """A commit info's operationParameters (Spark writes a map, some writers a JSON string)."""
    raw = info.get("operationParameters") or {}
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except ValueError:
            return {}
    return raw if isinstance(raw, dict) else {}


def log_file(table_uri: str, version: int) -> str:
    return f"{table_uri.rstrip('/')}/_delta_log/{version:020d}.json"


def filesystem(uri: str) -> tuple[pafs.FileSystem, str]:
    """The filesystem and path of a table URI or a local path (relative ones too)."""
    return pafs.FileSystem.from_uri(uri if "://" in uri else os.path.abspath(uri))


def read_commit(table_uri: str, version: int, partition_cols: list[str],
                log_keys: Sequence[str] | None = None) -> CommitSummary | None:
    """Summary of commit `version`, or None when its log file is no longer there. `log_keys`:
    the names the log's partition values go by, one per partition column (under column
    mapping their physical names: `ColumnMapping.log_keys`); by default the columns' own."""
    text = _log_text(table_uri, version)
    return None if text is None else parse_commit(version, text, partition_cols, log_keys)


# How Delta's writers (delta-rs and Spark alike) begin a file action's line in the log.
_FILE_ACTIONS = ('{"add":', '{"remove":', '{"cdc":')


def read_app_versions(table_uri: str, version: int) -> dict[str, int] | None:
    """The app transactions (`txn`) of commit `version`, or None when its log file is no longer
    there. Its file actions, nearly all of a batch's commit, are not decoded: telling which
    version carries a batch is all that reading a commit the sink just made back takes."""
    text = _log_text(table_uri, version)
    if text is None:
        return None
    apps = {}
    for line in text.splitlines():
        if not line.strip() or line.startswith(_FILE_ACTIONS):
            continue
        action = json.loads(line)
        if "txn" in action:
            apps[action["txn"]["appId"]] = int(action["txn"]["version"])
    return apps


def _log_text(table_uri: str, version: int) -> str | None:
    """Commit `version`'s log entry, or None when it is no longer there."""
    fs, path = filesystem(log_file(table_uri, version))
    try:
        with fs.open_input_stream(path) as f:
            return f.read().decode()
    except FileNotFoundError:
        return None


def recorded_num_shards(table_uri: str, version: int, writer_id: str, partition_cols: list[str],
                        lookback: int = 1000) -> int | None:
    """The shard count of `writer_id`'s latest batch at or before `version` (within
    `lookback` commits), as the sink recorded it; None when there is none."""
    for v in range(version, max(-1, version - lookback), -1):
        commit = read_commit(table_uri, v, partition_cols)
        shards = commit.sink_int(NUM_SHARDS_PROPERTY) if commit is not None else None
        if shards and writer_id in commit.app_versions:
            return shards
    return None


def commit_record(app_id: str, batch_id: int, custom_metadata: Mapping[str, str], mode: str) -> dict[str, str]:
    """What a sink's commit records beside its app transaction: the batch's metadata, the
    commit's kind, the transaction itself (DESCRIBE HISTORY shows no txn action)."""
    return {**custom_metadata, COMMIT_KIND_PROPERTY: mode, APP_TRANSACTION_PROPERTY: f"{app_id}:{batch_id}"}


def _with_user_metadata(info: dict[str, Any]) -> dict[str, Any]:
    """The commit info, with what a Spark commit of the sink recorded in its `userMetadata`
    (a JSON object; delta-rs commits carry the same keys in the commit info itself)."""
    raw = info.get(USER_METADATA)
    try:
        recorded = json.loads(raw) if isinstance(raw, str) else None
    except ValueError:
        return info
    if not isinstance(recorded, dict) or SHARDS_PROPERTY not in recorded:
        return info
    return {**info, **recorded}


def parse_commit(version: int, text: str, partition_cols: list[str],
                 log_keys: Sequence[str] | None = None) -> CommitSummary:
    log_keys = list(partition_cols) if log_keys is None else list(log_keys)
    apps: dict[str, int] = {}
    touched: set[str] | None = set()
    info: dict[str, Any] = {}
    metadata_changed = False
    for line in text.splitlines():
        if not line.strip():
            continue
        action = json.loads(line)
        if "txn" in action:
            apps[action["txn"]["appId"]] = int(action["txn"]["version"])
        elif "commitInfo" in action:
            info = _with_user_metadata(action["commitInfo"])
        elif "metaData" in action and version > 0:
            # New columns or properties leave the rows where they were; other partitioning does not.
            metadata_changed |= action["metaData"].get("partitionColumns") != list(partition_cols)
        elif touched is not None and ("add" in action or "remove" in action):
            file_action = action.get("add") or action.get("remove")
            if not file_action.get("dataChange", True):
                continue  # compaction rewrites rows without changing them
            values = file_action.get("partitionValues") or {}
            if any(k not in values for k in log_keys):
                # Partition values under other names (a column mapping the caller did not
                # pass, say): which partitions changed is unknown, so trust nothing.
                touched = None
                continue
            touched.add(keys.partition_id(partition_cols, [values.get(k) for k in log_keys]))
    if metadata_changed:
        touched = None  # partitioning changed: trust nothing
    return CommitSummary(
        version=version,
        app_versions=apps,
        partitions=None if touched is None else frozenset(touched),
        commit_info=info,
    )
