"""Arrival order inside one micro-batch: what "later" means when ordering values tie.

Spark's file source admits files oldest first (by modification time), so with one file per
batch the newer file's record wins a tie. Inside one batch its scan packs files largest
first, so the order rows are read in says nothing about which file is newer. Arrival is
therefore (file modification time, file path, position in the file): the same winner however
the files were batched, and on a replay. Records not read from a file (or whose file cannot
be told, e.g. after a shuffle in the user's query) arrive first, in scan order.

A classic session reads the files' order from the batch's plan (`sink.session.classic`);
under Spark Connect no plan can be read, so the records carry their file's path and each task
orders the files of its own records by their modification time (`path_order`).
"""

from __future__ import annotations

import logging

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
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


def path_order(paths: list[str]) -> tuple[str, ...]:
    """File paths (as input_file_name() gives them: URL-encoded URIs) oldest first, ties by
    path; "" (a record not read from a file) is left out. A file whose modification time
    cannot be read (a filesystem pyarrow does not reach) sorts by path after the others."""
    stamped = [(modification_ms(path), path) for path in paths if path]
    unknown = [p for m, p in stamped if m is None]
    if unknown:
        log.warning("cannot read the modification time of %d input files (first: %s): ties between their records "
                    "follow file path order", len(unknown), unknown[0])
    return tuple(p for _, p in sorted(stamped, key=lambda mp: (mp[0] is None, mp[0] or 0, mp[1])))


def modification_ms(uri: str) -> int | None:
    """A file's modification time in ms, as Spark's file source lists it; None when unknown."""
    try:
        fs, path = pafs.FileSystem.from_uri(uri)  # decodes the URI's %-escapes
        mtime = fs.get_file_info(path).mtime_ns  # None for a file that is gone
        return None if mtime is None else mtime // 1_000_000
    except Exception as e:  # a scheme pyarrow has no filesystem for
        log.debug("cannot stat %s (%s)", uri, e)
        return None


def arrival(files: pa.Array, seqs: pa.Array, order: tuple[int, ...] | None) -> pa.Array:
    """Each record's arrival rank: by its file's place in `order` (records of unknown files
    first), then by scan sequence, which follows the position within a file. `files` are
    hashes of the files' paths and `order` the batch's hashes oldest first; or, with `order`
    None, the paths themselves, ordered here (`path_order`)."""
    if order is None:
        order = path_order(pc.unique(files).to_pylist())
    if len(order) < 2:
        return seqs
    rank = pc.fill_null(pc.index_in(files, value_set=pa.array(order, files.type)), -1)
    sorted_idx = pc.sort_indices(pa.table({"f": rank, "s": seqs}),
                                 sort_keys=[("f", "ascending"), ("s", "ascending")]).to_numpy()
    ranks = np.empty(len(seqs), np.int64)
    ranks[sorted_idx] = np.arange(len(seqs))
    return pa.array(ranks)
