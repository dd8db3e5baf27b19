from sink.index.catchup import catch_up
from sink.index.entry import Entry
from sink.index.replica import ShardReplica
from sink.lakehouse.log import SHARDS_PROPERTY, CommitSummary

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
