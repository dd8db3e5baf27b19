import shutil

import pyarrow as pa
from deltalake import DeltaTable, write_deltalake

from sink.lakehouse.engines import open_tables


def rows(table: DeltaTable) -> list[int]:
    return sorted(table.to_pyarrow_table().column("a").to_pylist())


def test_a_returned_table_is_brought_forward_and_reads_as_a_fresh_open(tmp_path):
    uri = str(tmp_path / "t")
    write_deltalake(uri, pa.table({"a": [1]}))
    with open_tables.lend(uri, "sink-1", 0) as first:
        assert rows(first) == [1]
    write_deltalake(uri, pa.table({"a": [2]}), mode="append")
    write_deltalake(uri, pa.table({"a": [3]}), mode="append")
    with open_tables.lend(uri, "sink-1", 2) as second:
        assert second is first  # kept open, not reopened
        assert second.version() == 2
        assert rows(second) == rows(DeltaTable(uri, version=2)) == [1, 2, 3]
    with open_tables.lend(uri, "sink-1") as latest:  # no version: the latest
        assert latest is first and latest.version() == 2
    open_tables.forget("sink-1")


def test_an_idle_table_brought_forward_is_lent_at_that_version_reading_no_log(tmp_path, monkeypatch):
    uri = str(tmp_path / "t")
    write_deltalake(uri, pa.table({"a": [1]}))
    with open_tables.lend(uri, "sink-1", 0) as first:
        pass
    write_deltalake(uri, pa.table({"a": [2]}), mode="append")
    loads = []
    load_as_version = DeltaTable.load_as_version
    monkeypatch.setattr(DeltaTable, "load_as_version", lambda t, v: loads.append(v) or load_as_version(t, v))
    open_tables.bring_forward(uri, "sink-1", 1)
    assert loads == [1]
    with open_tables.lend(uri, "sink-1", 1) as second:
        assert second is first and loads == [1]  # already there
        assert rows(second) == [1, 2]
    open_tables.forget("sink-1")


def test_bring_forward_opens_no_table_and_moves_none_in_use(tmp_path):
    open_tables.bring_forward(str(tmp_path / "never-opened"), "sink-1")  # no table there: nothing opened
    uri = str(tmp_path / "t")
    write_deltalake(uri, pa.table({"a": [1]}))
    with open_tables.lend(uri, "sink-1", 0) as held:
        write_deltalake(uri, pa.table({"a": [2]}), mode="append")
        open_tables.bring_forward(uri, "sink-1", 1)
        assert held.version() == 0 and rows(held) == [1]  # not moved under its borrower
    open_tables.forget("sink-1")


def test_a_version_older_than_the_kept_one_is_opened_afresh(tmp_path):
    uri = str(tmp_path / "t")
    write_deltalake(uri, pa.table({"a": [1]}))
    write_deltalake(uri, pa.table({"a": [2]}), mode="append")
    with open_tables.lend(uri, "sink-1", 1) as newer:
        pass
    with open_tables.lend(uri, "sink-1", 0) as older:
        assert older is not newer
        assert older.version() == 0 and rows(older) == [1]
    open_tables.forget("sink-1")


def test_a_table_in_use_is_not_lent_at_another_version(tmp_path):
    uri = str(tmp_path / "t")
    write_deltalake(uri, pa.table({"a": [1]}))
    write_deltalake(uri, pa.table({"a": [2]}), mode="append")
    with open_tables.lend(uri, "sink-1", 0) as first, open_tables.lend(uri, "sink-1", 1) as second:
        assert first is not second
        assert rows(first) == [1] and rows(second) == [1, 2]
    open_tables.forget("sink-1")


def test_without_an_owner_nothing_is_kept(tmp_path):
    uri = str(tmp_path / "t")
    write_deltalake(uri, pa.table({"a": [1]}))
    with open_tables.lend(uri, "", 0) as first:
        pass
    with open_tables.lend(uri, "", 0) as second:
        assert second is not first


def test_a_new_owner_never_gets_a_table_from_before_the_table_was_recreated(tmp_path):
    uri = str(tmp_path / "t")
    write_deltalake(uri, pa.table({"a": [1]}))
    write_deltalake(uri, pa.table({"a": [2]}), mode="append")
    with open_tables.lend(uri, "old-sink") as old:
        assert rows(old) == [1, 2]
    shutil.rmtree(uri)
    write_deltalake(uri, pa.table({"a": [7]}))
    write_deltalake(uri, pa.table({"a": [8]}), mode="append")
    write_deltalake(uri, pa.table({"a": [9]}), mode="append")
    with open_tables.lend(uri, "new-sink", 2) as new:
        assert new is not old
        assert rows(new) == [7, 8, 9]
    open_tables.forget("old-sink")
    open_tables.forget("new-sink")


def test_forget_drops_the_owners_tables_and_its_uses_only(tmp_path):
    uri = str(tmp_path / "t")
    write_deltalake(uri, pa.table({"a": [1]}))
    kept = {}
    for owner in ("sink-1", "sink-1/appends", "sink-2"):
        with open_tables.lend(uri, owner) as table:
            kept[owner] = table
    open_tables.forget("sink-1")
    for owner in ("sink-1", "sink-1/appends"):
        with open_tables.lend(uri, owner) as table:
            assert table is not kept[owner]
    with open_tables.lend(uri, "sink-2") as table:
        assert table is kept["sink-2"]
    for owner in ("sink-1", "sink-2"):
        open_tables.forget(owner)


def test_at_most_kept_tables_stay_open(tmp_path, monkeypatch):
    monkeypatch.setattr(open_tables, "KEPT", 2)
    uri = str(tmp_path / "t")
    write_deltalake(uri, pa.table({"a": [1]}))
    kept = {}
    for owner in ("a", "b", "c"):  # "a" returned first: dropped when "c" comes back
        with open_tables.lend(uri, owner) as table:
            kept[owner] = table
    for owner, same in (("c", True), ("b", True), ("a", False)):
        with open_tables.lend(uri, owner) as table:
            assert (table is kept[owner]) is same
    for owner in ("a", "b", "c"):
        open_tables.forget(owner)


def test_borrowers_of_one_version_share_the_table_and_it_moves_on_only_once_free(tmp_path):
    uri = str(tmp_path / "t")
    write_deltalake(uri, pa.table({"a": [1]}))
    with open_tables.lend(uri, "sink-1", 0) as kept:
        pass
    write_deltalake(uri, pa.table({"a": [2]}), mode="append")
    with open_tables.lend(uri, "sink-1", 1) as first:
        with open_tables.lend(uri, "sink-1", 1) as second:
            assert first is second is kept
        with open_tables.lend(uri, "sink-1", 0) as older:  # held at 1: not moved back under the first borrower
            assert older is not kept and rows(older) == [1]
        with open_tables.lend(uri, "sink-1") as latest:  # "latest" never shares a held table
            assert latest is not kept
        assert first.version() == 1 and rows(first) == [1, 2]
    open_tables.forget("sink-1")
