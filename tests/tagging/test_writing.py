"""The file-writing task: the files Spark tasks write, committed by the driver, give the table the
driver's own rewrite gives; rows without a write pass through to the driver."""

import dataclasses
import json
import random

import pyarrow as pa
import pytest
from deltalake import CommitProperties, DeltaTable, QueryBuilder, Transaction
from pyspark.sql.pandas.types import from_arrow_schema, to_arrow_schema

from sink import columns as C
from sink.delta_log import metadata_commit
from sink.lakehouse.commit import actions, rewrite
from sink.routing import tagged_schema
from sink.tagging.writing import FILE_OP, WriteContext, read_written, write_batches
from tests.lakehouse.commit.test_rewrite import DAYS, SCHEMA, commit_rewrite, contents, random_batch, seeded, writes_of

OUTPUT = to_arrow_schema(tagged_schema(from_arrow_schema(SCHEMA), 2), timezone="UTC")


def context(path, partial=False):
    return WriteContext(table_uri=path, schema=SCHEMA, key_cols=("k1", "k2"), ordering=("o1", "o2"),
                        partition_by=("day",), incoming_wins_ties=True, partial=partial, output_schema=OUTPUT,
                        files=actions.stored_files(DeltaTable(path), ["day"]))


def tagged(records, op=None):
    """Records as a tagging task outputs them (OUTPUT's columns; the write in C.WRITE)."""
    columns = {f.name: pa.array([r.get(f.name) for r in records], f.type) for f in SCHEMA}
    columns[C.WRITE] = pa.array([r.get("w") for r in records], pa.string())
    columns[C.OP] = pa.array([op or r.get("w") for r in records], pa.string())
    columns[C.PARTIAL] = pa.array([r.get("partial", True) for r in records], pa.bool_())
    n = len(records)
    return pa.table([columns.get(f.name, pa.nulls(n, f.type)) for f in OUTPUT], schema=OUTPUT)


def run_tasks(ctx, tables):
    """Each table through its own writing task; every output row, in one table."""
    return pa.Table.from_batches([b for t in tables for b in write_batches(ctx, iter(t.to_batches()))],
                                 schema=OUTPUT)


def commit(path, out, batch=1):
    written = read_written(out.filter(pa.compute.equal(out.column(C.OP), FILE_OP)).column(C.STATS).to_pylist())
    dt = DeltaTable(path)
    props = CommitProperties(app_transactions=[Transaction("w", batch)], max_commit_retries=0)
    rewrite.commit_rewrite(dt, path, written.rewrite, actions.stored_files(dt, ["day"]), SCHEMA, ["day"], props)
    return written


@pytest.mark.parametrize("seed", range(4))
def test_files_written_by_tasks_give_the_table_the_drivers_rewrite_gives(tmp_path, seed):
    by_driver, by_tasks = str(tmp_path / "driver"), str(tmp_path / "tasks")
    rng = random.Random(seed)
    seeded(by_driver, seed=seed)
    stored = seeded(by_tasks, seed=seed)
    for batch in range(1, 4):
        records = random_batch(rng, len(stored), by_driver)
        done = commit_rewrite(by_driver, writes_of(records, partial=True, batch=batch))
        # As Spark routes them: each partition's writes in one task, two partitions in the first.
        tasks = [[r for r in records if r["day"] in days] for days in (DAYS[:2], DAYS[2:])]
        written = commit(by_tasks, run_tasks(context(by_tasks, partial=True), [tagged(t) for t in tasks]), batch)
        assert written.rows == len(records)
        assert written.partitions_changed == len({r["day"] for r in records if r["w"] in ("update", "delete")})
        assert written.seconds > 0
        assert len(written.task_seconds) == sum(1 for t in tasks if t)  # each task that had writes, once
        assert sum(written.task_seconds) == pytest.approx(written.seconds)
        assert written.rewrite.unchanged == done.unchanged  # no-op updates, counted where they are found
        assert contents(by_tasks) == contents(by_driver), f"after batch {batch}"


def live_contents(path):
    """The table's rows as delta-rs' query engine reads them: deletion vectors applied."""
    read = QueryBuilder().register("t", DeltaTable(path)).execute("SELECT * FROM t").read_all()
    return sorted(pa.table(read).to_pylist(), key=lambda r: (r["day"], r["k1"], r["k2"]))


@pytest.mark.parametrize("share", [0.0, 1.0], ids=["every-file-rewritten", "every-file-marked"])
def test_a_writing_task_marks_or_rewrites_each_file_by_the_share_it_is_given(tmp_path, share):
    by_driver, by_task = str(tmp_path / "driver"), str(tmp_path / "task")
    stored = seeded(by_driver)
    seeded(by_task)
    metadata_commit.enable_deletion_vectors(DeltaTable(by_task), by_task)
    records = random_batch(random.Random(5), len(stored), by_driver)
    commit_rewrite(by_driver, writes_of(records, partial=True))
    ctx = dataclasses.replace(context(by_task, partial=True), merge_on_read=True, rewrite_marked_share=share)
    written = commit(by_task, run_tasks(ctx, [tagged(records)]))
    changed = len(written.rewrite.removes)
    assert changed and written.rewrite.files_changed == ((0, changed) if share == 0.0 else (changed, 0))
    assert live_contents(by_task) == contents(by_driver)


def test_rows_without_a_write_pass_through_and_tombstones_are_not_written(tmp_path):
    path = str(tmp_path / "t")
    seeded(path)
    stats = tagged([{"k1": None}], op=C.STATS_OP)
    stats = stats.set_column(OUTPUT.get_field_index(C.STATS), C.STATS, pa.array([json.dumps({"a": 1})]))
    quarantined = tagged([{"k1": 1, "k2": None, "day": DAYS[0]}], op="quarantined")
    delete_record = tagged([{"k1": 0, "k2": "k0", "day": DAYS[0]}], op="_delete_record")
    tombstone = tagged([{"k1": 3, "k2": "gone", "day": DAYS[0], "o1": 1, "w": "tombstone"}])
    insert = tagged([{"k1": 5, "k2": "new", "day": DAYS[1], "o1": 1, "v": "x", "w": "insert", "partial": False}])
    out = run_tasks(context(path), [pa.concat_tables([stats, quarantined, delete_record, tombstone, insert])])
    passed = out.filter(pa.compute.not_equal(out.column(C.OP), FILE_OP))
    assert passed.column(C.OP).to_pylist() == [C.STATS_OP, "quarantined", "_delete_record"]
    assert passed.column(C.STATS).to_pylist()[0] == json.dumps({"a": 1})
    written = commit(path, out)
    assert (written.rows, written.partitions_changed, len(written.rewrite.removes)) == (1, 0, 0)
    assert [r["k2"] for r in contents(path) if r["k2"] in ("new", "gone")] == ["new"]


def test_a_task_without_rows_yields_nothing(tmp_path):
    path = str(tmp_path / "t")
    seeded(path)
    assert list(write_batches(context(path), iter([]))) == []
