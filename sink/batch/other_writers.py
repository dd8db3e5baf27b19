"""What other writers' commits change in what the index must remember, recorded where every
replica (a rebuilt one too) finds it: the tombstone table.

Before a batch is tagged, the driver reads the log commits since the last one it followed:

- a commit of another writer (not a sink) that changed rows: the keys it removed (present at
  the version before, absent after) are remembered as deletes at the removed row's ordering
  value, as tombstone rows of the writer `OTHER_WRITERS` whose batch is the commit's version;
- a RESTORE to version X: the commits after X are undone. Tombstones of the sink batches
  and of the other writers' commits it undid stop counting: their rows leave the tombstone
  table. The stream does not deliver those batches again;
- a sink's commit, a compaction, a property change: nothing to remember.

The replicas then catch up as for any other writer's commit: the partitions it touched drop
and reload from the table and the tombstone table, where a row of the table always stands
(sink.index.loader). Each write to the tombstone table carries the app transaction
`(OTHER_WRITERS_APP, version)`, so a sink restarted after a crash never records a commit twice,
and every sink commit records the version it had followed (`OTHER_WRITERS_SEEN_PROPERTY`), so
a restart reads the log on from there.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from deltalake import CommitProperties, DeltaTable, Transaction, write_deltalake
from deltalake.exceptions import CommitFailedError

from sink import columns as C
from sink.config import SinkConfig
from sink.delta_log.column_mapping import log_keys
from sink.delta_log.predicates import quote_ident
from sink.delta_log.reading import OTHER_WRITERS_SEEN_PROPERTY, RESTORE, CommitSummary, read_commit
from sink.errors import OtherWriterCommitError
from sink.index.loader import OTHER_WRITERS, TOMBSTONE_BATCH, TOMBSTONE_DELETED_AT, TOMBSTONE_WRITER, plain
from sink.lakehouse.engines.delta_rs import append_once, rows_in
from sink.library_errors import first_line
from sink.ops.tombstones import latest_per_key

log = logging.getLogger(__name__)

# The tombstone table's app transaction for what other writers did: its version is the last
# target version whose other writers' commits are recorded there.
OTHER_WRITERS_APP = "upsert_sink.other_writers"
# Versions a timestamp RESTORE's target is looked for among, newest first.
RESTORE_SEARCH = 1000
DELETE_ATTEMPTS = 5

ReadCommit = Callable[[int], CommitSummary | None]


@dataclass(frozen=True)
class Undone:
    """What a RESTORE undid: per sink writer the range of its batches, and the versions of
    other writers' commits."""

    restored: int  # the version the table went back to
    restore: int  # the RESTORE's own version
    batches: dict[str, tuple[int, int]] = field(default_factory=dict)

    @property
    def versions(self) -> tuple[int, int]:
        return self.restored + 1, self.restore - 1

    def predicate(self) -> str:
        """The tombstone rows that stop counting."""
        writer, batch = quote_ident(TOMBSTONE_WRITER), quote_ident(TOMBSTONE_BATCH)
        first, last = self.versions
        terms = [f"({writer} = {_text(OTHER_WRITERS)} AND {batch} BETWEEN {first} AND {last})"]
        terms += [f"({writer} = {_text(w)} AND {batch} BETWEEN {lo} AND {hi})" for w, (lo, hi) in self.batches.items()]
        return " OR ".join(terms)

    def describe(self) -> str:
        batches = "; ".join(f"batches {lo}..{hi} of writer {w!r}" for w, (lo, hi) in self.batches.items())
        return batches or "no sink batch"


def undone_by(restore: CommitSummary, restored: int, commits: Sequence[CommitSummary]) -> Undone:
    """What RESTORE `restore` to version `restored` undid, from the commits between them
    (`restored + 1 .. restore - 1`, in order). OtherWriterCommitError when one of them is a
    RESTORE to a version before `restored`: the table is back where that RESTORE had undone
    commits, whose tombstones are gone."""
    batches: dict[str, tuple[int, int]] = {}
    for commit in commits:
        earlier = commit.restored_version() if commit.operation == RESTORE else None
        if commit.operation == RESTORE and (earlier is None or earlier < restored):
            raise OtherWriterCommitError(
                f"{restore.describe()} restored the table to version {restored}, which brings back commits that "
                f"{commit.describe()} had undone: the sink no longer holds their deletes, so it cannot tell which "
                "keys are deleted. Rebuild the tombstone table (or restore to a version after "
                f"{commit.version}) before the stream goes on")
        if commit.by_sink:
            for writer, batch in commit.app_versions.items():
                lo, hi = batches.get(writer, (batch, batch))
                batches[writer] = (min(lo, batch), max(hi, batch))
    return Undone(restored, restore.version, batches)


def removed_rows(before: pa.Table, after: pa.Table, identity: Sequence[str], ordering: Sequence[str]) -> pa.Table:
    """The rows of `before` whose `identity` (key, and partition in partitioned scope) has no
    row in `after`, one per identity: the one with the highest `ordering`."""
    identity = list(identity)
    before = before.filter(_all_valid(before, [*identity, *ordering]))
    if not before.num_rows:
        return before
    present = after.select(identity).group_by(identity, use_threads=False).aggregate([])
    present = present.append_column("__present", pa.array(np.ones(present.num_rows, bool)))
    joined = before.join(present, identity, join_type="left outer")
    gone = joined.filter(pc.is_null(joined.column("__present"))).drop_columns(["__present"])
    return latest_per_key(gone.select(before.column_names), identity, list(ordering))


def _all_valid(table: pa.Table, columns: Sequence[str]) -> pa.Array:
    valid = pa.array(np.ones(table.num_rows, bool))
    for c in columns:
        valid = pc.and_(valid, pc.is_valid(table.column(c)))
    return valid


def _text(value: str) -> str:
    return "'" + value.replace("'", "''") + "'"


class OtherWriters:
    """Follows the table's log for one sink (`config`: the stored config) and records what other
    writers' commits change in the tombstone table."""

    def __init__(self, config: SinkConfig, writer_id: str):
        self._config = config
        self._writer_id = writer_id
        self.seen: int | None = None  # the version followed up to (None: not yet read)
        self._log_keys: tuple[str, ...] | None = None  # the log's partition value names (column mapping)

    def follow(self, table: DeltaTable) -> int:
        """Record what the commits up to `table`'s loaded version changed; returns that version.
        OtherWriterCommitError, before anything of a batch is written, for a commit the index
        cannot follow exactly."""
        version = table.version()
        self._log_keys = log_keys(table, self._config.partition_by)
        if self.seen is None:
            self.seen = self._start(table)
        for v in range(self.seen + 1, version + 1):
            commit = self._read_commit(v)
            if commit is None:
                raise OtherWriterCommitError(
                    f"version {v} of {self._config.table_uri} is no longer in the log (cleaned up before the sink "
                    "read it): the sink cannot tell what another writer deleted there. Record the table as it is with "
                    "`python -m sink other-writers --config <file> --accept-unread`, then start the stream again")
            if commit.by_sink or not commit.changes_data:
                continue
            if commit.operation == RESTORE:
                self._undo(commit)
            else:
                self._remember_deletes(commit)
            self.seen = v
        self.seen = version
        return version

    def _start(self, table: DeltaTable) -> int:
        """Where following the log starts: the version the latest sink commit had followed, or
        what the tombstone table records, whichever is later; a table no sink followed yet
        starts at its current version (what other writers did before is the table as found)."""
        version, uri = table.version(), self._config.table_uri
        marker = self._recorded()
        for v in range(version, -1 if marker is None else marker, -1):
            commit = self._read_commit(v)
            if commit is None:
                if marker is None and table.transaction_version(self._writer_id) is None:
                    break  # never written by this writer: the table as found
                raise OtherWriterCommitError(
                    f"{uri}: the log no longer holds version {v}, after the last one this sink followed: the sink "
                    "cannot tell what other writers deleted since. Record the table as it is with "
                    "`python -m sink other-writers --config <file> --accept-unread`, then start the stream again")
            if commit.by_sink:
                seen = commit.sink_int(OTHER_WRITERS_SEEN_PROPERTY)
                # A commit of a release before this one: what other writers did after it is new.
                return max(seen if seen is not None else v, marker or -1)
        if marker is not None:
            return marker
        log.info("%s: remembering other writers' deletes from version %s on", uri, version)
        return version

    def accept_unread(self, table: DeltaTable) -> int:
        """Record `table`'s loaded version as followed, without reading the commits before it
        (the operator's answer to a log the sink could not read): returns that version."""
        cfg, version = self._config, table.version()
        uri = cfg.resolved_tombstone_uri
        if DeltaTable.is_deltatable(uri):
            empty = pa.schema(DeltaTable(uri).schema().to_arrow()).empty_table()
        else:
            stored = pa.schema(table.schema().to_arrow())
            empty = pa.schema([*(stored.field(c) for c in cfg.table.tombstone_columns),
                               pa.field(TOMBSTONE_WRITER, pa.string()), pa.field(TOMBSTONE_BATCH, pa.int64()),
                               pa.field(TOMBSTONE_DELETED_AT, pa.timestamp("us", tz="UTC"))]).empty_table()
        write_deltalake(uri, empty, mode="append", partition_by=list(cfg.partition_by) or None,
                        commit_properties=CommitProperties(app_transactions=[Transaction(OTHER_WRITERS_APP, version)]))
        self.seen = version
        log.warning("%s: other writers' commits up to version %s recorded as read, unread", cfg.table_uri, version)
        return version

    def _recorded(self) -> int | None:
        uri = self._config.resolved_tombstone_uri
        return DeltaTable(uri).transaction_version(OTHER_WRITERS_APP) if DeltaTable.is_deltatable(uri) else None

    def _read_commit(self, version: int) -> CommitSummary | None:
        return read_commit(self._config.table_uri, version, list(self._config.partition_by), self._log_keys)

    def _remember_deletes(self, commit: CommitSummary) -> None:
        cfg = self._config
        if cfg.scd_type == 2:
            log.warning("%s: %s by another writer changed rows of the history table; its partitions reload, "
                        "deletes it made are not remembered as tombstones", cfg.table_uri, commit.describe())
            return
        columns = cfg.table.tombstone_columns
        identity = C.distinct(cfg.key, cfg.partition_by) if cfg.scope == "partitioned" else list(cfg.key)
        pids = sorted(commit.partitions) if commit.partitions is not None else None
        try:
            before = _rows(DeltaTable(cfg.table_uri, version=commit.version - 1), pids, columns)
            after = _rows(DeltaTable(cfg.table_uri, version=commit.version), pids, columns)
        except Exception as e:  # files of the version before gone (VACUUM), or its log entries
            raise OtherWriterCommitError(
                f"{commit.describe()} of {cfg.table_uri} changed rows, and the version before it can no longer be read "
                f"({first_line(e)}): the sink cannot tell which keys it deleted. Record the table as it is with "
                "`python -m sink other-writers --config <file> --accept-unread`, then start the stream again") from e
        gone = removed_rows(before, after, identity, cfg.ordering_columns)
        if not gone.num_rows:
            log.info("%s: %s by another writer deleted no key", cfg.table_uri, commit.describe())
            return
        stamp = pa.array([commit.timestamp_ms // 1000 * 1_000_000] * gone.num_rows, pa.timestamp("us", tz="UTC"))
        rows = (gone.append_column(TOMBSTONE_WRITER, pa.array([OTHER_WRITERS] * gone.num_rows, pa.string()))
                .append_column(TOMBSTONE_BATCH, pa.array([commit.version] * gone.num_rows, pa.int64()))
                .append_column(TOMBSTONE_DELETED_AT, stamp))
        append_once(cfg.resolved_tombstone_uri, rows, cfg.partition_by, OTHER_WRITERS_APP, commit.version,
                    schema_mode="merge")
        log.warning("%s: %s by another writer deleted %s key(s); each stays deleted for records older than its "
                    "deleted row (kept in %s)", cfg.table_uri, commit.describe(), gone.num_rows,
                    cfg.resolved_tombstone_uri)

    def _undo(self, commit: CommitSummary) -> None:
        cfg = self._config
        restored = self._restored_version(commit)
        read = [self._read_commit(v) for v in range(restored + 1, commit.version)]
        gone = [restored + 1 + i for i, c in enumerate(read) if c is None]
        if gone:
            raise OtherWriterCommitError(
                f"{commit.describe()} restored {cfg.table_uri} to version {restored}, but the log no longer holds "
                f"version {gone[0]} it undid: the sink cannot tell which of its deletes the restore undid. Record the "
                "table as it is with `python -m sink other-writers --config <file> --accept-unread`, then start "
                "the stream again")
        undone = undone_by(commit, restored, read)
        dropped = self._forget(undone)
        log.warning("%s: %s restored the table to version %s and undid versions %s..%s (%s); their deletes no "
                    "longer count (%s tombstone row(s) dropped) and the replicas reload what it changed. The stream "
                    "does not deliver undone batches again: replay their input with a new checkpoint and writer_id "
                    "to write them back", cfg.table_uri, commit.describe(), restored, *undone.versions,
                    undone.describe(), dropped)

    def _restored_version(self, commit: CommitSummary) -> int:
        """The version a RESTORE went back to: the one it names, else (a timestamp) the newest
        version whose files are the ones the RESTORE left."""
        named = commit.restored_version()
        if named is not None:
            return named
        uri = self._config.table_uri
        after = _file_set(DeltaTable(uri, version=commit.version))
        for v in range(commit.version - 1, max(-1, commit.version - 1 - RESTORE_SEARCH), -1):
            try:
                if _file_set(DeltaTable(uri, version=v)) == after:
                    return v
            except Exception:  # the version is no longer readable
                break
        raise OtherWriterCommitError(
            f"{commit.describe()} restored {uri} to a timestamp, and no version of the last {RESTORE_SEARCH} holds "
            "the files it left: the sink cannot tell which commits it undid")

    def _forget(self, undone: Undone) -> int:
        """Drop the tombstone rows of what `undone` undid, once (app transaction); rows dropped."""
        uri = self._config.resolved_tombstone_uri
        if not DeltaTable.is_deltatable(uri):
            return 0
        properties = CommitProperties(app_transactions=[Transaction(OTHER_WRITERS_APP, undone.restore)],
                                      custom_metadata={"upsert_sink.operation": "forget undone deletes"})
        for attempt in range(DELETE_ATTEMPTS):
            table = DeltaTable(uri)
            done = table.transaction_version(OTHER_WRITERS_APP)
            if done is not None and done >= undone.restore:
                return 0
            try:
                return int(table.delete(undone.predicate(), commit_properties=properties).get("num_deleted_rows", 0))
            except CommitFailedError:  # a batch appending its tombstones meanwhile
                if attempt == DELETE_ATTEMPTS - 1:
                    raise
        return 0


def _rows(table: DeltaTable, pids: list[str] | None, columns: Sequence[str]) -> pa.Table:
    rows = pa.table(table.scan(columns=list(columns))) if pids is None else rows_in(table, pids, columns)
    return plain(rows)


def _file_set(table: DeltaTable) -> set[tuple]:
    """The table's files with their deletion vectors, as a RESTORE compares them."""
    actions = pa.table(table.get_add_actions(flatten=True))
    dv = [c for c in actions.column_names if c.startswith("deletionVector")]
    return set(zip(*(actions.column(c).to_pylist() for c in ["path", *dv])))
