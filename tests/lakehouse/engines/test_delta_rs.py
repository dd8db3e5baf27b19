import json

import pyarrow as pa
import pytest
from deltalake import DeltaTable, QueryBuilder, write_deltalake
from deltalake.schema import Field as DeltaField

from sink.delta_log.contract import Contract
from sink.delta_log.reading import read_commit
from sink.errors import ConfigError
from sink.lakehouse.engines.delta_rs import WRITE_COLUMN, CommitFailedError, DeltaTarget, append_once

SCHEMA = pa.schema([("id", pa.string()), ("dt", pa.string()), ("ts", pa.int64()), ("v", pa.string())])
CONTRACT = Contract(("id",), ("dt",), "ts", "partitioned")


def rows(*records):
    cols = list(zip(*records)) if records else [[]] * 5
    return pa.table({"id": pa.array(cols[0], pa.string()), "dt": pa.array(cols[1], pa.string()),
                     "ts": pa.array(cols[2], pa.int64()), "v": pa.array(cols[3], pa.string()),
                     WRITE_COLUMN: pa.array(cols[4], pa.string())})


def contents(uri):
    """delta-rs' own reader: it applies deletion vectors (pyarrow's dataset would not)."""
    read = QueryBuilder().register("t", DeltaTable(uri)).execute("SELECT * FROM t").read_all()
    return sorted(pa.table(read).to_pylist(), key=lambda r: (r["dt"], r["id"]))


# commit_mode -> how a batch with updates commits (on a table with no feature that needs MERGE;
# merge-on-read: the sink creates it with deletion vectors).
UPDATE_MODE = {"auto": "rewrite", "merge-on-read": "merge-on-read", "merge": "merge"}


@pytest.fixture(params=list(UPDATE_MODE))
def target(tmp_path, request):
    t = DeltaTarget(str(tmp_path / "t"), ["dt"], request.param)
    t.open_or_create(SCHEMA, CONTRACT)
    return t


def commit(target, data, batch):
    return target.commit(data, ["id"], "ts", "w", batch, {"k": "v"}, incoming_wins_ties=True)


def test_inserts_only_append_with_the_app_transaction(target):
    out = commit(target, rows(("a", "d1", 1, "x", "insert"), ("b", "d2", 1, "x", "insert")), 0)
    assert out.mode == "append" and out.version == 1
    assert target.transaction_version("w") == 0
    assert DeltaTable(target.uri).history(1)[0]["operation"] == "WRITE"


def test_updates_and_deletes_touch_only_their_partitions(target):
    commit(target, rows(*[(k, d, 1, "x", "insert") for k in "abc" for d in ("d1", "d2", "d3")]), 0)
    out = commit(target, rows(("a", "d1", 2, "new", "update"), ("b", "d3", 2, "", "delete"),
                              ("z", "d2", 2, "ins", "insert")), 1)
    assert out.mode == UPDATE_MODE[target.commit_mode] and out.merge_partitions == 2
    if out.mode == "merge":
        params = DeltaTable(target.uri).history(1)[0]["operationParameters"]
        assert "(t.dt = 'd1' OR t.dt = 'd3')" in params["mergePredicate"]  # delta-rs spells IN as ORs
    assert read_commit(target.uri, out.version, ["dt"]).partitions == frozenset({"dt=d1", "dt=d2", "dt=d3"})
    table = {(r["id"], r["dt"]): (r["ts"], r["v"]) for r in contents(target.uri)}
    assert table[("a", "d1")] == (2, "new")
    assert ("b", "d3") not in table
    assert table[("z", "d2")] == (2, "ins")
    assert len(table) == 9
    assert target.transaction_version("w") == 1


def test_tombstones_only_still_record_the_batch(target):
    out = commit(target, rows(("ghost", "d1", 5, "", "tombstone")), 4)
    assert out.mode == "append"
    assert target.transaction_version("w") == 4
    assert contents(target.uri) == []


def test_merge_guard_never_lets_an_older_row_overwrite(target):
    commit(target, rows(("a", "d1", 9, "newest", "insert")), 0)
    commit(target, rows(("a", "d1", 3, "older", "update")), 1)  # a replica that got it wrong
    assert contents(target.uri)[0]["v"] == "newest"
    assert target.transaction_version("w") == 1  # the batch is recorded all the same


def test_a_concurrent_writer_makes_the_merge_fail_with_commit_failed(target):
    commit(target, rows(("a", "d1", 1, "x", "insert")), 0)
    stale_view = DeltaTarget(target.uri, ["dt"])
    stale_view.open_or_create(SCHEMA, CONTRACT)
    commit(target, rows(("a", "d1", 2, "y", "update")), 1)
    with pytest.raises(CommitFailedError):
        stale_view.commit(rows(("a", "d1", 3, "z", "update")), ["id"], "ts", "other", 0, {}, True)


def test_a_concurrent_writer_makes_an_append_fail_too_never_rebased_past_it(target):
    commit(target, rows(("a", "d1", 1, "x", "insert")), 0)
    stale_view = DeltaTarget(target.uri, ["dt"])
    stale_view.open_or_create(SCHEMA, CONTRACT)
    commit(target, rows(("b", "d1", 2, "y", "insert")), 1)
    with pytest.raises(CommitFailedError):
        stale_view.commit(rows(("b", "d1", 3, "z", "insert")), ["id"], "ts", "other", 0, {}, True)
    assert [r["id"] for r in contents(target.uri)] == ["a", "b"]


def test_a_new_table_records_the_contract(target):
    assert target.contract() == CONTRACT
    assert DeltaTable(target.uri).metadata().configuration["upsert_sink.key"] == '["id"]'


def test_append_once_is_idempotent_per_batch(tmp_path):
    uri = str(tmp_path / "q")
    data = pa.table({"id": ["a"], "reason": ["null key"]})
    assert append_once(uri, data, [], "w", 3) is True
    assert append_once(uri, data, [], "w", 3) is False
    assert append_once(uri, data, [], "w", 2) is False
    assert append_once(uri, data.slice(0, 0), [], "w", 4) is False
    assert DeltaTable(uri).to_pyarrow_table().num_rows == 1


def test_read_commit_reports_txn_partitions_and_custom_metadata(target):
    commit(target, rows(*[(k, d, 1, "x", "insert") for k in "ab" for d in ("d1", "d2", "d3")]), 0)
    commit(target, rows(("a", "d2", 2, "y", "update")), 1)
    merge = read_commit(target.uri, 2, ["dt"])
    assert merge.app_versions == {"w": 1}
    assert merge.partitions == frozenset({"dt=d2"})
    assert merge.commit_info["k"] == "v"
    assert read_commit(target.uri, 99, ["dt"]) is None


def test_compaction_changes_no_partition(target):
    for batch, d in enumerate(["d1", "d1", "d2"]):
        commit(target, rows((f"k{batch}", d, 1, "x", "insert")), batch)
    DeltaTable(target.uri).optimize.compact()
    version = DeltaTable(target.uri).version()
    summary = read_commit(target.uri, version, ["dt"])
    assert summary.commit_info["operation"] == "OPTIMIZE"
    assert summary.partitions == frozenset()


def test_new_properties_or_columns_change_no_partition_another_partitioning_may_change_all(target):
    target.record_contract(Contract(("id", "v"), ("dt",), "ts", "partitioned"))
    assert read_commit(target.uri, target.version(), ["dt"]).partitions == frozenset()
    DeltaTable(target.uri).alter.add_columns(DeltaField("extra", "string"))
    assert read_commit(target.uri, DeltaTable(target.uri).version(), ["dt"]).partitions == frozenset()
    write_deltalake(target.uri, pa.table({"id": ["q"], "dt": ["d7"], "ts": [1], "v": ["f"]}).cast(SCHEMA),
                    mode="overwrite", partition_by=["v"], schema_mode="overwrite")
    assert read_commit(target.uri, DeltaTable(target.uri).version(), ["dt"]).partitions is None


def test_a_foreign_write_is_seen_with_its_partitions(target):
    write_deltalake(target.uri, pa.table({"id": ["q"], "dt": ["d7"], "ts": [1], "v": ["f"]}).cast(SCHEMA),
                    mode="append")
    summary = read_commit(target.uri, DeltaTable(target.uri).version(), ["dt"])
    assert summary.app_versions == {} and summary.partitions == frozenset({"dt=d7"})
    assert json.dumps(summary.commit_info)  # plain JSON, as read from the log


def test_batch_zero_merge_is_one_commit(target):
    write_deltalake(target.uri, pa.table({"id": ["a"], "dt": ["d1"], "ts": [1], "v": ["x"]}).cast(SCHEMA),
                    mode="append")
    target.refresh()
    before = target.version()
    out = commit(target, rows(("a", "d1", 2, "y", "update")), 0)
    assert out.mode == UPDATE_MODE[target.commit_mode] and out.version == before + 1


def test_merge_on_read_turns_deletion_vectors_on_in_an_existing_table_only_when_allowed(tmp_path, caplog):
    uri = str(tmp_path / "t")
    stored = rows(("a", "d1", 1, "x", "insert"), ("b", "d1", 1, "x", "insert"),
                  ("c", "d1", 1, "x", "insert")).drop_columns([WRITE_COLUMN])
    write_deltalake(uri, stored, partition_by=["dt"])
    with pytest.raises(ConfigError, match=r"commit_mode = 'merge-on-read' needs deletion vectors, which table .* "
                                          r"does not write: turn them on \(ALTER TABLE .* SET TBLPROPERTIES "
                                          r"\('delta.enableDeletionVectors' = 'true'\).* or set "
                                          r"allow_protocol_upgrade = true"):
        DeltaTarget(uri, ["dt"], "merge-on-read").open_or_create(SCHEMA, CONTRACT)
    assert DeltaTable(uri).protocol().min_reader_version == 1 and DeltaTable(uri).version() == 0
    target = DeltaTarget(uri, ["dt"], "merge-on-read", allow_protocol_upgrade=True)
    target.open_or_create(SCHEMA, CONTRACT)
    assert "turning deletion vectors on" in caplog.text
    assert "deletionVectors" in DeltaTable(uri).protocol().reader_features
    assert commit(target, rows(("a", "d1", 2, "y", "update")), 0).mode == "merge-on-read"
    assert [(r["id"], r["v"]) for r in contents(uri)] == [("a", "y"), ("b", "x"), ("c", "x")]
    assert pa.table(DeltaTable(uri).deletion_vectors()).column("selection_vector").to_pylist() == [
        [False, True, True]]


def live_vectors(uri):
    """Per live file with a deletion vector: its rows' selection (False: deleted)."""
    return pa.table(DeltaTable(uri).deletion_vectors()).column("selection_vector").to_pylist()


@pytest.mark.parametrize("share, first, second", [
    (0.5, (1, 0), (0, 1)),  # 3 of 10 marked, then 3 + 2 = half: rewritten
    (1.0, (1, 0), (1, 0)),  # marked while a row stays
    (0.0, (0, 1), (0, 1)),  # every changed file rewritten, as copy-on-write
])
def test_merge_on_read_rewrites_a_file_once_its_marked_share_reaches_the_option(tmp_path, share, first, second):
    target = DeltaTarget(str(tmp_path / "t"), ["dt"], "merge-on-read", rewrite_marked_share=share)
    target.open_or_create(SCHEMA, CONTRACT)
    keys = [f"k{i}" for i in range(10)]
    expected = {k: "x" for k in keys}

    def table_rows():  # a row copied twice, or an old version copied along, shows as a pair
        return sorted((r["id"], r["v"]) for r in contents(target.uri))

    commit(target, rows(*[(k, "d1", 1, "x", "insert") for k in keys]), 0)
    out = commit(target, rows(("k0", "d1", 2, "y", "update"), ("k1", "d1", 2, "y", "update"),
                              ("k2", "d1", 2, "", "delete")), 1)
    expected.update(k0="y", k1="y")
    del expected["k2"]
    assert (out.mode, (out.files_marked, out.files_rewritten)) == ("merge-on-read", first)
    assert table_rows() == sorted(expected.items())
    out = commit(target, rows(("k3", "d1", 3, "z", "update"), ("k4", "d1", 3, "", "delete")), 2)
    expected["k3"] = "z"
    del expected["k4"]
    assert (out.files_marked, out.files_rewritten) == second
    assert table_rows() == sorted(expected.items())
    # The first file's rows k0..k4 are gone: marked in its vector, or copied out of it.
    assert live_vectors(target.uri) == ([[False] * 5 + [True] * 5] if second == (1, 0) else [])
    # A file whose every row goes is removed at any share: no vector deletes all of a file.
    files = len(DeltaTable(target.uri).file_uris())
    out = commit(target, rows(*[(k, "d1", 4, "", "delete") for k in expected]), 3)
    assert (out.files_marked, out.files_rewritten) == (0, files)
    assert not contents(target.uri) and not DeltaTable(target.uri).file_uris()


def test_the_sink_creates_its_table_only_in_a_new_or_empty_folder(tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "part-0.csv").write_text("a,b\n")
    (tmp_path / "a-file").write_text("x")
    with pytest.raises(ConfigError, match="is a folder that holds files but no Delta table"):
        DeltaTarget(str(tmp_path / "data"), ["dt"]).open_or_create(SCHEMA, CONTRACT)
    assert not (tmp_path / "data" / "_delta_log").exists()
    with pytest.raises(ConfigError, match="is a file, not a folder"):
        DeltaTarget(str(tmp_path / "a-file"), ["dt"]).open_or_create(SCHEMA, CONTRACT)
    (tmp_path / "empty").mkdir()
    DeltaTarget(str(tmp_path / "empty"), ["dt"]).open_or_create(SCHEMA, CONTRACT)
    assert DeltaTable.is_deltatable(str(tmp_path / "empty"))


def test_the_merge_guard_compares_several_ordering_columns_in_order(tmp_path):
    schema = pa.schema([("id", pa.string()), ("dt", pa.string()), ("ts", pa.int64()), ("seq", pa.int64()),
                        ("v", pa.string())])
    target = DeltaTarget(str(tmp_path / "t"), ["dt"])
    target.open_or_create(schema, Contract(("id",), ("dt",), ("ts", "seq"), "partitioned"))

    def write(batch, ts, seq, v, op):
        data = pa.table({"id": ["a"], "dt": ["d1"], "ts": [ts], "seq": [seq], "v": [v], WRITE_COLUMN: [op]})
        target.commit(data, ["id"], ["ts", "seq"], "w", batch, {}, incoming_wins_ties=True)
        return [(r["ts"], r["seq"], r["v"]) for r in contents(target.uri)]

    assert write(0, 5, 3, "first", "insert") == [(5, 3, "first")]
    # Updates a stale index let through: older on the second column, or on the first.
    assert write(1, 5, 2, "older seq", "update") == [(5, 3, "first")]
    assert write(2, 4, 9, "older ts", "update") == [(5, 3, "first")]
    assert write(3, 5, 4, "newer seq", "update") == [(5, 4, "newer seq")]
