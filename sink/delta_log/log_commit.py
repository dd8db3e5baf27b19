"""A Delta commit written by the sink itself: for the actions `deltalake` cannot commit (an
`add` or `remove` carrying a deletion vector: delta-rs issues #4512, #1094).

Exactly what the protocol asks of a writer, nothing beyond it: the log entry for the version
after the one the batch read, created atomically and never overwritten (claimed as the table's
other writers claim versions: sink.delta_log.log_store). When another
writer committed first, that entry exists and the commit fails (CommitFailedError), as the
sink's other commits do with no retries: the batch is tagged again against the new version,
so every conflict check is the strictest one. A table with a reader or writer feature this
writer does not implement never gets here (`unsupported_feature`). Checkpoints stay
`deltalake`'s, written where Spark's writers would (sink.delta_log.checkpoints).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from deltalake import CommitProperties, DeltaTable
from deltalake.exceptions import CommitFailedError

from sink.delta_log import checkpoints, log_store

ENGINE_INFO = "delta-upsert-sink"
# Features whose writer requirements the commit meets: the deletion vectors and identity
# values (sink.delta_log.identity) it writes; those
# that ask nothing of this commit while unused (a table using one commits through a MERGE:
# sink.delta_log.features; a variant column, which delta-rs lists the feature for on any
# property change, would fail the files' schema check); and those that constrain only readers,
# VACUUM or checkpoints (none is written on a v2-checkpoint table: sink.delta_log.checkpoints).
SUPPORTED_FEATURES = frozenset({
    "deletionVectors", "appendOnly", "invariants", "checkConstraints", "changeDataFeed", "generatedColumns",
    "columnMapping", "timestampNtz", "variantType", "vacuumProtocolCheck", "identityColumns", "v2Checkpoint",
})


def unsupported_feature(table: DeltaTable) -> str | None:
    """The first reader or writer feature of the table this commit does not implement."""
    protocol = table.protocol()
    features = [*(protocol.reader_features or ()), *(protocol.writer_features or ())]
    return next((f for f in features if f not in SUPPORTED_FEATURES), None)


def commit(table: DeltaTable, uri: str, actions: Sequence[Mapping[str, Any]], props: CommitProperties, *,
           operation: str, parameters: Mapping[str, str], metrics: Mapping[str, int],
           tags: Mapping[str, str] | None = None) -> int:
    """Commit `actions` (add/remove/metaData dicts as the log spells them) with `props`' app
    transactions and metadata (`userMetadata` among it: sink.lakehouse.commit.writes.commit_properties)
    as the version after the one `table` has loaded; returns it. `tags`: the commit info's.
    Raises CommitFailedError when that version exists already (another writer won)."""
    version = table.version() + 1
    now = int(time.time() * 1000)
    info = {"timestamp": now, "operation": operation, "operationParameters": dict(parameters),
            "readVersion": version - 1, "isolationLevel": "Serializable", "isBlindAppend": False,
            "operationMetrics": {k: str(v) for k, v in metrics.items()}, "engineInfo": ENGINE_INFO,
            "txnId": str(uuid.uuid4()),
            **({"tags": dict(tags)} if tags else {}), **(props.custom_metadata or {})}
    txns = [{"txn": {"appId": t.app_id, "version": t.version, "lastUpdated": now}}
            for t in props.app_transactions or ()]
    lines = [{"commitInfo": info}, *txns, *actions]
    data = "".join(json.dumps(line, separators=(",", ":")) + "\n" for line in lines).encode()
    if not log_store.claim(uri, version, data):
        raise CommitFailedError(f"{uri}: version {version} was committed by another writer first")
    table.update_incremental()
    if table.version() == version:
        checkpoints.checkpoint_if_due(table, uri, version)
    return version

