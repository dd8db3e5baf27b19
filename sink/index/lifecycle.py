"""Filling and trimming a shard replica: bootstrap of the hot window, on-demand loads,
eviction by TTL and by disk budget."""

from __future__ import annotations

import datetime as dt
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TypeVar

import pyarrow as pa
from deltalake import DeltaTable

from sink.errors import PartitionLoadError
from sink.index import tiering
from sink.index.loader import read_global, read_partition
from sink.index.replica import ShardReplica
from sink.index.spec import GLOBAL
from sink.ordering import columns_of

log = logging.getLogger(__name__)

LOAD_THREADS = 4
LOAD_ATTEMPTS = 3
# A partition the replica lacks and a batch names few keys of (`peek_max_keys`) is read for
# those keys alone, without loading it, unless this read would be its PEEKS_BEFORE_LOAD-th
# within `partition_ttl_hours`: then it loads. A partition named once (a stray late record)
# costs one read instead of a load, one named again is being written to and is held from
# then on. A load costs about three to four such reads (a scan of the partition's key and
# ordering columns either way; 100-record events batches at 1M rows: ~10 ms against
# ~3-5 ms), so a partition that keeps taking records costs at most ~1.3 loads.
PEEKS_BEFORE_LOAD = 2

Progress = Callable[[int, int, int], None]  # partitions done, partitions total, keys done
T = TypeVar("T")


@dataclass(frozen=True)
class ShardSource:
    """Where one shard's entries come from."""

    table: DeltaTable  # at the version the replica reflects
    tombstones: DeltaTable | None
    key_cols: tuple[str, ...]
    ordering: str | tuple[str, ...]  # the ordering column, or several in order
    shard: int
    num_shards: int
    partition_cols: tuple[str, ...] = ()  # global scope: where each key lives
    history: bool = False  # a history table (scd_type 2): global entries list a key's partitions

    @classmethod
    def open(cls, table_uri: str, tombstone_uri: str, version: int, key_cols, ordering: str | Sequence[str],
             shard: int, num_shards: int, partition_cols=(), history: bool = False) -> ShardSource:
        """The table at `version` and the tombstone table, if there is one yet."""
        tombstones = DeltaTable(tombstone_uri) if DeltaTable.is_deltatable(tombstone_uri) else None
        return cls.of(DeltaTable(table_uri, version=version), tombstones, key_cols, ordering, shard, num_shards,
                      partition_cols, history)

    @classmethod
    def of(cls, table: DeltaTable, tombstones: DeltaTable | None, key_cols, ordering: str | Sequence[str],
           shard: int, num_shards: int, partition_cols=(), history: bool = False) -> ShardSource:
        """From tables already open (`table` at the version the replica reflects)."""
        return cls(table, tombstones, tuple(key_cols), tuple(columns_of(ordering)), shard, num_shards,
                   tuple(partition_cols), history)

    def peek(self, pid: str, wanted: pa.Array) -> dict[bytes, bytes]:
        """Packed entries of the `wanted` keys (encoded) in partition `pid`, as a load of it
        would hold them, read without loading it."""
        found, raws = read_partition(self.table, self.tombstones, pid, self.key_cols, self.ordering, self.shard,
                                     self.num_shards, wanted, self.history)
        return dict(zip(found, raws))

    def read(self, pid: str) -> Iterable[tuple[list[bytes], list[bytes]]]:
        """Keys and packed entries of one partition (one chunk), or of the whole shard for
        GLOBAL (in chunks: a keyspace of tens of millions of keys never exists as Python
        objects at once); each chunk's keys ascending."""
        if pid != GLOBAL:
            return [read_partition(self.table, self.tombstones, pid, self.key_cols, self.ordering, self.shard,
                                   self.num_shards, history=self.history)]
        read = read_global(self.table, self.tombstones, self.key_cols, self.partition_cols, self.ordering,
                           self.shard, self.num_shards, self.history)
        if read.keys_in_several_partitions:
            log.warning("shard %s: %s key(s) have rows in several partitions of %s (scope = 'global' keeps one "
                        "row per key); the index follows each key's newest row", self.shard,
                        read.keys_in_several_partitions, self.table.table_uri)
        return read.chunks()


@dataclass
class LoadReport:
    partitions: int = 0
    keys: int = 0
    seconds: float = 0.0
    loaded: list[str] = field(default_factory=list)


def load_partitions(
    replica: ShardReplica, source: ShardSource, pids: Sequence[str], reason: str | Callable[[str], str],
    now: float | None = None, progress: Progress | None = None,
) -> LoadReport:
    """Load every partition in `pids`, concurrently on a bounded pool; each becomes visible
    only once complete. `reason` (or `reason(pid)`) is recorded with it. A partition
    failing LOAD_ATTEMPTS times fails the call, naming it."""
    reason_of = reason if callable(reason) else lambda _: reason
    report = LoadReport()
    if not pids:
        return report
    started = time.perf_counter()

    def load(pid: str) -> int:
        return _attempts(source, pid, "loading", lambda: replica.load_chunks(pid, source.read(pid), reason_of(pid),
                                                                              now, ascending=True))

    with ThreadPoolExecutor(max_workers=min(LOAD_THREADS, len(pids))) as pool:
        for pid, n in zip(pids, pool.map(load, pids)):
            report.partitions += 1
            report.keys += n
            report.loaded.append(pid)
            if progress:
                progress(report.partitions, len(pids), report.keys)
    report.seconds = time.perf_counter() - started
    return report


def peek_partitions(source: ShardSource, wanted: Mapping[str, pa.Array]) -> dict[str, dict[bytes, bytes]]:
    """Per partition of `wanted`, the packed entries of its wanted keys (`ShardSource.peek`),
    read concurrently on the loads' pool; a partition failing LOAD_ATTEMPTS times fails the
    call, naming it, as a load does."""
    if not wanted:
        return {}

    def peek(pid: str) -> dict[bytes, bytes]:
        return _attempts(source, pid, "reading keys of", lambda: source.peek(pid, wanted[pid]))

    with ThreadPoolExecutor(max_workers=min(LOAD_THREADS, len(wanted))) as pool:
        return dict(zip(wanted, pool.map(peek, wanted)))


def _attempts(source: ShardSource, pid: str, doing: str, work: Callable[[], T]) -> T:
    """`work` on partition `pid`, tried LOAD_ATTEMPTS times, then reported with its name."""
    error: Exception | None = None
    for _ in range(LOAD_ATTEMPTS):
        try:
            return work()
        except Exception as e:  # retried, then reported with the partition's name
            error = e
    raise PartitionLoadError(
        f"{doing} partition {pid} of {source.table.table_uri} at version {source.table.version()} "
        f"for shard {source.shard} failed {LOAD_ATTEMPTS} times: {error}"
    ) from error


def bootstrap(
    replica: ShardReplica,
    source: ShardSource,
    partition_cols: Sequence[str],
    rule_config: tuple[str | list[str] | None, str],
    tiering_column: str | None,
    days: int,
    now: float,
    progress: Progress | None = None,
) -> LoadReport:
    """Load the partitions of the hot window (the last `days` by partition date or by the
    tiering column's max value) into an empty replica; a global-scope replica loads its
    whole keyspace."""
    if replica.located:
        log.info("shard %s bootstrap: every key of %s (scope = 'global')", source.shard, source.table.table_uri)
        return load_partitions(replica, source, [GLOBAL], "bootstrap", now=now, progress=progress)
    types = {f.name: f.type for f in pa.schema(source.table.schema().to_arrow()) if f.name in partition_cols}
    rule = tiering.resolve_date_rule(rule_config[0], rule_config[1], types)
    actions = pa.table(source.table.get_add_actions(flatten=True))
    stats = tiering.partition_stats(actions, partition_cols, tiering_column)
    hot = tiering.hot_partitions(stats, rule, dt.datetime.fromtimestamp(now, dt.UTC), days)
    undated = tiering.undated_example(stats, rule)
    if undated is not None:
        log.warning("shard %s bootstrap: no partition of %s has a date under %s (e.g. %s), so the hot window "
                    "loads nothing and every partition loads on first use; set partition_date_format to fit "
                    "the values (e.g. '%%Y-%%m' for '2025-07'), partition_date, or tiering_column",
                    source.shard, source.table.table_uri,
                    f"partition_date_format {rule.fmt!r} on {rule.columns[0]}" if len(rule.columns) == 1
                    else f"the columns {list(rule.columns)}", undated)
    rows = sum(stats[p][1] for p in hot)
    log.info("shard %s bootstrap: %s of %s partitions in the last %s days (%s rows to scan)",
             source.shard, len(hot), len(stats), days, rows)
    started = time.perf_counter()

    def logged(done: int, total: int, keys: int) -> None:
        rate = keys / max(time.perf_counter() - started, 1e-9)
        log.info("shard %s bootstrap: partitions %s/%s, keys %s, %.0f keys/s", source.shard, done, total, keys, rate)
        if progress:
            progress(done, total, keys)

    return load_partitions(replica, source, hot, "bootstrap", now=now, progress=logged)


def table_partitions(source: ShardSource) -> list[str]:
    """Every partition holding rows in the table at the source's version."""
    actions = pa.table(source.table.get_add_actions(flatten=True))
    return sorted(tiering.partition_stats(actions, source.table.metadata().partition_columns, None))


def evict(
    replica: ShardReplica, now: float, ttl_hours: int, max_bytes: int | None, keep: set[str]
) -> list[str]:
    """Drop partitions not accessed for `ttl_hours`, then least recently used ones while the
    replica is over `max_bytes`. Never a partition in `keep` (the running task needs it)."""
    infos = replica.partitions()
    cutoff = now - ttl_hours * 3600
    evicted = [pid for pid, info in infos.items() if pid not in keep and info.last_access < cutoff]
    for pid in evicted:
        replica.drop_partition(pid)
    if max_bytes is not None:
        sizes = replica.keyspaces.partition_sizes()
        total = sum(size for _, size in sizes.values())
        for pid in sorted(sizes, key=lambda p: infos[p].last_access):
            if total <= max_bytes:
                break
            if pid in keep:
                continue
            replica.drop_partition(pid)
            total -= sizes[pid][1]
            evicted.append(pid)
    return evicted
