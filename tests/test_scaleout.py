"""Shards that move between executors: exact, and caught up from the changelog, not reloaded."""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sink import SinkConfig, UpsertSink
from tests.oracle import SCHEMA, changed_keys, expected_rows, verify_replicas
from tests.scaleout_stream import (
    CRASH_BATCHES,
    DAYS,
    NOW,
    OCCUPIED_BATCHES,
    SPARK_MERGE_BATCHES,
    SPARK_MERGE_CRASH_BATCHES,
    late_batches,
    seed_events,
    seed_table,
    table_rows,
)

pytestmark = pytest.mark.spark

SHARDS = 3


@pytest.mark.parametrize("cdf", [False, True])
def test_every_shard_moving_every_batch_catches_up_from_the_changelog(spark, tmp_path, cdf):
    """Two index dirs used in turn, as by two executors each running every shard every other batch."""
    cfg = SinkConfig(table_uri=str(tmp_path / "table"), key=["id"], partition_by=["dt"], ordering="ts",
                     delete_when="op = 'd'", writer_id="moving", num_shards=SHARDS, metrics_port=0,
                     tag_on="executors",  # the path that writes the changelog
                     peek_max_keys=0)  # every partition held, none only read for its few keys
    keys = 3000
    seed = seed_events(keys)
    seed_table(cfg.table_uri, seed, cdf)
    stream = late_batches(5, keys, batches=6, per_batch=2000, delete_share=0.03)
    executors = [UpsertSink(dataclasses.replace(cfg, index_dir=str(tmp_path / name)), clock=lambda: NOW.timestamp())
                 for name in ("executor-a", "executor-b")]
    for b, events in enumerate(stream):
        sink = executors[b % 2]
        sink(spark.createDataFrame(events, SCHEMA), b)
        report = sink.reports[-1]
        assert table_rows(cfg.table_uri) == expected_rows([seed, *stream[: b + 1]]), f"after batch {b}"
        assert report.invalidated == 0 and report.partition_loads["invalidated"] == 0
        if b < 2:
            # Each dir's first batch: new replicas, the hot window plus every other partition touched.
            assert report.replicas_rebuilt == SHARDS
            assert sum(report.partition_loads.values()) == SHARDS * DAYS
        else:
            # Every shard is one batch behind: the other executor's batch comes from the changelog.
            assert report.partition_loads == {"bootstrap": 0, "on_demand": 0, "invalidated": 0}
            assert report.shard_moves == SHARDS
            # One entry per key the other executor's batch changed (every partition is held).
            assert report.changelog_applied == changed_keys([seed, *stream], b), f"batch {b}"
    for sink in executors:
        verify_replicas(sink.config)


@pytest.fixture(scope="module")
def two_executors(tmp_path_factory) -> list[dict]:
    """The scale-out streams (partitioned scope with and without the change data feed, global
    scope, SCD type 2 tables in both scopes) on Spark's local-cluster: two executor JVMs,
    each keeping its replicas under its own local dir (the default index dir), as on two
    machines. One application, in a child process."""
    work = tmp_path_factory.mktemp("two-executors")
    out = work / "result.json"
    run = subprocess.run([sys.executable, "-m", "tests.scaleout_stream", "--master", "local-cluster[2,1,1024]",
                          "--work", str(work), "--out", str(out), "--shards", "4"],
                         cwd=Path(__file__).resolve().parent.parent, capture_output=True, text=True, timeout=1200,
                         env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert run.returncode == 0, run.stderr[-5000:]
    return json.loads(out.read_text())["streams"]


@pytest.mark.parametrize("name", ["plain", "cdf"])
def test_two_executors_stay_exact_and_load_only_what_a_new_replica_needs(two_executors, name):
    stream = next(s for s in two_executors if s["stream"] == name)
    assert [b["exact"] for b in stream["batches"]] == [True] * len(stream["batches"])
    for b in stream["batches"]:
        assert b["invalidated"] == 0 and b["loads"]["invalidated"] == 0, b
        # Every batch touches all partitions of every shard: a replica new on its executor loads
        # them all once; a replica that was there loads nothing, whoever tagged the batches between.
        assert sum(b["loads"].values()) == DAYS * b["replicas_rebuilt"], b
    # Half the deletes name no partition: found where their key lives, or kept as unknown keys.
    placed = [b["without_partition"] for b in stream["batches"]]
    assert sum(p["located"] for p in placed) > 0 and sum(p["ambiguous"] + p["upsert"] for p in placed) == 0


def test_two_executors_moved_shards_and_caught_up_from_the_changelog(two_executors):
    for stream in (s for s in two_executors if not s["stream"].endswith("crash")):  # crash: executors replaced
        # The occupied batches run on one executor, the other one each time: every shard moves.
        assert [b["batch"] for b in stream["batches"] if b["occupied"]] == list(OCCUPIED_BATCHES)
        assert sum(b["shard_moves"] for b in stream["batches"]) >= 4, stream["stream"]
        assert sum(b["changelog_applied"] for b in stream["batches"]) > 0, stream["stream"]
        # Replicas are per executor: a shard's replica is created once on each executor it runs on.
        assert 4 <= sum(b["replicas_rebuilt"] for b in stream["batches"]) <= 8, stream["stream"]


def test_two_executors_keep_a_global_stream_exact_with_the_key_filter_answering_new_keys(two_executors):
    """Scope "global" on two executors: moves, key-only deletes and re-sends stay exact while
    shards move and catch up from the changelog, whose writes go through each replica's key
    filter (saved with the replica on its executor, read back at the next open)."""
    stream = next(s for s in two_executors if s["stream"] == "global")
    batches = stream["batches"]
    assert [b["exact"] for b in batches] == [True] * len(batches)
    assert all(b["invalidated"] == 0 for b in batches)
    assert sum(b["ops"]["delete"] for b in batches) > 0 and sum(b["ops"]["quarantined"] for b in batches) == 0
    # Half the stream's keys are new: the filter answers them, but for its rare false positives.
    missed, filtered = sum(b["misses"] for b in batches), sum(b["filter_misses"] for b in batches)
    assert filtered >= 0.95 * missed > 0


def test_executors_write_the_files_and_a_task_killed_with_its_executor_commits_nothing(two_executors):
    """The file-writing tasks run on the executors. In the crash stream an executor JVM is
    SIGKILLed inside a writing task, after it wrote its files: Spark runs the lost tasks again
    (tagging too, its shuffle output went with the executor), the batch commits the files of
    the attempts that finished, and the table stays exact. The killed attempt's files stay
    behind, never committed (VACUUM removes them). The history-crash stream does the same
    inside a history table's writing tasks, checked against the history oracle; the
    vectors-crash stream inside merge-on-read writing tasks on a table Spark SQL created with
    deletion vectors, the change data feed, column mapping, a CHECK constraint and a generated
    column: the killed attempt's deletion vector and change files stay unreferenced too; the
    mirror-crash stream inside merge-on-read writing tasks of an unpartitioned table, each of
    which writes its share of the table's one partition."""
    plain = next(s for s in two_executors if s["stream"] == "plain")
    crashes = [s for s in two_executors if s["stream"] in ("crash", "history-crash", "vectors-crash", "mirror-crash")]
    for stream in (plain, *crashes):
        assert [b["exact"] for b in stream["batches"]] == [True] * len(stream["batches"]), stream["stream"]
        updates = "merge-on-read" if stream["stream"] in ("vectors-crash", "mirror-crash") else "rewrite"
        assert {b["mode"] for b in stream["batches"]} - {"append"} == {updates}, stream["stream"]
        assert all(b["write_seconds"] > 0 for b in stream["batches"])
    nothing = {"data": 0, "changes": 0, "vectors": 0}
    assert [b["never_committed"] for b in plain["batches"]] == [nothing] * len(plain["batches"])
    assert len(crashes) == 4
    # The mirror's one partition is written by every writing task (4 shards: 4 tasks), not one.
    mirror = next(s for s in crashes if s["stream"] == "mirror-crash")
    assert [b["write_tasks"] for b in mirror["batches"] if b["mode"] != "append"] == [4] * len(mirror["batches"])
    for crash in crashes:  # type 1 copy-on-write and merge-on-read, and a history table's writing tasks
        killed = [b["batch"] for b in crash["batches"] if b["killed"]]
        assert killed == list(CRASH_BATCHES), crash["stream"]
        left = [b["never_committed"] for b in crash["batches"]]
        assert left[: killed[0]] == [nothing] * killed[0], crash["stream"]
        kinds = {"vectors-crash": ("data", "changes", "vectors"), "mirror-crash": ("data", "vectors")}.get(
            crash["stream"], ("data",))
        for kind in kinds:
            assert 0 < left[killed[0]][kind] < left[-1][kind], (crash["stream"], kind, left)


def test_delta_sparks_merge_reads_the_writes_on_two_executors_one_killed_inside_a_tagging_task(two_executors):
    """engine = "delta-spark": the writes stay cached where the executors tagged them and
    Spark's MERGE reads them there. An executor JVM SIGKILLed inside a tagging task, after it
    tagged its shard: Spark tags the lost shards again (their staged index entries cleared
    first), the MERGE reads what it needs again, and the table stays exact."""
    stream = next(s for s in two_executors if s["stream"] == "spark-merge-crash")
    assert [b["exact"] for b in stream["batches"]] == [True] * SPARK_MERGE_BATCHES
    assert [b["batch"] for b in stream["batches"] if b["killed"]] == list(SPARK_MERGE_CRASH_BATCHES)
    assert {b["mode"] for b in stream["batches"]} == {"merge"}
    assert [sum(b["never_committed"].values()) for b in stream["batches"]] == [0] * len(stream["batches"])


@pytest.mark.parametrize("name", ["history", "global-history"])
def test_two_executors_keep_a_history_table_exact_as_late_events_split_versions(two_executors, name):
    """scd_type = 2 tagged on two executors while shards move, in both scopes: every batch's
    table is the oracle's history, and late events split versions. In global scope keys move
    between partitions and deletes name none: the index lists every partition of a key, and
    the executors that tag a shard next take the lists from the changelog."""
    stream = next(s for s in two_executors if s["stream"] == name)
    batches = stream["batches"]
    assert [b["exact"] for b in batches] == [True] * len(batches)
    assert [b["mode"] for b in batches] == ["append"] + ["rewrite"] * (len(batches) - 1)
    assert all(b["invalidated"] == 0 for b in batches)
    assert sum(b["version_changes"]["split"] for b in batches) > 0
    # Partitioned scope: the executors' writing tasks rebuild the histories and write the
    # files; global scope: the driver does (a key's versions span partitions).
    assert all((b["write_seconds"] > 0) is (name == "history") for b in batches)
    assert sum(b["ops"]["delete"] for b in batches) > 0 and sum(b["ops"]["quarantined"] for b in batches) == 0
