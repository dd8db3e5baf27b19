"""The tagging task that runs on executors (inside `mapInArrow`), one call per Spark partition.

Records arrive routed by shard (`keys.spark_route_expr`: shard s in Spark partition s), so
a shard's records are all in one task. For each shard in its input the task opens the
shard's replica, catches it up to the table version the driver will commit on
(bootstrapping the hot window when the replica is new or unusable), loads the partitions
its records need and the replica lacks (all together, concurrently), tags the records,
stages the changes under the batch id and evicts cold partitions. It writes each shard's
index changelog entries (when the writer keeps one) and yields the tagged records and one
stats row, with the task's counts (sink.tagging.outcomes).

When Spark tasks write the batch's files (`write_files`), the task yields only what the writing
tasks and the driver need: the writes, aimed at the rows they change (sink.tagging.moves), the
quarantined records, and each valid delete record again (DELETE_RECORD_OP) for the driver's
tombstone table.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterator, Mapping, Sequence
from concurrent import futures
from contextlib import ExitStack, contextmanager

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from deltalake import DeltaTable

from sink import columns as C
from sink import freshness, keys
from sink.arrival import arrival
from sink.delta_log.reading import read_commit
from sink.errors import ReplicaLostError
from sink.index import changelog, history_locations, registry, worker_replicas
from sink.index.catchup import catch_up
from sink.index.entry import ordering_names
from sink.index.hot_tier import resident_keys
from sink.index.lifecycle import (
    PEEKS_BEFORE_LOAD,
    ShardSource,
    bootstrap,
    evict,
    load_partitions,
    peek_partitions,
    table_partitions,
)
from sink.index.registry import wipe_damaged
from sink.index.replica import ShardReplica
from sink.index.spec import GLOBAL, replica_path
from sink.lakehouse.engines import open_tables
from sink.lakehouse.engines.delta_rs import rows_in
from sink.library_errors import first_line, is_corruption
from sink.ordering import helper_columns
from sink.tagging import replica_snapshots, sampled_check
from sink.tagging.append_only import stored_row_changes
from sink.tagging.classify import DELETE, INSERT, TOMBSTONE, UPDATE, tag, tag_global
from sink.tagging.moves import keep_stored_values, placed
from sink.tagging.outcomes import QUARANTINED, record_partitions, summary
from sink.tagging.partial import fold_nulls, unsent_records
from sink.tagging.placement import AMBIGUOUS, place_deletes, unplaced_deletes
from sink.tagging.task_context import TaskContext
from sink.tagging.task_stats import StepClock, TaskStats, stats_batch
from sink.tagging.writing import HISTORY_EVENT

log = logging.getLogger(__name__)

# A valid delete record, passed on to the driver for the tombstone table (write_files).
DELETE_RECORD_OP = "_delete_record"


def tag_batches(ctx: TaskContext, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """mapInArrow body: pass records to quarantine through, tag the others shard by shard,
    then report stats."""
    batches = list(batches)
    records = pa.Table.from_batches(batches) if batches else None
    stats = TaskStats()
    parts = []
    if records is not None and records.num_rows:
        bad = pc.is_valid(records.column(C.REASON))
        if pc.any(bad).as_py():
            parts.append(_passed_through(records.filter(bad), ctx.output_schema))
            records = records.filter(pc.invert(bad))
        shards = pc.unique(records.column(C.SHARD)).to_pylist()
        for shard in shards:
            rows = records if len(shards) == 1 else records.filter(pc.equal(records.column(C.SHARD), shard))
            parts.append(_tag_shard(ctx, int(shard), rows, stats).cast(ctx.output_schema))
    if parts:
        out = pa.concat_tables(parts)
        pids = record_partitions(out, list(ctx.table.partition_by), ctx.table.scope)
        stats = dataclasses.replace(stats, **summary(out, pids, ctx.table.scope, list(ctx.table.partition_by)))
        if ctx.write_files or ctx.merge_source:
            out = _for_writing(ctx, out, pids)
        if ctx.merge_source:
            changed = out.filter(pc.fill_null(pc.is_in(out.column(C.WRITE), pa.array([UPDATE, DELETE])), False))
            stats.changed_pids = pc.unique(keys.partition_ids(changed, list(ctx.table.partition_by))).to_pylist()
        yield from out.to_batches()
    yield stats_batch(ctx.output_schema, stats)


def _for_writing(ctx: TaskContext, records: pa.Table, pids: pa.Array) -> pa.Table:
    """The task's output when Spark tasks write the files: the writes (in global scope aimed at
    the rows they change), the quarantined records, and the valid delete records again, as
    DELETE_RECORD_OP rows that no task writes."""
    write, op = records.column(C.WRITE), records.column(C.OP)
    written = pc.fill_null(pc.not_equal(write, TOMBSTONE), False)
    writes = records.filter(written)
    if ctx.history:  # every valid record is an event of its key's history
        writes = records.filter(pc.is_null(records.column(C.REASON)))
        writes = writes.set_column(writes.schema.get_field_index(C.WRITE), C.WRITE,
                                   pa.array([HISTORY_EVENT] * writes.num_rows, pa.string()))
    elif ctx.table.scope == "global":
        writes = placed(writes, pids.filter(written), ctx.table.partition_by)
        if ctx.keeps_stored_values:
            table = DeltaTable(ctx.table.table_uri, version=ctx.table_version)
            writes = keep_stored_values(writes, lambda p, cols: rows_in(table, p, cols),
                                        pa.schema(table.schema().to_arrow()).names, ctx.table.key,
                                        ctx.table.partition_by, ctx.table.ordering)
    quarantined = pc.fill_null(pc.equal(op, QUARANTINED), False)
    deletes = records.filter(pc.and_(pc.fill_null(records.column(C.DELETE), False), pc.invert(quarantined)))
    deletes = deletes.set_column(deletes.schema.get_field_index(C.OP), C.OP,
                                 pa.array([DELETE_RECORD_OP] * deletes.num_rows, pa.string()))
    deletes = deletes.set_column(deletes.schema.get_field_index(C.WRITE), C.WRITE, pa.nulls(deletes.num_rows,
                                                                                            pa.string()))
    return pa.concat_tables([records.filter(quarantined), deletes, writes.cast(ctx.output_schema)])


def stats_table(ctx: TaskContext, stats: TaskStats) -> pa.Table:
    """`stats` as the one-row table a tagging task ends its output with."""
    return pa.Table.from_batches([stats_batch(ctx.output_schema, stats)])


def _passed_through(bad: pa.Table, schema: pa.Schema) -> pa.Table:
    n = bad.num_rows
    tags = {C.OP: pa.array([QUARANTINED] * n, pa.string()), C.WRITE: pa.nulls(n, pa.string()),
            C.STORED_AT: pa.nulls(n, pa.string()), C.LOCATION: pa.nulls(n, pa.string()),
            C.HIT: pa.nulls(n, pa.bool_()), C.STATS: pa.nulls(n, pa.string()), C.PARTIAL: pa.nulls(n, pa.bool_())}
    return pa.table([tags[f.name] if f.name in tags else bad.column(f.name) for f in schema], schema=schema)


class LazySource:
    """The shard's Delta tables, opened on first use (most batches load nothing) and
    borrowed from the tables this process keeps open for the sink (sink.lakehouse.engines.open_tables)
    until the block using it ends."""

    def __init__(self, ctx: TaskContext, shard: int):
        self._ctx, self._shard, self._source = ctx, shard, None
        self._borrowed = ExitStack()

    def __enter__(self) -> LazySource:
        return self

    def __exit__(self, *exc) -> None:
        self._borrowed.close()

    @property
    def opened(self) -> bool:
        """Whether this task read the tables (a bootstrap or partition loads)."""
        return self._source is not None

    def get(self) -> ShardSource:
        if self._source is None:
            ctx = self._ctx
            table = self._borrowed.enter_context(
                open_tables.lend(ctx.table.table_uri, ctx.sink_instance, ctx.table_version))
            tombstones = (self._borrowed.enter_context(open_tables.lend(ctx.tombstone_uri, ctx.sink_instance))
                          if DeltaTable.is_deltatable(ctx.tombstone_uri) else None)
            self._source = ShardSource.of(table, tombstones, ctx.table.key, ctx.table.ordering, self._shard,
                                          ctx.num_shards,
                                          ctx.table.partition_by, ctx.history)
        return self._source


def prepare_replica(ctx: TaskContext, replica: ShardReplica, source: LazySource, shard: int,
                    stats: TaskStats) -> None:
    """Catch the replica up to the batch's table version; bootstrap it if it was emptied."""
    own_changes = None
    if ctx.changelog_uri:
        def own_changes(read_version: int, batch: int):
            header = dataclasses.replace(ctx.changelog_header(), batch_id=batch)
            return changelog.read(ctx.changelog_uri, read_version, header, shard)
    report = catch_up(
        replica, ctx.table_version,
        lambda v: read_commit(ctx.table.table_uri, v, list(ctx.table.partition_by), ctx.partition_log_keys),
        ctx.writer_id, shard, own_changes, ctx.num_shards,
    )
    stats.commits_read += report.commits_read
    stats.invalidated += len(report.invalidated)
    stats.changelog_applied += report.changelog_applied
    stats.shard_moves += report.moved_batches > 0
    if report.rebuilt is not None:
        stats.rebuilt += 1
        booted = bootstrap(
            replica, source.get(), ctx.table.partition_by, (ctx.index.partition_date, ctx.index.partition_date_format),
            ctx.index.tiering_column, ctx.index.bootstrap_days, ctx.now,
        )
        _count_loads(stats, {"bootstrap": booted.partitions}, booted)
    replica.keyspaces.hold_wanted()


def _tag_shard(ctx: TaskContext, shard: int, rows: pa.Table, stats: TaskStats) -> pa.Table:
    """Tag one shard's records; a replica found damaged while reading is wiped and the
    shard tagged again on a rebuilt one (damage found on open is repaired by the open)."""
    path = replica_path(ctx.index_root(), ctx.table_id, shard, ctx.num_shards)
    try:
        return _tag_shard_on(ctx, shard, rows, stats, path)
    except ReplicaLostError as e:
        log.warning("%s: rebuilt from the table", e)
    except Exception as e:
        if not is_corruption(e):
            raise
        wipe_damaged(path, e)
    stats.replicas_repaired += 1
    return _tag_shard_on(ctx, shard, rows, stats, path)


def _tag_shard_on(ctx: TaskContext, shard: int, rows: pa.Table, stats: TaskStats, path) -> pa.Table:
    clock = StepClock(stats.tag_steps)
    pids = keys.partition_ids(rows, ctx.table.partition_by)
    located = ctx.table.scope == "global"
    unplaced = np.zeros(rows.num_rows, bool) if located else unplaced_deletes(rows, ctx.table.partition_by,
                                                                               rows.column(C.DELETE))
    quarantined = None
    with use_replica(ctx, path, shard=shard) as replica, LazySource(ctx, shard) as source:
        clock.lap("open")
        stats.replicas_repaired += replica.repaired is not None
        stats.snapshots_restored += replica.restored is not None
        prepare_replica(ctx, replica, source, shard, stats)
        clock.lap("catch_up")
        held = set(replica.partitions())  # before this task's loads: those are fresh from the tables
        needed, everywhere, peeked = _hold(ctx, replica, source, pids, rows.column(C.KEY), unplaced.any(), stats)
        clock.lap("load")
        if unplaced.any():
            rows, pids, quarantined = _place(ctx, replica, rows, pids, unplaced, stats)
            needed = list(dict.fromkeys([*needed, *pc.unique(pids).to_pylist()]))
            clock.lap("place")
        fraction = 0.0 if located or ctx.history else ctx.index.verifies(
            ctx.batch_id, shard=shard, num_shards=ctx.num_shards, whole_table=not ctx.table.partition_by)
        replica.touch(needed, ctx.now)
        counted = (dict(replica.lookups), dict(stats.lookups), stats.cross_partition_checked,
                   stats.cross_partition_keys)
        check = sampled_check.start(ctx, replica, source.get, shard, pids, rows.column(C.KEY), held - set(peeked),
                                    fraction) if fraction else None
        try:  # from the check's start: the replica stays open until its read of it is done
            inputs, result = _classify(ctx, replica, rows, pids, located, peeked, stats, clock)
            if check is not None and (drifted := sampled_check.drifted(ctx, shard, check, stats)):
                for pid in drifted:  # reloaded, and the records tagged again against them
                    replica.drop_partition(pid, invalidated=True)
                _load_missing(ctx, replica, source, drifted, stats)
                clock.lap("verify")
                replica.lookups, stats.lookups, stats.cross_partition_checked, stats.cross_partition_keys = counted
                inputs, result = _classify(ctx, replica, rows, pids, located, peeked, stats, clock)
        finally:
            if check is not None:
                futures.wait([check])
                clock.lap("verify")
        # Set aside, and the rest tagged again (their lookups counted once), until none is left.
        while (refused := _set_aside(ctx, rows, inputs, pids, located, result)) is not None:
            aside, reasons = refused
            bad = rows.filter(pa.array(aside)).drop_columns([C.REASON]).append_column(C.REASON, pa.array(reasons))
            bad = _passed_through(bad, ctx.output_schema)
            quarantined = bad if quarantined is None else pa.concat_tables([quarantined, bad])
            rows, pids = rows.filter(pa.array(~aside)), pids.filter(pa.array(~aside))
            replica.lookups, stats.lookups, stats.cross_partition_checked, stats.cross_partition_keys = counted
            inputs, result = _classify(ctx, replica, rows, pids, located, peeked, stats, clock)
        # Loaded, checked by the sampled verification, nothing staged: as a restart would want it.
        replica_snapshots.publish_if_due(ctx, replica, shard, stats)
        replica.stage(ctx.batch_id, result.changes, ctx.table_version)
        clock.lap("stage")
        if source.opened:  # a cold batch anyway: hold now what its lookups asked for, not in the next one
            replica.keyspaces.hold_wanted()
        for tier, n in replica.lookups.items():
            stats.lookups[tier] += n
        stats.evicted += len(evict(replica, ctx.now, ctx.index.partition_ttl_hours, ctx.index.index_max_bytes,
                                      {*needed, *everywhere}))
        sizes = _sizes(replica, ctx.now, fresh=ctx.index.index_max_bytes is not None)
        stats.partitions_held += len([pid for pid in sizes if pid != ctx.shield_pid])  # table partitions
        stats.cached_records += sum(e for e, _ in sizes.values())
        stats.cached_bytes += sum(b for _, b in sizes.values())
        clock.lap("upkeep")
    clock.lap("close")
    stats.shard_ids.append(shard)
    if ctx.stream.freshness_column:
        stats.source_times.append(freshness.sample(rows.column(ctx.stream.freshness_column)))
    kept = C.stream_columns(rows.column_names) + [
        C.REASON, C.DELETE, C.KEY, C.SHARD, *helper_columns(len(ctx.table.ordering))]
    partial = pa.nulls(rows.num_rows, pa.bool_())
    if ctx.keeps_stored_values:
        values, groups = _fold_inputs(ctx, rows, inputs, pids, located)
        rows, folded = fold_nulls(rows, values, groups, inputs[2], inputs[4], result.op, result.write,
                                  nulls_kept=ctx.ignore_null_updates, unchanged=ctx.stream.unchanged_value,
                                  key_cols=ctx.table.key)
        if ctx.ignore_null_updates:  # PARTIAL: the write's nulls keep stored values
            partial = folded
    tagged = (
        rows.select(kept).append_column(C.OP, result.op)
        .append_column(C.WRITE, result.write)
        .append_column(C.STORED_AT, result.stored_at if located else pa.nulls(rows.num_rows, pa.string()))
        .append_column(C.LOCATION, result.location if located else pa.nulls(rows.num_rows, pa.string()))
        .append_column(C.HIT, result.hit)
        .append_column(C.STATS, pa.nulls(rows.num_rows, pa.string()))
        .append_column(C.PARTIAL, partial)
    )
    if ctx.changelog_uri:
        changelog.write(ctx.changelog_uri, ctx.table_version, ctx.changelog_header(), shard,
                        result.changes if located and ctx.history else _changelog_entries(ctx, tagged, pids))
    clock.lap("output")
    stats.tag_seconds += clock.total
    return tagged if quarantined is None else pa.concat_tables([tagged.cast(ctx.output_schema), quarantined])


def _classify(ctx: TaskContext, replica: ShardReplica, rows: pa.Table, pids: pa.Array, located: bool, peeked,
              stats: TaskStats, clock: StepClock):
    """The shard's records tagged against the replica: the tagging inputs (keys, partition ids,
    orderings, deletes, arrival) and the result."""
    orderings = [rows.column(c).combine_chunks() for c in helper_columns(len(ctx.table.ordering))]
    inputs = (rows.column(C.KEY).combine_chunks(), pids, orderings, rows.column(C.DELETE).combine_chunks(),
              arrival(rows.column(C.FILE).combine_chunks(), rows.column(C.SEQ).combine_chunks(), ctx.file_order))
    expiry = {"now": int(ctx.now), "expire_before": ctx.expire_before}
    clock.lap("inputs")
    if located:
        answered: list = [[], []]  # the keys looked up and their entries

        def lookup(looked_up: list[bytes]):
            answered[:] = [looked_up, replica.lookup_packed(GLOBAL, looked_up)]
            return answered[1]

        result = tag_global(*inputs, clock.timed("lookup", lookup), ctx.stream.incoming_wins_ties, **expiry)
        if ctx.history:
            changes, stored = history_locations.widen(result.changes, inputs[0], pids, *answered,
                                                      len(ctx.table.ordering))
            result = dataclasses.replace(result, changes=changes, stored_at=stored)
        clock.lap("classify")
    else:
        shield = None
        if ctx.shield_pid is not None and not replica.keyspaces.is_empty(ctx.shield_pid):
            shield = (ctx.shield_pid, clock.timed("lookup", lambda ks: replica.peek(ctx.shield_pid, ks)))
        result = tag(*inputs, clock.timed("lookup", _with_peeked(replica.lookup_packed, peeked, stats)),
                     ctx.stream.incoming_wins_ties, **expiry, shield=shield)
        clock.lap("classify")
        _check_cross_partition(ctx, replica, inputs[0], pids, result.write, stats)
        clock.lap("cross_check")
    return inputs, result


def _set_aside(ctx: TaskContext, rows: pa.Table, inputs: tuple, pids: pa.Array, located: bool, result):
    """The records to set aside (a mask) and why, or None: changes to an append-only table's rows
    (sink.tagging.append_only), or unsent values with no stored row (unsent_values = "quarantine")."""
    unsent = ctx.stream.unchanged_value is not None and ctx.stream.unsent_values == "quarantine" and \
        ctx.keeps_stored_values
    if not (ctx.append_only or unsent):  # most tables: nothing to fold keys for
        return None
    values, groups = _fold_inputs(ctx, rows, inputs, pids, located)
    refused = stored_row_changes(rows, groups, result.write, key_cols=ctx.table.key, table_uri=ctx.table.table_uri,
                                 fails=ctx.stream.append_only_changes == "fail") if ctx.append_only else None
    if refused is not None or not unsent:
        return refused
    return unsent_records(rows, values, groups, inputs[2], inputs[4], result.op, result.write,
                          nulls_kept=ctx.ignore_null_updates, unchanged=ctx.stream.unchanged_value,
                          key_cols=ctx.table.key)


def _fold_inputs(ctx: TaskContext, rows: pa.Table, inputs: tuple, pids: pa.Array, located: bool):
    """What sink.tagging.partial folds: the value columns, and each record's key (with its partition
    where keys are unique per partition)."""
    keys_only = (*ctx.table.key, *ctx.table.partition_by, *ctx.table.ordering)
    values = [n for n in C.stream_columns(rows.column_names) if n not in keys_only]
    return values, inputs[0] if located else pc.binary_join_element_wise(pids, inputs[0], "\x00")


def _changelog_entries(ctx: TaskContext, tagged: pa.Table, pids: pa.Array) -> pa.Table:
    """The index entry after this batch of every key the shard's records change (what the
    shard stages)."""
    written = pc.is_valid(tagged.column(C.WRITE))
    writes = tagged.filter(written)
    write = writes.column(C.WRITE)
    if ctx.table.scope == "global":
        where = writes.column(C.LOCATION)
    else:
        where = pids.filter(written)
        if ctx.table.partition_by:
            where = pc.fill_null(where, keys.null_partition_id(ctx.table.partition_by))
    width = len(ctx.table.ordering)
    deleted = pc.or_(pc.equal(write, DELETE), pc.equal(write, TOMBSTONE))
    return pa.table({
        "pid": where,
        "key": writes.column(C.KEY).cast(pa.binary()),
        **{name: writes.column(c) for name, c in zip(ordering_names(width), helper_columns(width))},
        "deleted": deleted,
        "deleted_at": pc.if_else(deleted, int(ctx.now), 0),
    })


def _hold(ctx: TaskContext, replica: ShardReplica, source: LazySource, pids: pa.Array, keys_: pa.Array,
          unplaced: bool, stats: TaskStats) -> tuple[list[str], list[str], dict[str, dict[bytes, bytes]]]:
    """Load what tagging records of partitions `pids` (keys `keys_`) needs and the replica
    lacks: their partitions (the keyspace in global scope), the shield, and with deletes that
    name no partition (`unplaced`) every partition of the table; partitions it lacks that the
    records name few keys of are read for those keys instead (`_peek`). Returns (partitions
    the records use, every partition of the table or none, the entries read per partition)."""
    if ctx.table.scope == "global":
        _load_missing(ctx, replica, source, [GLOBAL], stats)
        return [GLOBAL], [], {}
    needed = pc.unique(pids).drop_null().to_pylist()
    # Before the shield joins them: it is the index's own partition, never read from the table.
    peeked = {} if unplaced or ctx.history else _peek(ctx, replica, source, needed, pids, keys_, stats)
    if ctx.shield_pid is not None:
        if not replica.has_partition(ctx.shield_pid):
            # The index's own record of key-only deletes, not a table partition: loaded with
            # the replica (one small read) and not counted among partition loads.
            load_partitions(replica, source.get(), [ctx.shield_pid], "shield", now=ctx.now)
        needed.append(ctx.shield_pid)
    everywhere = table_partitions(source.get()) if unplaced else []
    _load_missing(ctx, replica, source, [p for p in dict.fromkeys([*needed, *everywhere]) if p not in peeked], stats)
    return needed, everywhere, peeked


def _peek(ctx: TaskContext, replica: ShardReplica, source: LazySource, needed: list[str], pids: pa.Array,
          keys_: pa.Array, stats: TaskStats) -> dict[str, dict[bytes, bytes]]:
    """Partitions among `needed` the replica lacks (none it dropped for another writer's
    commit: those were in use and load again), of which the records name at most
    `peek_max_keys` keys: read for those keys alone (the entries a load would give them),
    unless this would be the partition's PEEKS_BEFORE_LOAD-th read within
    `partition_ttl_hours` (it loads then). Nothing of them is written to the replica: a batch
    with a few late records for a cold partition does not pay for indexing all of it."""
    if ctx.index.peek_max_keys <= 0:
        return {}
    # Not a partition a commit of another writer dropped: it was in use, it loads again.
    missing = [p for p in needed if not replica.has_partition(p) and not replica.meta.was_invalidated(p)]
    window_s = ctx.index.partition_ttl_hours * 3600
    wanted = {}
    for pid, named in keys_per_partition(pids, keys_, missing).items():
        if (len(named) <= ctx.index.peek_max_keys
                and replica.meta.record_peek(pid, ctx.now, window_s) < PEEKS_BEFORE_LOAD):
            wanted[pid] = named
    peeked = peek_partitions(source.get(), wanted) if wanted else {}
    stats.peeks += len(peeked)
    return peeked


def keys_per_partition(pids: pa.Array, keys_: pa.Array, among: Sequence[str]) -> dict[str, pa.Array]:
    """The distinct keys (binary) the records name in each partition of `among`."""
    if not among:
        return {}
    mask = pc.fill_null(pc.is_in(pids, value_set=pa.array(among, pa.string())), False)
    named = pa.table({"p": pc.filter(pids, mask), "k": pc.filter(keys_, mask).cast(pa.binary())})
    grouped = named.group_by("p").aggregate([("k", "distinct")])
    pids_named = grouped.column("p").to_pylist()
    return {pid: distinct.values for pid, distinct in zip(pids_named, grouped.column("k_distinct"))}


def _with_peeked(lookup, peeked: Mapping[str, Mapping[bytes, bytes]], stats: TaskStats):
    """`lookup`, but answered from the entries read for them in the partitions `peeked`."""
    if not peeked:
        return lookup

    def answered(pid: str, keys_: list[bytes]) -> list[bytes | None]:
        entries = peeked.get(pid)
        if entries is None:
            return lookup(pid, keys_)
        raws = [entries.get(k) for k in keys_]
        found = sum(r is not None for r in raws)
        stats.lookups["table"] += found
        stats.lookups["table_miss"] += len(raws) - found
        return raws

    return answered


def _load_missing(ctx: TaskContext, replica: ShardReplica, source: LazySource, pids: list[str],
                  stats: TaskStats) -> None:
    """Load the partitions of `pids` the replica lacks, all together."""
    missing = [p for p in pids if not replica.has_partition(p)]
    if missing:
        invalidated = {p for p in missing if replica.meta.was_invalidated(p)}
        loaded = load_partitions(replica, source.get(), missing,
                                 lambda p: "invalidated" if p in invalidated else "on_demand", now=ctx.now)
        _count_loads(stats, {"invalidated": len(invalidated), "on_demand": len(missing) - len(invalidated)}, loaded)


def _place(ctx: TaskContext, replica: ShardReplica, rows: pa.Table, pids: pa.Array, unplaced: np.ndarray,
           stats: TaskStats) -> tuple[pa.Table, pa.Array, pa.Table]:
    """Place the deletes that name no partition (sink.tagging.placement; the replica holds every
    partition of the table): the records left to tag with their partition columns set, their
    partition ids, and the ambiguous ones as quarantined output."""
    encoded = rows.column(C.KEY).combine_chunks().cast(pa.binary())
    live = replica.keyspaces.live_partitions(encoded.filter(pa.array(unplaced)).to_pylist())
    deletes = pc.fill_null(rows.column(C.DELETE), False).to_numpy(zero_copy_only=False)
    placement = place_deletes(encoded, pids, unplaced, deletes, live, ctx.shield_pid, ctx.table.partition_by)
    for outcome, n in (("located", placement.located), ("unknown", placement.unknown),
                       (AMBIGUOUS, len(placement.reasons))):
        stats.without_partition[outcome] += n
    rows = keys.with_partition_values(rows, placement.pids, ctx.table.partition_by)
    bad = rows.filter(pa.array(placement.ambiguous))
    bad = bad.set_column(bad.schema.get_field_index(C.REASON), C.REASON, pa.array(placement.reasons, pa.string()))
    kept = pa.array(~placement.ambiguous)
    return rows.filter(kept), placement.pids.filter(kept), _passed_through(bad, ctx.output_schema)


def _check_cross_partition(ctx: TaskContext, replica: ShardReplica, encoded: pa.Array, pids: pa.Array,
                           write: pa.Array, stats: TaskStats) -> None:
    """Partitioned scope: are new keys already stored in another partition (a second row)?
    Up to `cross_partition_check` inserted keys per shard, spread over the batch, are looked
    up in the replica's other held partitions; checking every insert would cost a lookup per
    held partition each."""
    if ctx.index.cross_partition_check <= 0 or not ctx.table.partition_by:
        return
    inserted = np.flatnonzero(pc.fill_null(pc.equal(write, INSERT), False).to_numpy(zero_copy_only=False))
    if len(inserted) > ctx.index.cross_partition_check:
        inserted = inserted[np.linspace(0, len(inserted) - 1, ctx.index.cross_partition_check).astype(np.int64)]
    if not len(inserted):
        return
    take = pa.array(inserted)
    checked_keys = encoded.take(take).cast(pa.binary()).to_pylist()
    checked_pids = pids.take(take).to_pylist()
    found = replica.keyspaces.live_elsewhere(checked_keys, checked_pids)
    stats.cross_partition_checked += len(checked_keys)
    stats.cross_partition_keys += len(found)
    if found and stats.cross_partition_example is None:
        key, stored = next(iter(found.items()))
        own = checked_pids[checked_keys.index(key)]
        stats.cross_partition_example = [key.decode("utf-8", "replace"), own, stored]


# A replica kept open is flushed at most this often. The WAL is off either way: a process that
# dies leaves its replica marked dirty, and it is rebuilt, never trusted. Flushing serves readers
# beside the process (python -m sink verify) and bounds the memtables to this long's writes;
# flushing after every batch cost ~1.5 ms per partition the batch wrote to.
FLUSH_EVERY_S = 60.0


@contextmanager
def use_replica(ctx: TaskContext, path, flush: bool = True, *, shard: int):
    """`_use`, where a failure of a replica whose directory was removed during the use is a
    ReplicaLostError (invariant 3: losing the replica costs a rebuild, not the batch)."""
    with _use(ctx, path, flush, shard) as replica:
        try:
            yield replica
        except Exception as e:
            if not replica.replaced():
                raise
            raise ReplicaLostError(f"replica {path} was removed while in use ({first_line(e)})") from e


@contextmanager
def _use(ctx: TaskContext, path, flush: bool, shard: int):
    """The shard's replica for one use: kept open by the driver (`flush`: flushed after the use
    when its last flush is FLUSH_EVERY_S old) or by a reused Python worker (checkpointed in
    the background, sink.index.worker_replicas), else opened and closed."""
    options = {"hot_cache_entries": ctx.index.hot_cache_entries, "block_cache_bytes": ctx.index.block_cache_bytes,
               "resident_keys": resident_keys(ctx.index.resident_keys, driver=ctx.keep_open),
               "seed": replica_snapshots.seed(ctx, shard)}
    if not ctx.keep_open:
        if worker_replicas.reused_worker():
            with worker_replicas.use(path, ctx.spec, **options) as replica:
                yield replica
            return
        with ShardReplica.open(path, ctx.spec, **options) as replica:
            yield replica
        return
    with registry.kept(path, ctx.spec, **options) as replica:
        try:
            yield replica
        finally:
            if flush and time.monotonic() - replica.flushed_at >= FLUSH_EVERY_S and not replica.replaced():
                replica.flush()


_SIZES: dict[str, tuple[float, dict]] = {}
SIZES_EVERY_S = 60.0


def _sizes(replica: ShardReplica, now: float, fresh: bool) -> dict[str, tuple[int, int]]:
    """Per-partition (entries, bytes) for the gauges: RocksDB's estimates cost a property
    read per column family, so they are refreshed once a minute per replica (always when a
    byte budget needs them); partitions dropped since are left out."""
    key = str(replica.path)
    taken, sizes = _SIZES.get(key, (float("-inf"), {}))
    if fresh or now - taken >= SIZES_EVERY_S:
        sizes = replica.keyspaces.partition_sizes()
        _SIZES[key] = (now, sizes)
    held = replica.partitions()
    return {pid: size for pid, size in sizes.items() if pid in held}


def _count_loads(stats: TaskStats, partitions: dict[str, int], report) -> None:
    """Count one load: its partitions by reason, its keys and seconds."""
    for reason, n in partitions.items():
        stats.loads[reason] += n
    stats.load_seconds += report.seconds
    stats.loaded_keys += report.keys
