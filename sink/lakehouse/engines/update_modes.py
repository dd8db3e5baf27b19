"""How a delta-rs target's updates commit, by what its table's features allow (`UpdateModes`,
mixed into sink.lakehouse.engines.delta_rs.DeltaTarget, whose table it reads): the
copy-on-write rewrite, merge-on-read on a table writing deletion vectors, or MERGE where the
config asks for it or the table has a feature neither honours; and the features that decide
it (change data feed, column mapping, file layout, identity columns); and where delta-rs may
not commit at all (a table whose versions are claimed through DynamoDB)."""

from __future__ import annotations

import logging
from collections.abc import Collection

from sink.delta_log import log_commit, log_store
from sink.delta_log.column_mapping import ColumnMapping, log_keys, writable
from sink.delta_log.features import (
    COLUMN_MAPPING,
    ENABLE_CHANGE_DATA_FEED,
    ENABLE_DELETION_VECTORS,
    IDENTITY_COLUMNS,
    ROW_CHECKS,
    change_data_feed,
    merge_only_reason,
    unreadable_reason,
    v2_checkpoints,
    writes_deletion_vectors,
)
from sink.delta_log.file_layout import FileLayout
from sink.delta_log.identity import IdentityColumn
from sink.errors import UnsupportedTableError

log = logging.getLogger(__name__)

# The features the sink's own log commit writes (sink.delta_log.log_commit), which then need no MERGE.
LOG_COMMIT_FEATURES = (ENABLE_DELETION_VECTORS, ENABLE_CHANGE_DATA_FEED)
# Updates whose stored rows are marked in deletion vectors (and their new versions written).
MERGE_ON_READ = "merge-on-read"


class UpdateModes:
    """How the target's updates commit, from its table's features (`self.table`) and the
    config (`commit_mode`, `checks_rows`); the commits are DeltaTarget's."""

    def _check_history_readable(self) -> None:
        """UnsupportedTableError when a history table's files cannot be read as they are."""
        unreadable = unreadable_reason(self.table)
        if unreadable is not None:
            raise UnsupportedTableError(f"{self.uri} uses {unreadable}: a history table (scd_type = 2) reads the "
                                        "versions it rebuilds from the table's files; nothing was written")

    @property
    def _external_log(self) -> bool:
        return log_store.external_log(self.uri) is not None

    def _check_claimable_by_delta_rs(self, what: str) -> None:
        """UnsupportedTableError, before anything is written, for a commit by delta-rs on a table
        whose versions are claimed through DynamoDB: delta-rs 1.x claims them with conditional
        puts alone, which a Spark job's S3DynamoDBLogStore copy would overwrite."""
        if self._external_log:
            why = f" (the table uses {self._merge_reason})" if self._merge_reason else ""
            raise UnsupportedTableError(
                f"{self.uri}: its versions are claimed through DynamoDB ({log_store.LOCKING_PROVIDER} = dynamodb) "
                f"and this batch would commit {what}{why}, which claims versions with a conditional put alone "
                "(delta-rs 1.x dropped its DynamoDB log store): the sink commits such a table's updates only by "
                "rewriting files or writing deletion vectors through its own log commit; set commit_mode = 'auto', "
                "or use engine = 'delta-spark' in a session whose Delta log store is S3DynamoDBLogStore; "
                "nothing was written")

    def appends_through_delta_rs(self, layout: FileLayout) -> bool:
        """Whether delta-rs writes and commits a batch of new rows. Not on a table asking for
        random prefixes (delta-rs writes an append's files under their partition's folder)
        whose updates the sink's own writer takes, nor on a table whose versions are claimed
        through DynamoDB, which delta-rs' commits skip."""
        return not ((layout.random_prefix_length and self.update_mode() != "merge") or self._external_log)

    def update_mode(self) -> str:
        """How this batch's updates commit: "rewrite"; "merge-on-read" on a table writing
        deletion vectors; or "merge" when configured or when the table has a feature neither
        honours (logged once per reason)."""
        if self.commit_mode == "merge":
            return "merge"
        checked = ROW_CHECKS if self.checks_rows else ()
        reason = self._merge_only_reason(honoured=checked)
        if reason is None:
            return "rewrite"
        # Deletion vectors, the change data feed and column mapping (of top-level columns):
        # the sink's own log commit writes them; deletion vectors not on a v2-checkpoint table,
        # whose live vectors it cannot replay.
        vectors = writes_deletion_vectors(self.table) and not v2_checkpoints(self.table)
        logged = (*(LOG_COMMIT_FEATURES if vectors else (ENABLE_CHANGE_DATA_FEED,)),
                  *((COLUMN_MAPPING,) if writable(self.table) else ()),
                  *((IDENTITY_COLUMNS,) if self._generates_identity() else ()))
        reason = self._merge_only_reason(honoured=(*checked, *logged))
        unsupported = log_commit.unsupported_feature(self.table)
        if reason is None and unsupported is None:
            return MERGE_ON_READ if vectors else "rewrite"
        reason = reason or f"the table feature {unsupported!r}, which the sink's log commit does not write"
        if reason != self._merge_reason:
            log.warning("%s: updates commit through MERGE, not by rewriting files: the table uses %s",
                        self.uri, reason)
            self._merge_reason = reason
        return "merge"

    def _merge_only_reason(self, *, honoured: Collection[str] = ()) -> str | None:
        return merge_only_reason(self.table, honoured=honoured)

    def change_data_feed(self) -> bool:
        return change_data_feed(self.table)

    def column_mapping(self) -> ColumnMapping | None:
        return ColumnMapping.of(self.table)

    def file_layout(self) -> FileLayout:
        mapping = self.column_mapping()
        return FileLayout.of(self.table.metadata().configuration, mapping.physical if mapping else None)

    def _generates_identity(self) -> bool:
        """The sink's own commits may generate this table's identity values (delta-rs'
        cannot: under engine = "deltalake" such a table is refused, `check_writable`)."""
        return False

    def written_identity(self) -> tuple[IdentityColumn, ...]:
        """The identity columns whose values the sink's commits of this batch generate (none:
        the table has none, or Spark writes it)."""
        return ()

    def partition_log_keys(self) -> tuple[str, ...]:
        return log_keys(self.table, self.partition_by)

    def history_update_mode(self) -> str:
        """How a history table's rebuilt versions commit: as updates do, but through MERGE on a
        table with a change data feed (the rebuild writes no change files)."""
        return "merge" if self.change_data_feed() else self.update_mode()
