"""Snapshots of shard replicas, published beside the table, so that a process without a
replica (a new executor, a driver on a new disk) starts from the newest one and catches up
from the Delta log instead of reading the key columns of the whole table.

Layout: `<snapshot_uri>/<table id>/shard-<s>-of-<N>/<version:020d>-<token>/`, holding the
files of a closed replica (a RocksDB checkpoint: table files, MANIFEST, OPTIONS, CURRENT; and
its key filters) and, written last, `SNAPSHOT.json` naming them with their sizes. A folder
without it is unfinished (a process stopped while uploading) and never read. The table id
is the Delta table's metadata id, so a re-created table never starts from an old snapshot;
the key spec inside is checked at open as a local replica's is.

A snapshot is the replica at the version a batch tagged against, caught up and with nothing
staged; the commits after it reach a restored replica through catch-up: this writer's
batches from the index changelog, other writers' commits by invalidating what they touched.
"""

from __future__ import annotations

import json
import logging
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path

import obstore
from obstore.exceptions import NotFoundError

from sink.delta_log.log_store import store
from sink.index.replica import PUBLISHING
from sink.library_errors import first_line

log = logging.getLogger(__name__)

DONE_FILE = "SNAPSHOT.json"
# Finished snapshots kept per shard: the newest, and the one before it for a process that
# is downloading it while the newest lands.
KEPT = 2
# What a missing object raises (obstore's error on object stores, the built-in one on local files).
_MISSING = (NotFoundError, FileNotFoundError)


@dataclass(frozen=True)
class SnapshotPlace:
    """Where one shard's snapshots of one table live."""

    uri: str
    table_id: str
    shard: int
    num_shards: int

    @property
    def prefix(self) -> str:
        return f"{self.table_id}/shard-{self.shard}-of-{self.num_shards}"


def due(version: int, published: int | None, every: int) -> bool:
    """Whether a replica at `version` publishes a snapshot, its last one (published or restored
    from) at `published`: once `every` versions have passed since, and at once when it has none
    (its load was the cost a snapshot saves); never for `every` 0."""
    return every > 0 and (published is None or version - published >= every)


def folder_version(name: str) -> int | None:
    """The table version a snapshot folder's name says (None: not a snapshot folder)."""
    head = name.rsplit("/", 1)[-1].split("-", 1)[0]
    return int(head) if head.isdigit() else None


def publish(files: Path, version: int, place: SnapshotPlace) -> str:
    """Upload the closed replica copied into `files` as the snapshot of `version`, then expire
    the shard's older snapshots; returns its folder. The done file goes last."""
    objects = store(place.uri, new=True)
    folder = f"{place.prefix}/{version:020d}-{uuid.uuid4().hex[:12]}"
    sizes = {}
    for path in sorted(p for p in files.iterdir() if p.is_file()):
        obstore.put(objects, f"{folder}/{path.name}", path)
        sizes[path.name] = path.stat().st_size
    obstore.put(objects, f"{folder}/{DONE_FILE}", json.dumps({"version": version, "files": sizes}).encode())
    try:
        _expire(objects, place, version)
    except Exception as e:  # published all the same; the next publish expires them
        log.warning("replica snapshots of %s/%s older than version %s not expired: %s", place.uri, place.prefix,
                    version, first_line(e))
    return folder


def restore(place: SnapshotPlace, into: Path, at_most: int) -> int | None:
    """Download the newest finished snapshot of at most version `at_most` into the empty
    directory `into`; returns its version, or None when there is none (or none could be read:
    each failure is logged and the next older one tried, and `into` is left empty)."""
    root = _local_root(place.uri)
    if root is not None and not root.is_dir():
        return None  # none published yet
    try:
        objects = store(place.uri)
        folders = obstore.list_with_delimiter(objects, place.prefix + "/")["common_prefixes"]
    except Exception as e:
        log.warning("replica snapshots at %s/%s not listed (%s); the replica loads from the table", place.uri,
                    place.prefix, first_line(e))
        return None
    versions = {f: folder_version(f) for f in folders}
    usable = sorted((f for f, v in versions.items() if v is not None and v <= at_most), key=versions.get,
                    reverse=True)
    for folder in usable:
        try:
            done = json.loads(bytes(obstore.get(objects, f"{folder}/{DONE_FILE}").bytes()))
        except _MISSING:
            continue  # unfinished
        except Exception as e:
            log.warning("replica snapshot %s/%s unreadable, trying an older one: %s", place.uri, folder,
                        first_line(e))
            continue
        try:
            _download(objects, folder, done["files"], into)
            return int(done["version"])
        except Exception as e:
            log.warning("replica snapshot %s/%s not restored, trying an older one: %s", place.uri, folder,
                        first_line(e))
            _empty(into)
    return None


def _download(objects, folder: str, sizes: dict[str, int], into: Path) -> None:
    for name, size in sizes.items():
        target = into / name
        with open(target, "wb") as out:
            for chunk in obstore.get(objects, f"{folder}/{name}").stream():
                out.write(chunk)
        if target.stat().st_size != size:
            raise ValueError(f"{name} is {target.stat().st_size} bytes, the snapshot says {size}")


def _empty(directory: Path) -> None:
    for entry in directory.iterdir():
        if entry.is_dir():
            shutil.rmtree(entry)
        else:
            entry.unlink()


def _expire(objects, place: SnapshotPlace, newest: int) -> None:
    """Delete the shard's finished snapshots past the KEPT newest, and unfinished ones older
    than the newest (a process that stopped while uploading left them)."""
    listed = obstore.list_with_delimiter(objects, place.prefix + "/")["common_prefixes"]
    folders = {f: v for f in listed if (v := folder_version(f)) is not None}
    finished = {f for f in folders if _exists(objects, f"{f}/{DONE_FILE}")}
    keep = set(sorted(finished, key=folders.get, reverse=True)[:KEPT])
    for folder, version in folders.items():
        if folder in keep or (folder not in finished and version >= newest):
            continue
        paths = [o["path"] for batch in obstore.list(objects, folder + "/") for o in batch]
        done = [p for p in paths if p.endswith(DONE_FILE)]
        obstore.delete(objects, done)  # first, on its own: a reader never takes a folder being emptied
        obstore.delete(objects, [p for p in paths if p not in done])
        if (root := _local_root(place.uri)) is not None:  # a local folder stays listed until removed
            shutil.rmtree(root / folder, ignore_errors=True)


def _local_root(uri: str) -> Path | None:
    """The directory of a local snapshot location (as `log_store.store` reads it); None for an object store."""
    if "://" not in uri or uri.startswith("file://"):
        return Path(uri.removeprefix("file://"))
    return None


def _exists(objects, path: str) -> bool:
    try:
        obstore.head(objects, path)
        return True
    except _MISSING:
        return False


def local_copy_dir(replica_path: Path) -> Path:
    """Where a replica's copy is made before its upload: beside it, on its filesystem, so that
    RocksDB's checkpoint links its table files instead of copying them (one a killed publish
    leaves is swept by the replica's next open)."""
    return replica_path.parent / f"{PUBLISHING}{replica_path.name}-{uuid.uuid4().hex[:12]}"
