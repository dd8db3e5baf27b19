"""Checkpoints and expired log entries of a table the sink writes, as Spark's writers keep them.

Spark checkpoints after a commit whose version is a multiple of `delta.checkpointInterval`
(10 when unset) and then removes the log entries older than `delta.logRetentionDuration`
(30 days) unless `delta.enableExpiredLogCleanup` is false. delta-rs' own commits checkpoint
every 100 versions when the property is unset, so the sink checkpoints after its batch
wherever Spark would have.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping

from deltalake import DeltaTable, PostCommitHookProperties

from sink.delta_log.features import v2_checkpoints
from sink.delta_log.file_layout import integer_property
from sink.delta_log.reading import filesystem
from sink.library_errors import first_line

log = logging.getLogger(__name__)

SPARK_CHECKPOINT_INTERVAL = 10
# For delta-rs' commits to a target table: its hook checkpoints the version before each
# multiple of the interval (3, 7, 11 at interval 4), and every 100 when the property is unset.
NO_HOOKS = PostCommitHookProperties(create_checkpoint=False, cleanup_expired_logs=False)


def checkpoint_interval(configuration: Mapping[str, str]) -> int:
    """The table's `delta.checkpointInterval`; Spark's default where unset or not a positive number."""
    return integer_property(configuration, "delta.checkpointInterval", SPARK_CHECKPOINT_INTERVAL, least=1)


def due(first: int, last: int, interval: int, last_checkpoint: int | None) -> bool:
    """Whether versions `first`..`last` hold a multiple of `interval` no checkpoint covers yet."""
    multiple = last - last % interval
    return multiple >= first and (last_checkpoint is None or last_checkpoint < multiple)


def checkpoint_if_due(table: DeltaTable, uri: str, first: int) -> bool:
    """After the versions from `first` to the one `table` has loaded, written by the sink:
    checkpoint at the loaded version when one of them is due, then remove expired log
    entries. A v2-checkpoint table takes v2 checkpoints only, which delta-rs does not write:
    its other writers checkpoint it. The batch has committed: a failure here is logged, as
    Spark's writers log theirs, and the next due version tries again. Returns whether it
    checkpointed."""
    version = table.version()
    configuration = table.metadata().configuration
    interval = checkpoint_interval(configuration)
    if version < first or not due(first, version, interval, None) or v2_checkpoints(table):
        return False
    try:
        if not due(first, version, interval, last_checkpoint(uri)):  # the batch's log commit checkpointed
            return False
        table.create_checkpoint()
        if configuration.get("delta.enableExpiredLogCleanup", "true").lower() != "false":
            table.cleanup_metadata()  # by delta.logRetentionDuration, as Spark's cleanup
    except Exception as e:  # noqa: BLE001 - after the commit, nothing may undo it
        log.warning("%s: no checkpoint at version %s: %s", uri, version, first_line(e))
        return False
    return True


def last_checkpoint(uri: str) -> int | None:
    """The version `_delta_log/_last_checkpoint` names, None without one."""
    fs, root = filesystem(uri)
    try:
        with fs.open_input_stream(f"{root}/_delta_log/_last_checkpoint") as f:
            return int(json.loads(f.read())["version"])
    except (FileNotFoundError, ValueError, KeyError):
        return None
