"""The copy-on-write commit against delta-rs' MERGE (the same batches must give the same
table) and against what `create_write_transaction` would let through unchecked."""

import dataclasses
import datetime as dt
import random
from urllib.parse import unquote

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from deltalake import CommitProperties, DeltaTable, QueryBuilder, Transaction, write_deltalake

from sink.delta_log import deletion_vectors
from sink.delta_log.contract import Contract
from sink.delta_log.live_vectors import LiveDeletionVectors
from sink.errors import CommitCheckError
from sink.lakehouse.commit import (
    actions,
    data_files,
    file_cache,
    file_changes,
    key_hits,
    key_locator,
    partition_writes,
    rewrite,
    stored_rows,
)
from sink.lakehouse.commit.key_locator import MergedKeys
from sink.lakehouse.commit.writes import PARTIAL_COLUMN, WRITE_COLUMN, Writes
from sink.lakehouse.engines import merge
from sink.lakehouse.engines.delta_rs import DeltaTarget

SCHEMA = pa.schema([("k1", pa.int64()), ("k2", pa.string()), ("day", pa.string()), ("o1", pa.int64()),
                    ("o2", pa.timestamp("us", tz="UTC")), ("v", pa.string()), ("n", pa.int32())])
DAYS = ["2024-01-01", "2024-01-02", "a b:c"]  # the last one needs escaping in a folder name


def writes_of(records, schema=SCHEMA, ties=True, partial=False, batch=1, app="w"):
    cols = {f.name: pa.array([r.get(f.name) for r in records], f.type) for f in schema}
    cols[WRITE_COLUMN] = pa.array([r["w"] for r in records], pa.string())
    if partial:
        cols[PARTIAL_COLUMN] = pa.array([r.get("partial", True) for r in records], pa.bool_())
    props = CommitProperties(app_transactions=[Transaction(app, batch)], max_commit_retries=0)
    return Writes(pa.table(cols), schema, ["k1", "k2"], ["o1", "o2"], ["day"], ties, props)


def commit_rewrite(path, writes):
    """The rewrite's commit on the table's latest version (no deletion vectors in these tables)."""
    table = DeltaTable(path)
    return rewrite.commit(table, path, writes, actions.stored_files(table, writes.partition_by))


def seeded(path, n=40, seed=0):
    rng = random.Random(seed)
    rows = [{"k1": i % 7, "k2": f"k{i}", "day": DAYS[i % 3], "o1": rng.randrange(3),
             "o2": pa.scalar(rng.randrange(3) * 1_000_000, pa.timestamp("us", tz="UTC")).as_py(),
             "v": f"v{i}", "n": i} for i in range(n)]
    table = pa.Table.from_pylist(rows, SCHEMA)
    # Two files per partition: probes must find keys in either.
    write_deltalake(path, table.slice(0, n // 2), partition_by=["day"])
    write_deltalake(path, table.slice(n // 2), partition_by=["day"], mode="append")
    return rows


def random_batch(rng, n_keys, stored):
    """25 writes; an insert only for a key `stored` (path) lacks, as the index tags them (an
    update may name a key the table lacks: both paths write it as new)."""
    present = {(r["k1"], r["k2"], r["day"]) for r in contents(stored)}
    records = {}
    for _ in range(25):
        i = rng.randrange(n_keys + 10)  # past n_keys: new keys
        day = DAYS[i % 3]
        write = rng.choice(["update", "update", "delete", "insert"])
        if write == "insert" and (i % 7, f"k{i}", day) in present:
            write = "update"
        records[(i % 7, f"k{i}", day)] = {
            "k1": i % 7, "k2": f"k{i}", "day": day, "o1": rng.randrange(4),
            "o2": pa.scalar(rng.randrange(3) * 1_000_000, pa.timestamp("us", tz="UTC")).as_py(),
            "v": rng.choice([None, f"new{rng.randrange(99)}"]), "n": rng.choice([None, rng.randrange(99)]),
            "w": write, "partial": rng.random() < 0.5}
    return list(records.values())


def contents(path):
    return sorted(DeltaTable(path).to_pyarrow_table().to_pylist(), key=lambda r: (r["day"], r["k1"], r["k2"]))


@pytest.fixture(params=[0, 1 << 30], ids=["files read", "files held"])
def written_files(request):
    """This process's file caches, off or on: files the rewrite wrote are then read from
    memory, and the key and ordering columns of files it probed (the keys sorted from the
    second probe on)."""
    before = file_cache.WRITTEN.max_bytes, file_cache.PROBED.max_bytes
    for cache in (file_cache.WRITTEN, file_cache.PROBED):
        cache.clear()
        cache.resize(request.param)
    yield file_cache.WRITTEN
    for cache, size in zip((file_cache.WRITTEN, file_cache.PROBED), before):
        cache.clear()
        cache.resize(size)


@pytest.mark.parametrize("seed", range(6))
def test_rewrite_gives_the_table_merge_gives(tmp_path, seed, written_files):
    """Random updates, deletes, inserts, stale records, partial updates, both tie rules."""
    a, b = str(tmp_path / "merge"), str(tmp_path / "rewrite")
    seeded(a), seeded(b)
    rng = random.Random(seed)
    ties, partial = seed % 2 == 0, seed % 3 != 0
    for batch in range(1, 5):
        records = random_batch(rng, 40, a)
        w = writes_of(records, ties=ties, partial=partial, batch=batch)
        merge.commit(DeltaTable(a), w, [{"day": d} for d in DAYS])
        commit_rewrite(b, w)
        assert contents(b) == contents(a)
    assert DeltaTable(b).transaction_version("w") in (None, 4)


def marked_contents(path):
    """delta-rs' own reader, which applies deletion vectors."""
    read = QueryBuilder().register("t", DeltaTable(path)).execute("SELECT * FROM t").read_all()
    return sorted(pa.table(read).to_pylist(), key=lambda r: (r["day"], r["k1"], r["k2"]))


@pytest.mark.parametrize("searched_rows", [0, key_locator.SEARCHED_ROWS], ids=["keys searched", "keys hashed"])
@pytest.mark.parametrize("seed", range(4))
def test_merge_on_read_gives_the_table_merge_gives(tmp_path, seed, searched_rows, written_files, monkeypatch):
    """Random batches marked in deletion vectors: with the caches on, the files the batches
    write are held by their keys, and the seeded files' keys from their first probe, sorted
    when searched (from a seeded file's second probe), and merged per partition once four are
    searched apart; each file is found by a search or in one hash pass over a partition's
    small files' keys as held."""
    monkeypatch.setattr(key_locator, "SEARCHED_ROWS", searched_rows)
    vectors_read = []
    read = deletion_vectors.read
    monkeypatch.setattr(deletion_vectors, "read", lambda *args: vectors_read.append(args) or read(*args))
    commits_read = []
    apply = LiveDeletionVectors._apply
    monkeypatch.setattr(LiveDeletionVectors, "_apply", lambda self, first, last: commits_read.extend(
        range(first, last + 1)) or apply(self, first, last))
    a, b = str(tmp_path / "merge"), str(tmp_path / "marked")
    seeded(a), seeded(b)
    target = DeltaTarget(b, ["day"], "merge-on-read", allow_protocol_upgrade=True)
    target.open_or_create(SCHEMA, Contract(("k1", "k2"), ("day",), ("o1", "o2"), "partitioned"))
    rng = random.Random(seed)
    ties, partial = seed % 2 == 0, seed % 3 != 0
    for batch in range(1, 6):
        w = writes_of(random_batch(rng, 40, a), ties=ties, partial=partial, batch=batch)
        merge.commit(DeltaTable(a), w, [{"day": d} for d in DAYS])
        assert target.commit(w.rows, ["k1", "k2"], ["o1", "o2"], "w", batch, {}, ties).mode == "merge-on-read"
        assert marked_contents(b) == contents(a), f"after batch {batch}"
    assert pa.table(DeltaTable(b).deletion_vectors()).num_rows > 0
    # The live vectors moved over the sink's own commits without reading them back, to what
    # the log says.
    version = DeltaTable(b).version()
    assert not set(commits_read) & set(range(version - 4, version + 1))
    assert target._vectors.at(version) == LiveDeletionVectors(b).at(version)
    # With the caches on, every file the batches wrote is held by its keys, never its rows,
    # and every file marked holds the vector this process wrote it: none is read back.
    held = [entry for entry, _ in file_cache.PROBED._tables.values()]
    files = DeltaTable(b).file_uris()
    assert len(written_files) == 0
    assert len([e for e in held if isinstance(e, file_cache.ProbedColumns)]) == (len(files) if held else 0)
    assert (len(vectors_read) == 0) == bool(written_files.max_bytes)
    # Searched files (all, at 0 rows) have their keys merged per partition, the table's alone.
    merged = [e for e in held if isinstance(e, MergedKeys)]
    assert bool(merged) == (bool(written_files.max_bytes) and searched_rows == 0)
    previous = DeltaTable(b, version=DeltaTable(b).version() - 1).file_uris()  # a file gone in the last batch
    assert {f for m in merged for f in m.files} <= set(files) | set(previous)  # leaves at its partition's probe
    # A merged file's keys are held once: not again by its own entry, even once read whole.
    entries = [file_cache.PROBED.get(f) for m in merged for f in m.files]
    assert all(e.locator is None and not {"k1", "k2"} & set(e.columns) for e in entries if e is not None)


class _Recorded:
    """A filesystem that records the files opened through it."""

    def __init__(self, fs, opened):
        self._fs, self._opened = fs, opened

    def open_input_file(self, location):
        self._opened.add(location)
        return self._fs.open_input_file(location)


@pytest.mark.parametrize("searched_rows", [0, key_locator.SEARCHED_ROWS], ids=["keys searched", "keys hashed"])
def test_files_this_process_wrote_are_read_back_from_memory(tmp_path, written_files, searched_rows, monkeypatch):
    """Batch 1 rewrites a file of each partition; batches 2 and 3 update the same keys: with the
    caches on they read no Parquet (the rewritten files from memory, the others' keys held
    from batch 1's probe, sorted in batch 2's when searched, else hashed as held), and all
    end in the table MERGE gives."""
    monkeypatch.setattr(key_locator, "SEARCHED_ROWS", searched_rows)
    path, by_merge = str(tmp_path / "t"), str(tmp_path / "merge")
    rows, _ = seeded(path), seeded(by_merge)
    read_from = set()
    opening = stored_rows.HeldParquet.__init__

    def located(self, fs, location):
        opening(self, fs, location)
        self._fs = _Recorded(fs, read_from)

    for batch in (1, 2, 3):
        updates = [{**rows[i], "o1": 10 + batch, "v": f"b{batch}", "w": "update"} for i in (0, 1, 2)]
        read_from.clear()
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(stored_rows.HeldParquet, "__init__", located)
            done = commit_rewrite(path, writes_of(updates, batch=batch))
        merge.commit(DeltaTable(by_merge), writes_of(updates, batch=batch), [{"day": d} for d in DAYS])
        assert len(done.removes) == 3
        # Each partition has two files; batch 1 reads both (delta-rs wrote them), unless the caches
        # are off, later batches read none.
        assert len(read_from) == (6 if batch == 1 or not written_files.max_bytes else 0)
        held = file_cache.PROBED.get(next(iter(file_cache.PROBED._tables), "")) if written_files.max_bytes else None
        sorted_now = searched_rows == 0 and batch > 1 and bool(written_files.max_bytes)  # the test's files are small
        assert (held is not None and held.locator is not None) == sorted_now
    assert contents(path) == contents(by_merge)
    assert len(written_files) == (3 if written_files.max_bytes else 0)  # the files replaced went


def test_only_files_with_a_changed_row_are_replaced(tmp_path):
    path = str(tmp_path / "t")
    seeded(path)
    before = {unquote(p) for p in pa.table(DeltaTable(path).get_add_actions()).column("path").to_pylist()}
    row = {"k1": 3, "k2": "k3", "day": DAYS[0], "o1": 9, "o2": None, "v": "x", "n": 1, "w": "update"}
    assert len(commit_rewrite(path, writes_of([row])).removes) == 1
    after = {unquote(p) for p in pa.table(DeltaTable(path).get_add_actions()).column("path").to_pylist()}
    assert len(before - after) == 1 and len(after - before) == 1  # of 6 files, one replaced
    assert [r["v"] for r in contents(path) if r["k2"] == "k3"] == ["x"]


def test_new_keys_join_a_rewritten_file_only_while_it_is_smaller_than_they_are():
    def table(n):
        return pa.table({"k": list(range(n))})

    assert [t.num_rows for t in partition_writes.with_inserts([], table(5))] == [5]
    assert [t.num_rows for t in partition_writes.with_inserts([table(9), table(3)], table(5))] == [9, 8]  # the smallest
    assert [t.num_rows for t in partition_writes.with_inserts([table(9), table(5)], table(5))] == [9, 5, 5]


def test_a_partition_taking_inserts_and_updates_every_batch_keeps_its_files_bounded(tmp_path):
    """Each batch updates one key of the first file and inserts 30 new keys: the file the
    updates rewrite stays the size of one batch's inserts plus its own rows, instead of
    taking every batch's inserts (and being rewritten whole each time)."""
    path = str(tmp_path / "t")
    seeded(path, n=6)  # two rows in DAYS[0]: k0 and k3, one per file
    for batch in range(1, 6):
        update = {"k1": 0, "k2": "k0", "day": DAYS[0], "o1": 10 + batch, "o2": None, "v": f"b{batch}", "n": batch,
                  "w": "update"}
        inserts = [{"k1": i % 7, "k2": f"b{batch}-{i}", "day": DAYS[0], "o1": 1, "o2": None, "v": "new", "n": i,
                    "w": "insert"} for i in range(30)]
        commit_rewrite(path, writes_of([update, *inserts], batch=batch))
    files = [f for f in DeltaTable(path).file_uris() if "day=2024-01-01" in f]
    assert sorted(pq.ParquetFile(f).metadata.num_rows for f in files) == [1, 30, 30, 30, 30, 31]
    assert sum(1 for r in contents(path) if r["day"] == DAYS[0]) == 2 + 5 * 30


def test_a_partition_value_that_needs_escaping_is_removed_not_doubled(tmp_path):
    """delta-rs encodes a remove's path again: the log's spelling would remove nothing."""
    path = str(tmp_path / "t")
    rows = seeded(path)
    stored = next(r for r in rows if r["day"] == "a b:c")
    update = {**stored, "o1": 9, "v": "moved on", "w": "update"}
    commit_rewrite(path, writes_of([update]))
    mine = [r for r in contents(path) if r["k2"] == stored["k2"]]
    assert [r["v"] for r in mine] == ["moved on"]
    assert len(contents(path)) == len(rows)


def test_a_stale_or_tied_record_changes_no_file(tmp_path):
    path = str(tmp_path / "t")
    rows = seeded(path)
    stored = rows[4]
    version = DeltaTable(path).version()
    older = {**stored, "o1": stored["o1"] - 1, "v": "older", "w": "update"}
    tied = {**rows[5], "v": "tie", "w": "delete"}
    assert commit_rewrite(path, writes_of([older, tied], ties=False)).empty
    assert DeltaTable(path).version() == version


@pytest.mark.parametrize("partial", [False, True])
def test_an_identical_redelivery_rewrites_no_file_and_matches_no_merge_update(tmp_path, partial):
    """At-least-once delivery sends an event again with its ordering: the stored row already
    holds it. A partial update whose values are null or equal to the stored ones is the same."""
    by_rewrite, by_merge = str(tmp_path / "rewrite"), str(tmp_path / "merge")
    rows = seeded(by_rewrite)
    seeded(by_merge)
    again = [{**rows[i], "w": "update"} for i in (0, 3, 4)]
    if partial:
        again[1] = {**again[1], "v": None}  # null keeps the stored value: still the same row
    versions = DeltaTable(by_rewrite).version(), DeltaTable(by_merge).version()
    done = commit_rewrite(by_rewrite, writes_of(again, partial=partial))
    assert (done.empty, done.unchanged) == (True, 3)
    assert merge.commit(DeltaTable(by_merge), writes_of(again, partial=partial), [{"day": d} for d in DAYS]) == 3
    assert (DeltaTable(by_rewrite).version(), DeltaTable(by_merge).version()) == versions  # nothing committed
    # Beside a real change in the same file, only that change is written.
    changed = {**rows[3], "v": "changed", "w": "update"}
    done = commit_rewrite(by_rewrite, writes_of([again[0], changed], partial=partial))
    assert (len(done.removes), done.unchanged) == (1, 1)
    assert merge.commit(DeltaTable(by_merge), writes_of([again[0], changed], partial=partial),
                        [{"day": d} for d in DAYS]) == 1
    assert contents(by_rewrite) == contents(by_merge)
    assert next(r for r in contents(by_rewrite) if r["k2"] == rows[3]["k2"])["v"] == "changed"


class RecordingParquet:
    """A Parquet file that records which columns are read from it."""

    def __init__(self, path):
        self._file = pq.ParquetFile(path)
        self.schema_arrow, self.metadata = self._file.schema_arrow, self._file.metadata
        self.reads = []

    def read(self, columns, use_threads):
        self.reads.append(list(columns))
        return self._file.read(columns=columns, use_threads=use_threads)


@pytest.mark.parametrize("tie", [False, True])
def test_merge_on_read_reads_a_files_values_only_to_compare_a_tie(tmp_path, tie):
    """The replaced row stays where it is, so a newer update reads the file's keys and orderings
    and none of its values; an update tying on ordering (incoming wins ties) is compared whole,
    as it may be a re-delivery that changes nothing."""
    at_noon = dt.datetime(2024, 1, 1, 12, tzinfo=dt.UTC)
    rows = [{"k1": i, "k2": f"k{i}", "day": DAYS[0], "o1": 1, "o2": at_noon, "v": f"v{i}", "n": i} for i in range(5)]
    pq.write_table(pa.Table.from_pylist(rows, SCHEMA).drop_columns(["day"]), tmp_path / "f.parquet")
    source = RecordingParquet(tmp_path / "f.parquet")
    stored = stored_rows.StoredRows(source, SCHEMA, {"day": DAYS[0]}, None)
    update = {**rows[2], "o1": 1 if tie else 2, "v": "new", "w": "update"}
    writes = dataclasses.replace(writes_of([update]), merge_on_read=True)
    at = pc.index_in(stored_rows.row_keys(stored.read(["k1", "k2"]), ["k1", "k2"]),
                     value_set=stored_rows.row_keys(writes.rows, ["k1", "k2"]))
    change, = file_changes.file_changes([(stored, key_hits.Hits.of_each(at, [len(at)])[0])], writes.rows, writes)
    assert change.gone.tolist() == [2]
    assert change.replaced.to_pylist() == [{k: v for k, v in update.items() if k != "w"}]
    assert source.reads == [["k1", "k2"], ["o1", "o2"]] + ([["v", "n"]] if tie else [])
    assert stored.read(["day"]).column("day").to_pylist() == [DAYS[0]] * 5  # from the log, not the file


def test_files_without_a_new_column_read_it_as_null(tmp_path):
    path = str(tmp_path / "t")
    seeded(path)
    wider = pa.schema([*SCHEMA, ("extra", pa.string())])
    DeltaTable(path).alter.add_columns([__import__("deltalake").Field("extra", "string")])
    row = {"k1": 0, "k2": "k7", "day": DAYS[1], "o1": 9, "o2": None, "v": "x", "n": 1, "extra": "e", "w": "update"}
    commit_rewrite(path, writes_of([row], schema=wider))
    table = contents(path)
    assert [r["extra"] for r in table if r["k2"] == "k7"] == ["e"]
    assert {r["extra"] for r in table if r["k2"] != "k7"} == {None}


def test_partial_updates_keep_stored_values_where_theirs_are_null(tmp_path):
    path = str(tmp_path / "t")
    rows = seeded(path)
    stored = rows[0]
    row = {**stored, "o1": 9, "v": None, "n": 77, "w": "update", "partial": True}
    commit_rewrite(path, writes_of([row], partial=True))
    got = next(r for r in contents(path) if r["k2"] == stored["k2"])
    assert (got["v"], got["n"], got["o1"]) == (stored["v"], 77, 9)


def new_file_stats(path, key="new"):
    """The add action of the file holding only `key`."""
    actions = pa.table(DeltaTable(path).get_add_actions(flatten=True))
    return actions.filter(pc.and_(pc.equal(actions.column("min.k2"), key), pc.equal(actions.column("max.k2"), key)))


@pytest.mark.parametrize("micros", [5_000_000, 5_000_001])
def test_written_files_carry_the_stats_delta_rs_writes(tmp_path, micros):
    """The same rows written by delta-rs and by the rewrite: the same add.stats; except that
    timestamps are kept to the microsecond, where delta-rs 1.6.6 cuts them to the millisecond
    (a max below the true max: a reader would skip the file for the rows past it)."""
    path, ref = str(tmp_path / "t"), str(tmp_path / "ref")
    seeded(path)
    latest = pa.scalar(micros, pa.timestamp("us", tz="UTC")).as_py()
    row = {"k1": 1, "k2": "new", "day": DAYS[0], "o1": 1, "o2": latest, "v": None, "n": 3, "w": "insert"}
    seeded_update = {"k1": 0, "k2": "k0", "day": DAYS[0], "o1": 9, "o2": None, "v": "z", "n": 4, "w": "update"}
    commit_rewrite(path, writes_of([row, seeded_update]))
    new_file = new_file_stats(path)
    data = pq.read_table(f"{path}/{unquote(new_file.column('path')[0].as_py())}")
    write_deltalake(ref, data.append_column("day", pa.array([DAYS[0]] * data.num_rows)), partition_by=["day"])
    expected = new_file_stats(ref)
    stat_cols = [c for c in expected.column_names if c.split(".")[0] in ("num_records", "null_count", "min", "max")]
    exact = [c for c in stat_cols if c not in ("min.o2", "max.o2")]
    assert new_file.select(exact).to_pylist() == expected.select(exact).to_pylist()
    cut = latest.replace(microsecond=latest.microsecond // 1000 * 1000)
    for stat in ("min.o2", "max.o2"):  # the new key's file holds that one row
        assert (new_file.column(stat)[0].as_py(), expected.column(stat)[0].as_py()) == (latest, cut)


def test_a_file_gone_before_the_commit_fails_the_check_and_commits_nothing(tmp_path, monkeypatch):
    path = str(tmp_path / "t")
    seeded(path)
    version = DeltaTable(path).version()
    write_file = data_files.write_file

    def lost(*args, **options):
        written = write_file(*args, **options)
        fs, root = args[:2]
        fs.delete_file(f"{root}/{written.action.path}")
        return written

    monkeypatch.setattr(data_files, "write_file", lost)
    row = {"k1": 0, "k2": "k0", "day": DAYS[0], "o1": 9, "o2": None, "v": "z", "n": 4, "w": "update"}
    with pytest.raises(CommitCheckError, match="missing"):
        commit_rewrite(path, writes_of([row]))
    assert DeltaTable(path).version() == version


def test_a_remove_outside_the_read_version_fails_the_check(tmp_path):
    path = str(tmp_path / "t")
    seeded(path)
    dt = DeltaTable(path)
    snapshot = actions.stored_files(dt, ["day"])
    foreign = actions.StoredFile("day=2024-01-01/part-gone.parquet", 10, {"day": "2024-01-01"})
    with pytest.raises(CommitCheckError, match="not a file of the version the batch read"):
        actions.check_actions(path, actions.Rewrite([], [foreign]), snapshot, SCHEMA, ["day"])
    incomplete = actions.StoredFile(snapshot["day=2024-01-01"][0].path, 10, {})
    with pytest.raises(CommitCheckError, match="not a file of the version the batch read"):
        actions.check_actions(path, actions.Rewrite([], [incomplete]), snapshot, SCHEMA, ["day"])


def test_stored_rows_read_at_given_rows_in_the_tables_types_whatever_the_files():
    """delta-rs writes strings as string_view, which Arrow cannot `take` from: such a column
    is cast before its rows are taken."""
    held = pa.table({"k1": pa.array([1, 2, 3], pa.int64()), "k2": pa.array(["a", "b", "c"], pa.string_view()),
                     "o1": pa.array([7, 8, 9], pa.int32())})
    stored = stored_rows.StoredRows(held, SCHEMA, {"day": DAYS[0]}, None)
    rows = stored.read(["k2", "o1", "day", "v"], np.array([2, 0]))
    assert rows.schema == pa.schema([SCHEMA.field(c) for c in ("k2", "o1", "day", "v")])
    assert rows.to_pylist() == [{"k2": "c", "o1": 9, "day": DAYS[0], "v": None},
                                {"k2": "a", "o1": 7, "day": DAYS[0], "v": None}]


@pytest.mark.parametrize("nulls", [False, True])
def test_hit_rows_read_together_are_what_each_file_reads(nulls):
    """Fixed-width columns gathered by numpy; with a null (or a partition column, or a string)
    each file's rows are read as `StoredRows.read` reads them."""
    schema = pa.schema([("o1", pa.int64()), ("o2", pa.timestamp("us", tz="UTC")), ("v", pa.string()),
                        ("day", pa.string())])
    files = []
    for i in range(3):
        o2 = [None if nulls and i == 1 and r == 2 else r * 1_000_000 for r in range(5)]
        rows = pa.table({"o1": [10 * i + r for r in range(5)], "o2": pa.array(o2, schema[1].type),
                         "v": [f"v{r}" for r in range(5)]})
        files.append(stored_rows.StoredRows(rows, schema, {"day": DAYS[i]}, None))
    found = [(s, key_hits.Hits(np.array(rows, np.int64), np.zeros(len(rows), np.int64)))
             for s, rows in zip(files, ([0, 3], [], [1, 2, 4]))]
    for columns in (["o1", "o2"], ["o2", "day", "v"]):
        expected = pa.concat_tables([s.read(columns, h.rows) for s, h in found])
        assert file_changes._read_at_hits(found, columns, schema).equals(expected)
