import dataclasses

import pyarrow as pa
import pytest

from sink.delta_log.reading import NUM_SHARDS_PROPERTY, READ_VERSION_PROPERTY, SHARDS_PROPERTY, CommitSummary
from sink.index import changelog
from sink.index.catchup import catch_up
from sink.index.entry import CHANGES_SCHEMA, Entry
from sink.index.replica import ShardReplica
from sink.index.spec import replica_spec

WRITER = "w"
SHARD = 1


def commit(version, apps=None, partitions=(), shards=None):
    info = {} if shards is None else {SHARDS_PROPERTY: ",".join(map(str, shards))}
    return CommitSummary(version, apps or {}, None if partitions is None else frozenset(partitions), info)


def replica_at(tmp_path, version, partitions=("p1", "p2", "p3")):
    r = ShardReplica.open(tmp_path / "r", "spec")
    r.set_version(version)
    for p in partitions:
        r.load_partition(p, [b"k"], [Entry(1)], reason="on_demand")
    return r


def test_a_new_replica_starts_empty_at_the_target(tmp_path):
    with ShardReplica.open(tmp_path / "r", "spec") as r:
        report = catch_up(r, 9, lambda v: None, WRITER, SHARD)
        assert (r.version, report.commits_read, report.rebuilt) == (9, 0, "new replica")


def test_own_commit_promotes_staged_entries(tmp_path):
    with replica_at(tmp_path, 5) as r:
        r.stage(3, {"p1": {b"k": Entry(9)}})
        report = catch_up(r, 6, {6: commit(6, {WRITER: 3}, ["p1"], [SHARD])}.get, WRITER, SHARD)
        assert report.promoted == 1 and report.invalidated == set()
        assert r.lookup("p1", [b"k"]) == [Entry(9)]
        assert set(r.partitions()) == {"p1", "p2", "p3"} and r.version == 6


def test_foreign_commit_invalidates_exactly_the_partitions_it_touched(tmp_path):
    with replica_at(tmp_path, 5) as r:
        report = catch_up(r, 6, {6: commit(6, {"other": 1}, ["p1", "p3", "p9"])}.get, WRITER, SHARD)
        assert report.invalidated == {"p1", "p3"}
        assert set(r.partitions()) == {"p2"}


def test_own_batch_tagged_elsewhere_invalidates_unless_this_shard_had_no_records(tmp_path):
    with replica_at(tmp_path, 5) as r:
        log = {6: commit(6, {WRITER: 1}, ["p1"], shards=[0]), 7: commit(7, {WRITER: 2}, ["p2"], [SHARD])}
        report = catch_up(r, 7, log.get, WRITER, SHARD)
        assert report.invalidated == {"p2"}  # batch 2 had records here but was staged elsewhere
        assert set(r.partitions()) == {"p1", "p3"}


def test_staged_batch_that_did_not_land_is_discarded(tmp_path):
    with replica_at(tmp_path, 5) as r:
        r.stage(3, {"p1": {b"k": Entry(9)}})
        catch_up(r, 6, {6: commit(6, {"other": 8}, ["p2"])}.get, WRITER, SHARD)
        assert r.staged_batch is None
        assert r.lookup("p1", [b"k"]) == [Entry(1)]


def test_missing_log_entry_or_metadata_change_empties_the_replica(tmp_path):
    with replica_at(tmp_path, 5) as r:
        report = catch_up(r, 7, {6: commit(6)}.get, WRITER, SHARD)
        assert report.rebuilt == "log entry 7 is gone"
        assert r.partitions() == {} and r.version == 7
    with replica_at(tmp_path, 5) as r:
        report = catch_up(r, 6, {6: commit(6, partitions=None)}.get, WRITER, SHARD)
        assert "metadata" in report.rebuilt and r.partitions() == {}


def test_replica_ahead_of_the_table_is_emptied(tmp_path):
    with replica_at(tmp_path, 9) as r:
        report = catch_up(r, 6, lambda v: None, WRITER, SHARD)
        assert report.rebuilt == "replica at 9 > table 6"
        assert r.partitions() == {} and r.version == 6


# --- a delete learned each way: the tombstone is never older than the delete -------------------

DELETE_AT = 50  # the delete record's ordering; the deleted row had ordering 1


def own_commit(version, batch, read_version=None, num_shards=None, shards=(SHARD,)):
    info = {SHARDS_PROPERTY: ",".join(map(str, shards))}
    if read_version is not None:
        info[READ_VERSION_PROPERTY] = str(read_version)
    if num_shards is not None:
        info[NUM_SHARDS_PROPERTY] = str(num_shards)
    return CommitSummary(version, {WRITER: batch}, frozenset(["p1"]), info)


def deleted_k():
    return pa.table({"pid": ["p1"], "key": [b"k"], "ordering": [DELETE_AT], "deleted": [True], "deleted_at": [0]},
                    schema=CHANGES_SCHEMA)


def test_delete_learned_from_own_staging(tmp_path):
    with replica_at(tmp_path, 5) as r:
        r.stage(3, deleted_k(), read_version=5)
        report = catch_up(r, 6, {6: own_commit(6, 3, read_version=5)}.get, WRITER, SHARD)
        assert report.promoted == 1 and report.moved_batches == 0
        assert r.lookup("p1", [b"k"]) == [Entry(DELETE_AT, True)]


def test_delete_learned_from_the_changelog_when_the_batch_ran_on_another_executor(tmp_path):
    asked = []

    def changelog(version, batch):
        asked.append((version, batch))
        return deleted_k()

    with replica_at(tmp_path, 5) as r:
        report = catch_up(r, 6, {6: own_commit(6, 3, read_version=5, num_shards=4)}.get, WRITER, SHARD,
                          read_changelog=changelog, num_shards=4)
        assert asked == [(5, 3)]  # by the version the batch was tagged against
        assert (report.moved_batches, report.changelog_applied, report.invalidated) == (1, 1, set())
        assert r.lookup("p1", [b"k"]) == [Entry(DELETE_AT, True)]
        assert set(r.partitions()) == {"p1", "p2", "p3"}


def test_own_commit_missing_from_the_changelog_invalidates(tmp_path):
    # A reload (which reads the tombstone table) is the exact way back.
    with replica_at(tmp_path, 5) as r:
        report = catch_up(r, 6, {6: own_commit(6, 3, read_version=5)}.get, WRITER, SHARD,
                          read_changelog=lambda v, b: None)
        assert report.moved_batches == 1 and report.invalidated == {"p1"}
        assert not r.has_partition("p1") and r.meta.was_invalidated("p1")


def test_own_commit_without_its_read_version_invalidates_without_asking_the_changelog(tmp_path):
    # The changelog is filed by the version a batch read: a commit that does not say it cannot be found.
    with replica_at(tmp_path, 5) as r:
        report = catch_up(r, 6, {6: own_commit(6, 3)}.get, WRITER, SHARD,
                          read_changelog=lambda v, b: pytest.fail("nothing to look it up by"))
        assert report.moved_batches == 1 and report.invalidated == {"p1"}


def test_a_commit_of_another_writer_is_reloaded_from_the_tables_whatever_its_kind(tmp_path):
    # What another writer deleted is in the tombstone table (sink.batch.other_writers): a reload
    # finds it as a rebuilt replica would, so no catch-up answers differently from a rebuild.
    for operation in ("DELETE", "RESTORE", "WRITE"):
        with replica_at(tmp_path / operation, 5) as r:
            foreign = CommitSummary(6, {"other-writer": 9}, frozenset(["p1"]), {"operation": operation})
            report = catch_up(r, 6, {6: foreign}.get, WRITER, SHARD,
                              read_changelog=lambda v, b: pytest.fail("the changelog is this writer's only"))
            assert report.invalidated == {"p1"} and not r.has_partition("p1")


def test_a_batch_staged_by_an_earlier_attempt_is_not_promoted(tmp_path):
    # Attempt 1 staged here against version 5 and lost a commit race; attempt 2, tagged against
    # version 6 elsewhere, landed: its entries come from the changelog, not from this staging.
    with replica_at(tmp_path, 5) as r:
        r.stage(3, {"p1": {b"k": Entry(9)}}, read_version=5)
        foreign = CommitSummary(6, {"other-writer": 1}, frozenset(["p2"]), {})
        log = {6: foreign, 7: own_commit(7, 3, read_version=6)}
        report = catch_up(r, 7, log.get, WRITER, SHARD, read_changelog=lambda v, b: deleted_k())
        assert report.promoted == 0 and report.changelog_applied == 1
        assert r.lookup("p1", [b"k"]) == [Entry(DELETE_AT, True)]
        assert r.staged_batch is None


def test_own_commit_under_another_shard_count_is_treated_as_foreign(tmp_path):
    with replica_at(tmp_path, 5) as r:
        report = catch_up(r, 6, {6: own_commit(6, 3, num_shards=8, shards=(0,))}.get, WRITER, SHARD,
                          read_changelog=lambda v, b: pytest.fail("another sharding's changelog"), num_shards=4)
        assert report.invalidated == {"p1"}


def test_entries_of_two_ordering_columns_arrive_through_the_changelog_and_staging(tmp_path):
    spec = replica_spec(["id"], [], ["ts", "seq"])
    uri = str(tmp_path / "changelog")
    header = changelog.Header("table", WRITER, 3, 4, spec)
    changelog.write(uri, 5, header, SHARD, pa.table({
        "pid": ["p1"], "key": [b"k"], "ordering": [5], "ordering_1": [2], "deleted": [True],
        "deleted_at": [1_700_000_000]}))
    with ShardReplica.open(tmp_path / "r", spec) as r:
        r.set_version(5)
        r.load_partition("p1", [b"j", b"k"], [Entry((4, 9)), Entry((5, 1))], reason="on_demand")
        r.stage(4, {"p1": {b"j": Entry((4, 10))}}, read_version=6)
        log = {6: own_commit(6, 3, read_version=5, num_shards=4), 7: own_commit(7, 4, read_version=6, num_shards=4)}
        report = catch_up(r, 7, log.get, WRITER, SHARD, num_shards=4,
                          read_changelog=lambda v, b: changelog.read(uri, v, dataclasses.replace(header, batch_id=b),
                                                                     SHARD))
        assert (report.changelog_applied, report.promoted, report.invalidated) == (1, 1, set())
        assert r.lookup("p1", [b"k", b"j"]) == [Entry((5, 2), True, 1_700_000_000), Entry((4, 10))]
