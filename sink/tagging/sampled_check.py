"""The sampled verification of a shard's batch (sink.index.verification), read beside its
tagging: the check reads the tables (on an unpartitioned table, the key column of all of it:
0.6-0.9 s at 10M rows) while the records are looked up and classified, and a partition found
drifted is reloaded and the shard tagged again. Drift is a bug or damage, so the second
tagging is rare; the read no longer waits in front of every checked batch's tagging."""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import pyarrow as pa
import pyarrow.compute as pc

from sink import keys
from sink.index import verification
from sink.index.lifecycle import ShardSource
from sink.index.replica import ShardReplica
from sink.tagging.task_context import TaskContext
from sink.tagging.task_stats import TaskStats

log = logging.getLogger(__name__)


def start(ctx: TaskContext, replica: ShardReplica, source: Callable[[], ShardSource], shard: int, pids: pa.Array,
          keys_: pa.Array, among: set[str], fraction: float) -> Future[verification.Check] | None:
    """The check of a `fraction` of the records' keys in partitions `among` (held before this
    task loaded anything), started in a thread; None when none is to be checked (the tables,
    `source()`, are then not opened). It reads the replica's committed entries and the tables,
    which tagging does not change."""
    wanted = verification.sample(pids, pc.cast(keys_, pa.binary()), among, fraction, seed=ctx.batch_id * 4099 + shard)
    if not wanted:
        return None
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"verify-{shard}")
    future = pool.submit(verification.check, wanted, replica.peek, source().peek, ctx.expire_before,
                         lambda k: keys.describe_key(k, ctx.table.key))
    pool.shutdown(wait=False)  # its thread ends with the check
    return future


def drifted(ctx: TaskContext, shard: int, check: Future[verification.Check], stats: TaskStats) -> list[str]:
    """The partitions where the replica disagreed with the tables, once the check is done
    (counted, and logged at ERROR with examples); the caller reloads them and tags again."""
    found = check.result()
    stats.verified_keys += found.keys
    if not found.drifted:
        return []
    stats.verify_mismatches += found.mismatches
    stats.verify_examples += found.examples
    log.error("shard %s of %s at version %s: the replica disagrees with the table on %s of %s key(s) checked, "
              "e.g. %s; reloading partition(s) %s", shard, ctx.table.table_uri, ctx.table_version, found.mismatches,
              found.keys, "; ".join(found.examples), found.drifted)
    return found.drifted
