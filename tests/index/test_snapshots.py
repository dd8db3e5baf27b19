"""Replica snapshots (sink.index.snapshots): what a restored replica holds, which snapshot an
empty replica starts from, and what is expired."""

import json
import shutil
from pathlib import Path

import obstore
import pytest

from sink.delta_log.log_store import store
from sink.index import snapshots
from sink.index.entry import Entry
from sink.index.replica import ShardReplica
from sink.index.snapshots import DONE_FILE, SnapshotPlace
from sink.index.spec import replica_spec

SPEC = replica_spec(["id"], [], "ts")
KEYS = [f"k{i:03d}".encode() for i in range(200)]


@pytest.mark.parametrize("version, published, every, due", [
    (5, None, 100, True),  # none yet: its load is what a snapshot saves
    (104, 5, 100, False), (105, 5, 100, True), (300, 5, 100, True),
    (5, None, 0, False), (900, 5, 0, False),  # off
])
def test_a_snapshot_is_due_every_n_versions_and_at_once_without_one(version, published, every, due):
    assert snapshots.due(version, published, every) is due


def test_folder_version_reads_the_version_a_folder_is_named_by():
    assert snapshots.folder_version("t/shard-0-of-2/00000000000000000042-ab12") == 42
    assert snapshots.folder_version("t/shard-0-of-2/stray") is None


def _replica(path: Path, version: int, entries: dict[bytes, Entry]) -> ShardReplica:
    replica = ShardReplica.open(path, SPEC)
    replica.load_partition("", list(entries), list(entries.values()), reason="bootstrap")
    replica.set_version(version)
    return replica


def _publish(replica: ShardReplica, place: SnapshotPlace) -> str:
    local = snapshots.local_copy_dir(replica.path)
    try:
        return snapshots.publish(local, replica.copy_to(local), place)
    finally:
        shutil.rmtree(local)


def _restored(path: Path, place: SnapshotPlace, at_most: int) -> ShardReplica:
    return ShardReplica.open(path, SPEC, seed=lambda into: snapshots.restore(place, into, at_most=at_most))


def test_an_empty_replica_starts_from_the_newest_snapshot_at_most_at_the_version_it_reads(tmp_path):
    place = SnapshotPlace(str(tmp_path / "snapshots"), "table-id", 1, 2)
    first = {k: Entry(i, deleted=i % 7 == 0) for i, k in enumerate(KEYS)}
    with _replica(tmp_path / "a", 10, first) as replica:
        _publish(replica, place)
        second = {k: Entry(1000 + i) for i, k in enumerate(KEYS[:50])}
        replica.put_entries("", second)
        replica.set_version(12)
        _publish(replica, place)
        assert replica.lookup("", KEYS[:3]) == [second[k] for k in KEYS[:3]]  # still in use after its copy

    with _restored(tmp_path / "b", place, at_most=12) as restored:
        assert (restored.restored, restored.version, restored.clean) == (12, 12, False)
        assert restored.lookup("", KEYS) == [{**first, **second}[k] for k in KEYS]
        assert restored.lookup("", [b"absent"]) == [None]
    with _restored(tmp_path / "c", place, at_most=11) as restored:  # the table read is older than the newest
        assert (restored.restored, restored.version) == (10, 10)
        assert restored.lookup("", KEYS) == [first[k] for k in KEYS]
    with _restored(tmp_path / "d", place, at_most=9) as restored:  # none old enough: an empty replica
        assert (restored.restored, restored.version, restored.partitions()) == (None, None, {})


def test_an_unfinished_or_damaged_snapshot_is_passed_over_for_an_older_one(tmp_path):
    place = SnapshotPlace(str(tmp_path / "snapshots"), "table-id", 0, 1)
    entries = {k: Entry(i) for i, k in enumerate(KEYS)}
    with _replica(tmp_path / "a", 3, entries) as replica:
        _publish(replica, place)
        replica.set_version(4)
        damaged = _publish(replica, place)
    objects = store(place.uri)
    # A process stopped while uploading version 5.
    obstore.put(objects, f"{place.prefix}/{5:020d}-stopped/000011.sst", b"part of a file")
    sizes = json.loads(bytes(obstore.get(objects, f"{damaged}/{DONE_FILE}").bytes()))["files"]
    sst = next(name for name in sizes if name.endswith(".sst"))
    obstore.put(objects, f"{damaged}/{sst}", b"truncated")
    with _restored(tmp_path / "b", place, at_most=5) as restored:
        assert (restored.restored, restored.version) == (3, 3)
        assert restored.lookup("", KEYS) == [entries[k] for k in KEYS]


def test_a_snapshot_of_another_key_spec_gives_an_empty_replica(tmp_path):
    place = SnapshotPlace(str(tmp_path / "snapshots"), "table-id", 0, 1)
    with _replica(tmp_path / "a", 3, {KEYS[0]: Entry(1)}) as replica:
        _publish(replica, place)
    seed = lambda into: snapshots.restore(place, into, at_most=3)  # noqa: E731
    with ShardReplica.open(tmp_path / "b", replica_spec(["other"], [], "ts"), seed=seed) as other:
        assert (other.restored, other.version, other.partitions()) == (None, None, {})


def test_no_snapshot_root_yet_restores_nothing_and_makes_no_directory(tmp_path):
    place = SnapshotPlace(str(tmp_path / "never"), "table-id", 0, 1)
    (tmp_path / "b").mkdir()
    assert snapshots.restore(place, tmp_path / "b", at_most=10) is None
    assert not (tmp_path / "never").exists()


def test_publishing_keeps_the_two_newest_finished_snapshots_and_drops_older_unfinished_ones(tmp_path):
    place = SnapshotPlace(str(tmp_path / "snapshots"), "table-id", 0, 1)
    with _replica(tmp_path / "a", 1, {KEYS[0]: Entry(1)}) as replica:
        folders = []
        for version in (1, 2, 3):
            replica.set_version(version)
            folders.append(_publish(replica, place))
        objects = store(place.uri)
        obstore.delete(objects, [f"{folders[-1]}/{DONE_FILE}"])  # 3: unfinished
        replica.set_version(4)
        folders.append(_publish(replica, place))

    left = obstore.list_with_delimiter(objects, place.prefix + "/")["common_prefixes"]
    assert sorted(left) == sorted([folders[1], folders[3]])  # 2 and 4 finished; 1 past the two, 3 unfinished


def test_a_replica_a_killed_process_left_dirty_starts_from_the_snapshot(tmp_path):
    place = SnapshotPlace(str(tmp_path / "snapshots"), "table-id", 0, 1)
    entries = {k: Entry(i) for i, k in enumerate(KEYS)}
    with _replica(tmp_path / "a", 7, entries) as replica:
        _publish(replica, place)
    killed = _replica(tmp_path / "b", 9, {KEYS[0]: Entry(99)})
    killed._close_db()  # as a killed process leaves it: dirty, its memtables lost
    with _restored(tmp_path / "b", place, at_most=9) as restored:
        assert (restored.restored, restored.version) == (7, 7)
        assert restored.lookup("", KEYS) == [entries[k] for k in KEYS]


def test_a_seed_that_fails_midway_leaves_an_empty_replica_and_nothing_beside_it(tmp_path):
    def failing(into: Path) -> int:
        (into / "CURRENT").write_text("MANIFEST-000005\n")  # what a download had got to
        raise OSError("connection reset")

    with ShardReplica.open(tmp_path / "b", SPEC, seed=failing) as replica:
        assert (replica.restored, replica.version, replica.partitions()) == (None, None, {})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b"]


def test_an_open_sweeps_what_a_killed_restore_or_publish_left_beside_the_replica(tmp_path):
    for left in (".restore-b-0a1b2c", ".snapshot-b-3d4e5f", ".snapshot-bb-6a7b8c"):
        (tmp_path / left).mkdir()
        (tmp_path / left / "000011.sst").write_bytes(b"part of a file")
    with ShardReplica.open(tmp_path / "b", SPEC):
        pass
    assert sorted(p.name for p in tmp_path.iterdir()) == [".snapshot-bb-6a7b8c", "b"]  # another replica's stays
