"""A partition's writes divided among shares (sink.lakehouse.commit.shares): each stored file
marked or rewritten by one share, each new row written by one, and the table the shares commit
together the one the MERGE gives; on the driver, an unpartitioned table's batch is written in
shares, one per thread."""

import random

import pyarrow as pa
import pytest
from deltalake import CommitProperties, DeltaTable, QueryBuilder, Transaction, write_deltalake

from sink.delta_log.contract import Contract
from sink.lakehouse.commit import file_cache, rewrite
from sink.lakehouse.commit.actions import Rewrite, StoredFile, summed_changes
from sink.lakehouse.commit.shares import Share, every_share
from sink.lakehouse.commit.writes import PARTIAL_COLUMN, WRITE_COLUMN, Writes
from sink.lakehouse.engines import merge
from sink.lakehouse.engines.delta_rs import DeltaTarget

SCHEMA = pa.schema([("k1", pa.int64()), ("k2", pa.string()), ("o1", pa.int64()), ("v", pa.string()),
                    ("n", pa.int32())])
KEYS = 60


def test_every_file_is_owned_by_one_share_and_the_rows_divide_evenly():
    files = [StoredFile(f"f{i}", 100, {}, num_records=rows) for i, rows in enumerate([90, 10, 50, 50, 40, 60, 5])]
    owned = [Share(i, 3).owned(list(reversed(files)) if i % 2 else files) for i in range(3)]  # any order
    assert sorted(p for o in owned for p in o) == sorted(f.path for f in files)
    rows = {f.path: f.num_records for f in files}
    assert sorted(sum(rows[p] for p in o) for o in owned) == [100, 100, 105]


def test_every_row_is_the_home_of_one_share():
    rows = pa.table({"k1": list(range(200)), "k2": [f"k{i}" for i in range(200)]})
    homes = [s.homes(rows, ["k1", "k2"]) for s in every_share(3)]
    assert (sum(h.astype(int) for h in homes) == 1).all()
    assert all(40 < h.sum() < 95 for h in homes)
    with pytest.raises(ValueError, match="share 2 of 2"):
        Share(2, 2)


def seeded(path):
    rows = [{"k1": i % 5, "k2": f"k{i}", "o1": i % 3, "v": f"v{i}", "n": i} for i in range(KEYS)]
    for part in range(3):  # three files, keys spread over them
        write_deltalake(path, pa.Table.from_pylist(rows[part::3], SCHEMA), mode="append")


def contents(path):
    read = QueryBuilder().register("t", DeltaTable(path)).execute("SELECT * FROM t").read_all()
    return sorted(pa.table(read).to_pylist(), key=lambda r: (r["k1"], r["k2"]))


def batch_of(rng, stored_path, batch, partial):
    """Updates (stale, tied and partial among them), deletes, inserts, as the index tags them."""
    present = {(r["k1"], r["k2"]) for r in contents(stored_path)}
    records = {}
    for _ in range(30):
        i = rng.randrange(KEYS + 15)
        key = (i % 5, f"k{i}")
        write = rng.choice(["update", "update", "update", "delete"]) if key in present else "insert"
        records[key] = {"k1": key[0], "k2": key[1], "o1": rng.randrange(5), "w": write,
                        "v": rng.choice([None, f"b{batch}-{i}"]), "n": rng.choice([None, rng.randrange(99)]),
                        "partial": rng.random() < 0.5}
    records = list(records.values())
    cols = {f.name: pa.array([r.get(f.name) for r in records], f.type) for f in SCHEMA}
    cols[WRITE_COLUMN] = pa.array([r["w"] for r in records], pa.string())
    if partial:
        cols[PARTIAL_COLUMN] = pa.array([r["partial"] for r in records], pa.bool_())
    props = CommitProperties(app_transactions=[Transaction("w", batch)], max_commit_retries=0)
    return Writes(pa.table(cols), SCHEMA, ["k1", "k2"], ["o1"], [], True, props)


@pytest.fixture(autouse=True)
def no_caches():
    for cache in (file_cache.WRITTEN, file_cache.PROBED):
        cache.clear()
    yield
    for cache in (file_cache.WRITTEN, file_cache.PROBED):
        cache.clear()


def _together(done: list[Rewrite]) -> Rewrite:
    return Rewrite([a for r in done for a in r.adds], [f for r in done for f in r.removes],
                   sum(r.unchanged for r in done), [m for r in done for m in r.marked], [],
                   [], summed_changes(r.row_changes for r in done))


@pytest.mark.parametrize("merge_on_read, rewrite_marked_share", [(False, 0.5), (True, 0.5), (True, 0.0)],
                         ids=["copy-on-write", "merge-on-read", "merge-on-read-rewriting-every-file"])
@pytest.mark.parametrize("seed", range(3))
def test_shares_written_apart_commit_the_table_the_merge_gives(tmp_path, seed, merge_on_read, rewrite_marked_share):
    """What Spark's writing tasks do for an unpartitioned table: each has every write and
    writes its share; the driver commits their files together."""
    oracle, shared = str(tmp_path / "merge"), str(tmp_path / "shared")
    seeded(oracle), seeded(shared)
    target = DeltaTarget(shared, [], "merge-on-read" if merge_on_read else "rewrite", allow_protocol_upgrade=True)
    target.open_or_create(SCHEMA, Contract(("k1", "k2"), (), ("o1",), "partitioned"))
    rng = random.Random(seed)
    for batch in range(1, 5):
        w = batch_of(rng, oracle, batch, partial=seed == 1)
        w = Writes(w.rows, w.schema, w.key_cols, w.ordering, w.partition_by, w.incoming_wins_ties, w.props,
                   merge_on_read=merge_on_read, rewrite_marked_share=rewrite_marked_share)
        merge.commit(DeltaTable(oracle), w, [])
        target.refresh()
        table, snapshot = target.table, target.stored_files()  # with the vectors its files carry
        whole = rewrite.rewrite_files(shared, snapshot, w, divide=False)
        done = [rewrite.rewrite_files(shared, snapshot, w, share=s, divide=False) for s in every_share(2)]
        together = _together(done)
        # Each file changed by one share, as by the undivided write; the counts add up to its.
        changed = [f.path for f in together.removes]
        assert sorted(changed) == sorted(f.path for f in whole.removes) and len(set(changed)) == len(changed)
        assert together.files_changed == whole.files_changed
        if rewrite_marked_share == 0.0:
            assert not together.marked
        assert together.row_changes == whole.row_changes and together.unchanged == whole.unchanged
        rewrite.commit_rewrite(table, shared, together, snapshot, SCHEMA, [], w.props)
        assert contents(shared) == contents(oracle), f"after batch {batch}"


@pytest.mark.parametrize("mode", ["rewrite", "merge-on-read"])
def test_the_driver_writes_an_unpartitioned_batch_in_a_share_per_thread(tmp_path, mode, monkeypatch):
    monkeypatch.setattr(rewrite, "DRIVER_MIN_ROWS", 1)
    monkeypatch.setattr(rewrite.os, "cpu_count", lambda: 2)
    oracle, path = str(tmp_path / "merge"), str(tmp_path / "sink")
    seeded(oracle), seeded(path)
    target = DeltaTarget(path, [], mode, allow_protocol_upgrade=True)
    target.open_or_create(SCHEMA, Contract(("k1", "k2"), (), ("o1",), "partitioned"))
    rng = random.Random(7)
    for batch in range(1, 4):
        w = batch_of(rng, oracle, batch, partial=False)
        merge.commit(DeltaTable(oracle), w, [])
        before = set(DeltaTable(path).file_uris())
        assert target.commit(w.rows, ["k1", "k2"], ["o1"], "w", batch, {}, True).mode == mode
        assert contents(path) == contents(oracle), f"after batch {batch}"
        # Two shares: each wrote its new rows in a file of its own.
        new = set(DeltaTable(path).file_uris()) - before
        assert len(new) == 2 if mode == "merge-on-read" else len(new) >= 2
