"""Ways a replica's files get damaged on disk, for the tests."""

import os
import shutil
import uuid
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


def lose(index_dir: Path) -> None:
    """The replicas under `index_dir` are lost, as an operator's rm removes them. Moved away
    first, at once: a Python worker checkpointing a replica it keeps open writes new files
    into its directory, and a removal in place then fails with 'Directory not empty' (the
    worker's writes land in the moved directory, which it still holds: its close flushes
    there, so the removal may leave files behind)."""
    gone = Path(index_dir).with_name(f"{Path(index_dir).name}-lost-{uuid.uuid4().hex}")  # lost more than once
    os.rename(index_dir, gone)
    shutil.rmtree(gone, ignore_errors=True)
