"""Copy-on-write commit: rewrite the files that hold updated or deleted keys, write new files
for new keys, and commit the removes and adds with the app transaction in one Delta commit.

What delta-rs' MERGE does for the sink, without its join: the batch's rows are grouped by
partition (the index put them there), each touched partition's files are probed on their key
columns alone for the updated and deleted keys (the index found no row of an insert's key),
and only files with a row that changes are read whole and rewritten. Files this process wrote
lately are read from memory instead (`file_cache`). A stored
row changes exactly when the MERGE's clauses would change it (sink.lakehouse.engines.merge_clauses): the incoming row is
newer by ordering (or equal, when incoming wins ties); a delete removes it, an update replaces
it (partial updates keep stored values where theirs are null). Rows of keys no file holds are
inserted, deletes of them dropped.

A commit checks almost nothing (docs: "The copy-on-write commit and delta-rs"), so
`check_actions` does before the sink's log commit; tables with features a hand-written file
would break stay on MERGE (`features.merge_only_reason`), but for the row checks the batch
made itself (`features.row_checks`).

Its steps are the modules beside it in sink.lakehouse.commit: a stored file's rows
(`stored_rows`), which files hold the batch's keys (`key_hits`), what the batch changes in
them (`file_changes`), one partition's writes (`partition_writes`; divided among cores,
`shares`), the files written (`data_files`, `change_data`), merge-on-read's marks
(`merge_on_read`), and what the commit records and checks (`actions`)."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from deltalake import CommitProperties, DeltaTable

from sink.delta_log import identity, log_commit
from sink.delta_log.column_mapping import ColumnMapping
from sink.delta_log.live_vectors import LiveDeletionVectors
from sink.delta_log.paths import file_location
from sink.delta_log.reading import filesystem
from sink.lakehouse.commit import file_cache
from sink.lakehouse.commit.actions import Rewrite, StoredFile, check_actions, log_actions, operation_of, summed_changes
from sink.lakehouse.commit.file_changes import file_changes
from sink.lakehouse.commit.key_hits import FoundFile, Hits, file_key_columns, matching_files
from sink.lakehouse.commit.merge_on_read import Mark, store_marks
from sink.lakehouse.commit.partition_writes import rewrite_partition
from sink.lakehouse.commit.shares import DRIVER_MIN_ROWS, Share, every_share
from sink.lakehouse.commit.stored_rows import row_keys
from sink.lakehouse.commit.writes import (
    Writes,
    changing,
    conform,
    partition_string,
)


def commit(table: DeltaTable, uri: str, writes: Writes, snapshot: Mapping[str, list[StoredFile]], *,
           vectors: LiveDeletionVectors | None = None) -> Rewrite:
    """Rewrite and commit on the version `table` has loaded, whose files are `snapshot` (or
    fail: no retries); returns what it committed. Commits nothing when no row changes (the
    caller records the batch). `vectors`: see `commit_rewrite`."""
    rewrite = rewrite_files(uri, snapshot, writes)
    commit_rewrite(table, uri, rewrite, snapshot, writes.schema, writes.partition_by, writes.props, vectors=vectors)
    return rewrite


def commit_rewrite(table: DeltaTable, uri: str, rewrite: Rewrite, snapshot: Mapping[str, list[StoredFile]],
                   schema: pa.Schema, partition_by: Sequence[str], props: CommitProperties, *,
                   vectors: LiveDeletionVectors | None = None) -> int:
    """Check the files written (here or by Spark tasks) against `snapshot` (the files of the
    version `table` has loaded) and commit them with `props` in one transaction; returns the
    number of files rewritten. Commits nothing when `rewrite` is empty. The table's live
    deletion vectors (`vectors`) move over a commit written here without reading it back."""
    if rewrite.empty:
        return 0
    mapping = ColumnMapping.of(table)
    check_actions(uri, rewrite, snapshot, schema, partition_by, mapping)
    # The sink's own commit, as Spark's MERGE writes one (deletion vectors, change files,
    # partition values by physical name under column mapping, identity high-water marks in
    # the same commit, a remove's stats and a marked file's modification time kept, metrics
    # as Spark names them): delta-rs' create_write_transaction writes none of these.
    raised = [identity.metadata_action(table, rewrite.identity_highs)] if rewrite.identity_highs else []
    actions = [*raised, *log_actions(rewrite, mapping)]
    version = log_commit.commit(table, uri, actions, props, **operation_of(rewrite),
                                tags={identity.SCHEMA_UPDATE_TAG: "true"} if raised else None)
    if vectors is not None:
        vectors.advance(version, actions)
    return len(rewrite.removes)


def rewrite_files(uri: str, snapshot: Mapping[str, list[StoredFile]], writes: Writes, *,
                  share: Share | None = None, divide: bool = True) -> Rewrite:
    """Write the batch's files in three steps: each partition's files are probed for its
    updated and deleted keys, in threads (pyarrow's reads and kernels release the GIL); what
    the batch changes in all the files found is decided in one pass (`file_changes`), whose
    cost follows the batch's changed rows, not a round of small kernels per partition; then
    each partition's files are written, in threads; with `divide`, a batch that writes one
    partition (an unpartitioned table's) has it written in shares, one per thread
    (sink.lakehouse.commit.shares). A Spark writing task writes its `share` of its partitions
    alone, or (not dividing) all of them."""
    encoded = pc.dictionary_encode(writes.partition_ids())
    names = encoded.dictionary.to_pylist()
    group = encoded.indices.to_numpy(zero_copy_only=False)
    order = np.argsort(group, kind="stable")
    bounds = np.concatenate([[0], np.cumsum(np.bincount(group, minlength=len(names)))])
    rows = writes.rows.take(pa.array(order))
    updating = changing(rows).to_numpy(zero_copy_only=False)
    # Files are probed for the updated and deleted keys only: the index found no stored row
    # for an insert (as the append path trusts it), and most of a partition's writes are
    # inserts (today's partition: ~10x its updates), each of which would be hashed again per
    # file probed. Partition i's are changes[starts[i]:starts[i + 1]].
    changes = rows.filter(pa.array(updating))
    starts = np.concatenate([[0], np.cumsum(updating)])[bounds]
    key_cols = file_key_columns(writes.key_cols, writes.partition_by)
    incoming_keys = row_keys(conform(changes, pa.schema([writes.schema.field(c) for c in key_cols])), key_cols)
    groups = [rows.slice(bounds[i], bounds[i + 1] - bounds[i]) for i in range(len(names))]
    values = [{c: partition_string(g.column(c)[0].as_py()) for c in writes.partition_by} for g in groups]
    fs, root = filesystem(uri)

    def probe(i: int) -> tuple[list[FoundFile], ExitStack]:
        if starts[i] == starts[i + 1]:
            return [], ExitStack()
        with ExitStack() as stack:
            found = matching_files(fs, root, snapshot.get(names[i], []),
                                   incoming_keys.slice(starts[i], starts[i + 1] - starts[i]), key_cols, values[i],
                                   writes.schema, writes.column_mapping, writes.ordering, stack=stack)
            return found, stack.pop_all()

    threads = os.cpu_count() or 2
    with ThreadPoolExecutor(max_workers=threads) as pool:
        probes = list(pool.map(probe, range(len(names))))
        try:
            decided = file_changes([(stored, Hits(hits.rows, hits.incoming + starts[i]))
                                    for i, (found, _) in enumerate(probes) for _, stored, hits, _ in found],
                                   changes, writes, pool=pool)
            ends = np.cumsum([len(found) for found, _ in probes])
            per_partition = [decided[end - len(found):end] for end, (found, _) in zip(ends, probes)]

            def write(job: tuple[int, Share | None]) -> tuple[Rewrite, list[Mark]]:
                i, part = job
                return rewrite_partition(fs, root, groups[i], values[i], probes[i][0], per_partition[i],
                                         np.flatnonzero(updating[bounds[i]:bounds[i + 1]]), writes, part)

            jobs = [(i, share) for i in range(len(names))]
            if share is None and divide and _divided(writes, len(names), threads):
                jobs = [(0, s) for s in every_share(threads)]
            done = list(pool.map(write, jobs))
        finally:  # what the probes read is held for the next batch (`StoredRows.hold`)
            list(pool.map(lambda p: p[1].close(), probes))
    marks = [m for _, partition_marks in done for m in partition_marks]
    marked = {m.stored.path for m in marks}
    for r, _ in done:  # the files replaced (not marked): their rows live on in the new files
        for f in r.removes:
            if f.path not in marked:
                for cache in (file_cache.WRITTEN, file_cache.PROBED):
                    cache.discard(file_location(root, f.path))
    return Rewrite([a for r, _ in done for a in r.adds], [f for r, _ in done for f in r.removes],
                   sum(r.unchanged for r, _ in done),
                   store_marks(fs, root, marks, writes.column_mapping, writes.layout),
                   [c for r, _ in done for c in r.changes],
                   [writes.identity.high()] if writes.identity and writes.identity.high() else [],
                   summed_changes(r.row_changes for r, _ in done))


def _divided(writes: Writes, partitions: int, threads: int) -> bool:
    """Whether the driver writes the batch's one partition in shares (sink.lakehouse.commit.shares):
    a partition of enough rows, with no change data feed or identity values to divide."""
    return (partitions == 1 and threads > 1 and writes.rows.num_rows >= DRIVER_MIN_ROWS and not writes.change_data
            and writes.identity is None)
