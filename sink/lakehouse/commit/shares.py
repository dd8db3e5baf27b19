"""A partition's writes divided among cores (`Share`): an unpartitioned table is one partition,
and routed by partition, a mirror's whole write fell to one core (measured: one writing task
did 87-97% of it with two executors, the driver wrote on one thread).

Every share sees the partition's writes and what they change in its files (the probe), and
does its part of the writing: the stored files it owns it marks or rewrites, the new rows whose
key hashes to it (new keys and new row versions) it writes in a file of its own. Ownership is
decided from what every share holds alike (the files found, in one order), so shares on
different executors agree without talking; a file is marked or rewritten by one share, its
deletion vector made once; the commit stays one transaction."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from sink import keys
from sink.lakehouse.commit.actions import StoredFile

# A partition's writes of fewer rows are not divided on the driver: each share writes a file
# of its own, and a small batch would leave that many small files for one core's work.
DRIVER_MIN_ROWS = 20_000


@dataclass(frozen=True)
class Share:
    """Share `index` of `count`."""

    index: int
    count: int

    def __post_init__(self):
        if not 0 <= self.index < self.count:
            raise ValueError(f"share {self.index} of {self.count}")

    def owned(self, files: Sequence[StoredFile]) -> set[str]:
        """The paths of `files` this share marks or rewrites: each file, largest first (by its
        rows, then its path), to the share with the fewest rows so far, so a rewrite's reads
        and writes divide evenly; every share computes the same."""
        load = np.zeros(self.count, np.int64)
        mine = set()
        for f in sorted(files, key=lambda f: (-(f.num_records or f.size), f.path)):
            to = int(np.argmin(load))
            load[to] += f.num_records or f.size
            if to == self.index:
                mine.add(f.path)
        return mine

    def homes(self, rows: pa.Table, key_cols: Sequence[str]) -> np.ndarray:
        """Per row of `rows`: its key hashes to this share, which writes its new version."""
        if not rows.num_rows:
            return np.zeros(0, bool)
        return keys.shards_of(keys.encode_keys(rows, key_cols), self.count).to_numpy() == self.index


def every_share(count: int) -> list[Share]:
    return [Share(i, count) for i in range(count)]
