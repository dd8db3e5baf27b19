"""Names of the helper columns the sink adds to a batch (prefixed to avoid user columns)."""

from collections.abc import Iterable

KEY = "__sink_key"
SHARD = "__sink_shard"
ORDERING = "__sink_ordering"
DELETE = "__sink_delete"
SEQ = "__sink_seq"
FILE = "__sink_file"  # the record's input file (xxhash64 of its path; the path under Spark Connect), for arrival
REASON = "__sink_reason"
OP = "__sink_op"
STORED_AT = "__sink_stored_at"  # global scope: partition of the row the write replaces or removes
LOCATION = "__sink_location"  # global scope: the key's partition after the batch
WRITE = "__sink_write"
HIT = "__sink_hit"
STATS = "__sink_stats"
PARTIAL = "__sink_partial"  # ignore_null_updates: the write keeps stored values in its null columns

PREFIX = "__sink_"
# The row a tagging task adds to report its counters.
STATS_OP = "_stats"


def stream_columns(names: list[str]) -> list[str]:
    """Of these column names, the stream's own: all but the sink's helper columns."""
    return [n for n in names if not n.startswith(PREFIX)]


def distinct(*groups: Iterable[str]) -> list[str]:
    """The columns of `groups`, each once, in order: a key may name a partition column."""
    return list(dict.fromkeys(c for group in groups for c in group))
