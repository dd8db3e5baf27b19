"""Ways a replica's files get damaged on disk, for the tests."""

import os
from pathlib import Path


def largest_sst(replica_dir: Path) -> Path:
    ssts = sorted(Path(replica_dir).glob("*.sst"), key=os.path.getsize)
    assert ssts, f"no SST file in {replica_dir}"
    return ssts[-1]


def truncate(replica_dir: Path) -> None:
    """Half of the largest SST file is gone (a full disk, a killed copy): RocksDB refuses to open."""
    sst = largest_sst(replica_dir)
    with open(sst, "r+b") as f:
        f.truncate(os.path.getsize(sst) // 2)


def flip_bytes(replica_dir: Path) -> None:
    """Bytes overwritten inside the largest SST's data blocks: opens, fails on read (checksums)."""
    sst = largest_sst(replica_dir)
    size = os.path.getsize(sst)
    with open(sst, "r+b") as f:
        for offset in range(size // 10, size // 2, 256):
            f.seek(offset)
            f.write(b"\xff" * 8)
