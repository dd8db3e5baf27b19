"""Arrival order inside one micro-batch: what "later" means when ordering values tie.

Spark's file source admits files oldest first (by modification time), so with one file per
batch the newer file's record wins a tie. Inside one batch its scan packs files largest
first, so the order rows are read in says nothing about which file is newer. Arrival is
therefore (file modification time, file path, position in the file): the same winner however
the files were batched, and on a replay. Records not read from a file (or whose file cannot
be told, e.g. after a shuffle in the user's query) arrive first, in scan order.
"""

from __future__ import annotations

import logging

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import xxhash

from sink.keys import SPARK_XXHASH_SEED

log = logging.getLogger(__name__)


def spark_xxhash64(text: str) -> int:
    """Spark's xxhash64() of a string, as the signed BIGINT Spark returns."""
    h = xxhash.xxh64_intdigest(text.encode(), seed=SPARK_XXHASH_SEED)
    return h - (1 << 64) if h >= 1 << 63 else h


def file_order(files: list[tuple[str, int]]) -> tuple[int, ...]:
    """The hashes of the batch's file paths (as input_file_name() gives them), oldest file
    first, ties by path; each file once (a large file is scanned in several splits)."""
    mtimes = dict(files)
    return tuple(spark_xxhash64(path) for path, _ in sorted(mtimes.items(), key=lambda pm: (pm[1], pm[0])))


def arrival(file_hashes: pa.Array, seqs: pa.Array, order: tuple[int, ...]) -> pa.Array:
    """Each record's arrival rank: by its file's place in `order` (records of unknown files
    first), then by scan sequence, which follows the position within a file."""
    if len(order) < 2:
        return seqs
    rank = pc.fill_null(pc.index_in(file_hashes, value_set=pa.array(order, pa.int64())), -1)
    sorted_idx = pc.sort_indices(pa.table({"f": rank, "s": seqs}),
                                 sort_keys=[("f", "ascending"), ("s", "ascending")]).to_numpy()
    ranks = np.empty(len(seqs), np.int64)
    ranks[sorted_idx] = np.arange(len(seqs))
    return pa.array(ranks)


def batch_files(batch_df) -> list[tuple[str, int]]:
    """(path, modification time in ms) of every file a foreachBatch micro-batch scans, read
    from the batch's RDD lineage (foreachBatch hands over a plan that no longer names its
    files). Empty for other DataFrames, non-file sources or when Spark's internals differ."""
    try:
        plan = batch_df._jdf.queryExecution().analyzed()
        if plan.getClass().getSimpleName() != "LogicalRDD":
            return []
        files: list[tuple[str, int]] = []
        _walk(plan.rdd(), files)
        return files
    except Exception as e:  # an internal API changed: ties fall back to scan order
        log.debug("cannot list the batch's files (%s); ties across files follow scan order", e)
        return []


def _walk(rdd, files: list[tuple[str, int]]) -> None:
    if rdd.getClass().getSimpleName() == "FileScanRDD":
        partitions = rdd.filePartitions()
        for i in range(partitions.size()):
            for f in partitions.apply(i).files():
                files.append((f.urlEncodedPath(), f.modificationTime()))
        return
    deps = rdd.dependencies()
    for i in range(deps.size()):
        dep = deps.apply(i)
        # input_file_name() is empty past a shuffle, so files behind one cannot be told apart.
        if dep.getClass().getSimpleName() != "ShuffleDependency":
            _walk(dep.rdd(), files)
