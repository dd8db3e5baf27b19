"""What a replica's entries mean (its key spec) and where a shard's replica lives."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

from sink.ordering import columns_of

# The keyspace of a global-scope replica, in the place of a partition id.
GLOBAL = "*global"


def replica_spec(key_cols, partition_cols, ordering: str | Sequence[str], scope: str = "partitioned") -> str:
    """What a replica's entries mean; a replica of another spec is rebuilt."""
    columns = columns_of(ordering)
    spec = {"key": list(key_cols), "partition_by": list(partition_cols),
            "ordering": columns[0] if len(columns) == 1 else columns}
    if scope != "partitioned":  # partitioned replicas keep the spec they had before scopes
        spec["scope"] = scope
    return json.dumps(spec)


def ordering_width(spec: str | None) -> int:
    """Ordering columns of a spec's entries (1 for no spec yet)."""
    try:
        ordering = json.loads(spec).get("ordering")
    except (TypeError, ValueError, AttributeError):
        return 1
    return len(ordering) if isinstance(ordering, list) else 1


def is_global(spec: str | None) -> bool:
    try:
        return json.loads(spec).get("scope") == "global"
    except (TypeError, ValueError, AttributeError):  # no spec yet, or not one replica_spec wrote
        return False


def replica_path(index_root: str | os.PathLike[str], table_id: str, shard: int, num_shards: int) -> Path:
    return Path(index_root) / table_id / f"shard-{shard}-of-{num_shards}"
