import datetime as dt
import json
import os
import subprocess
import sys

import pyarrow as pa
import pytest
from deltalake import CommitProperties, DeltaTable, Transaction, write_deltalake

from sink import keys
from sink.cli import main
from sink.delta_log.reading import NUM_SHARDS_PROPERTY, SHARDS_PROPERTY
from sink.index import holder
from sink.index.entry import Entry
from sink.index.registry import close_kept_open
from sink.index.replica import ShardReplica
from sink.index.spec import replica_spec

TODAY = dt.datetime.now(dt.UTC).replace(microsecond=0)


@pytest.fixture
def setup(tmp_path):
    uri = tmp_path / "table"
    rows = [(f"k{d}-{i}", (TODAY - dt.timedelta(days=d)).date().isoformat(), TODAY - dt.timedelta(days=d))
            for d in range(10) for i in range(50)]
    write_deltalake(str(uri), pa.table({
        "id": [r[0] for r in rows], "dt": [r[1] for r in rows],
        "ts": pa.array([r[2] for r in rows], pa.timestamp("us", tz="UTC"))}), partition_by=["dt"])
    conf = tmp_path / "sink.toml"
    conf.write_text('[sink]\ntable_uri = "table"\nkey = ["id"]\npartition_by = ["dt"]\nordering = "ts"\n'
                    'writer_id = "w"\nindex_dir = "index"\nbootstrap_days = 3\nnum_shards = 2\n')
    return conf, rows


def run(capsys, *argv):
    code = main(list(argv))
    return code, capsys.readouterr()


def test_bootstrap_then_inspect_then_verify(setup, capsys):
    conf, rows = setup
    code, out = run(capsys, "bootstrap", "--config", str(conf), "--json")
    assert code == 0
    loaded = json.loads(out.out)
    hot_rows = [r for r in rows if r[1] >= (TODAY - dt.timedelta(days=2)).date().isoformat()]
    assert [s["loaded"] for s in loaded] == [3, 3]
    assert sum(s["keys"] for s in loaded) == len(hot_rows)
    assert "partitions" in out.err  # the progress bar

    code, out = run(capsys, "inspect", "--config", str(conf), "--json")
    report = json.loads(out.out)
    assert code == 0 and report["table_version"] == 0
    assert [(s["shard"], s["of"], s["version"]) for s in report["shards"]] == [(0, 2, 0), (1, 2, 0)]
    per_shard = [
        sum(1 for r in hot_rows if keys.shard_of(r[0].encode(), 2) == shard) for shard in (0, 1)]
    assert [sum(p["entries"] for p in s["partitions"]) for s in report["shards"]] == per_shard
    assert {p["reason"] for s in report["shards"] for p in s["partitions"]} == {"bootstrap"}

    code, out = run(capsys, "inspect", "--config", str(conf))
    assert "shard 1 of 2: version 0, 3 partitions" in out.out

    code, out = run(capsys, "verify", "--config", str(conf))
    assert code == 0 and "OK: every replica matches the table" in out.out

    code, out = run(capsys, "bootstrap", "--config", str(conf))
    assert "warm at version 0" in out.err  # a second pre-warm loads nothing


def test_verify_finds_missing_extra_and_wrong_entries(setup, capsys):
    conf, rows = setup
    run(capsys, "bootstrap", "--config", str(conf))
    index = conf.parent / "index"
    path = next(index.glob("*/shard-0-of-2"))
    pid = f"dt={rows[0][1]}"
    mine = [r[0].encode() for r in rows if r[1] == rows[0][1] and keys.shard_of(r[0].encode(), 2) == 0]
    with ShardReplica.open(path, replica_spec(["id"], ["dt"], "ts")) as r:
        held = dict(r.keyspaces.entries(pid))
        held.pop(mine[0])
        held[mine[1]] = Entry(held[mine[1]].ordering + 1)
        held[b"ghost"] = Entry(1)
        r.load_partition(pid, list(held), list(held.values()), reason="on_demand")
    code, out = run(capsys, "verify", "--config", str(conf), "--json")
    assert code == 1
    result = json.loads(out.out)
    assert result["ok"] is False
    assert [s["mismatches"] for s in result["shards"]] == [3, 0]
    # Keys as the key columns' values, not the index's encoding.
    assert sorted(result["shards"][0]["examples"]) == sorted([
        f"{pid}: key id={mine[0].decode()!r} is in the table, not in the replica",
        f"{pid}: key id={mine[1].decode()!r} ordering {held[mine[1]].ordering} in the replica, "
        f"{held[mine[1]].ordering - 1} in the table",
        f"{pid}: key id='ghost' is in the replica, not in the table"])


def test_errors_are_clear(tmp_path, capsys):
    conf = tmp_path / "sink.toml"
    conf.write_text('[sink]\ntable_uri = "nowhere"\nkey = ["id"]\nordering = "ts"\nwriter_id = "w"\n')
    code, out = run(capsys, "inspect", "--config", str(conf))
    assert code == 2 and "no Delta table at" in out.err
    assert not DeltaTable.is_deltatable(str(tmp_path / "nowhere"))


def test_contract_shows_records_and_refuses_a_key_the_rows_do_not_satisfy(setup, capsys):
    conf, rows = setup
    code, out = run(capsys, "contract", "--config", str(conf))
    assert code == 0 and "records no contract yet" in out.out
    code, out = run(capsys, "contract", "--config", str(conf), "--rewrite")
    assert code == 0 and "recorded: key ['id'], partition_by ['dt'], ordering 'ts'" in out.out
    code, out = run(capsys, "contract", "--config", str(conf))
    assert code == 0 and "table and config agree" in out.out

    # Keyed by the date alone, a partition's 50 rows share one key: refused, nothing recorded.
    conf.write_text(conf.read_text().replace('key = ["id"]\npartition_by = ["dt"]',
                                             'key = ["ts"]\npartition_by = ["dt"]\nordering = "id"')
                    .replace('ordering = "ts"\n', ""))
    code, out = run(capsys, "contract", "--config", str(conf))
    assert code == 1 and "key: ('id',) vs ('ts',)" in out.out and "ordering: 'ts' vs 'id'" in out.out
    code, out = run(capsys, "contract", "--config", str(conf), "--rewrite")
    assert code == 1 and "10 key(s) have several rows under ['ts', 'dt']" in out.out
    assert DeltaTable(str(conf.parent / "table")).metadata().configuration["upsert_sink.key"] == '["id"]'


def test_bootstrap_without_num_shards_warms_the_shards_the_writers_last_batch_used(setup, capsys, tmp_path):
    conf, rows = setup
    conf.write_text(conf.read_text().replace("num_shards = 2\n", ""))
    code, out = run(capsys, "bootstrap", "--config", str(conf))
    assert code == 2 and "sets no num_shards and writer 'w' has no batch" in out.err and "--num-shards" in out.err
    uri = str(tmp_path / "table")
    # What a sink batch of writer w on 3 shards records, then another writer's commit on top.
    table = DeltaTable(uri).to_pyarrow_table().slice(0, 1)
    write_deltalake(uri, table, mode="append", commit_properties=CommitProperties(
        custom_metadata={NUM_SHARDS_PROPERTY: "3", SHARDS_PROPERTY: "0"}, app_transactions=[Transaction("w", 0)]))
    write_deltalake(uri, table, mode="append", commit_properties=CommitProperties(
        custom_metadata={NUM_SHARDS_PROPERTY: "5", SHARDS_PROPERTY: "0"}, app_transactions=[Transaction("other", 0)]))
    code, out = run(capsys, "bootstrap", "--config", str(conf))
    assert code == 0
    table_id = DeltaTable(uri).metadata().id
    assert sorted(p.name for p in (tmp_path / "index" / table_id).iterdir()) == [
        "shard-0-of-3", "shard-1-of-3", "shard-2-of-3"]


@pytest.mark.spark
@pytest.mark.parametrize("scope", ["partitioned", "global"])
def test_verify_after_the_job_stops_checks_the_replicas_at_the_tables_latest_version(spark, tmp_path, scope):
    """The replicas reflect the version their last batch was tagged against, and hold that
    batch's entries staged until the next batch promotes them: verify promotes them in its
    read-only view, so it checks the table as it is, not one version behind."""
    from sink import SinkConfig, UpsertSink
    from tests.oracle import SCHEMA, random_batches, verify_replicas

    cfg = SinkConfig(table_uri=str(tmp_path / "table"), key=["id"], partition_by=["dt"], ordering="ts",
                     delete_when="op = 'd'", writer_id="w", index_dir=str(tmp_path / "index"), num_shards=2,
                     metrics_port=0, tag_on="executors", scope=scope)
    sink = UpsertSink(cfg)
    for b, events in enumerate(random_batches(3, batches=2, per_batch=300)):
        sink(spark.createDataFrame(events, SCHEMA), b)
    latest = DeltaTable(cfg.table_uri).version()
    results = verify_replicas(cfg)  # no mismatch
    assert [r["version"] for r in results] == [latest, latest]
    # A commit by another writer: nothing staged belongs to it, the replicas stay where they are.
    write_deltalake(cfg.table_uri, DeltaTable(cfg.table_uri).to_pyarrow_table().slice(0, 0), mode="append")
    assert [r["version"] for r in verify_replicas(cfg)] == [latest, latest]


def _cli(conf, *argv) -> subprocess.CompletedProcess:
    """The CLI in a process of its own, as an operator runs it beside the job."""
    return subprocess.run([sys.executable, "-m", "sink", *argv, "--config", str(conf)], capture_output=True,
                          text=True, timeout=120)


@pytest.mark.spark
def test_inspect_and_verify_from_another_process_see_the_replicas_a_running_sink_holds(spark, setup):
    """Driver tagging keeps its replicas open, and their writes sit in memtables (the WAL is
    off): another process's read-only open saw every shard empty, at no version. The holder
    checkpoints a replica when a reader asks, so the live state is shown, and who holds it."""
    from sink import SinkConfig, UpsertSink
    from sink.batch.driver_tagger import wait_caught_up

    conf, rows = setup
    conf.write_text(conf.read_text() + 'tag_on = "driver"\nmetrics_port = 0\npeek_max_keys = 0\n')
    cfg = SinkConfig.from_file(conf)
    sink = UpsertSink(cfg)
    old_day = (TODAY - dt.timedelta(days=8)).date().isoformat()  # outside the 3-day window: loaded on use
    batch = [("new-1", TODAY.date().isoformat(), TODAY), ("k8-0", old_day, TODAY)]
    sink(spark.createDataFrame(batch, "id STRING, dt STRING, ts TIMESTAMP"), 0)
    sink(spark.createDataFrame([("new-2", TODAY.date().isoformat(), TODAY)], "id STRING, dt STRING, ts TIMESTAMP"),
         1)
    try:
        version = DeltaTable(cfg.table_uri).version()
        wait_caught_up(conf.parent / "index" / DeltaTable(cfg.table_uri).metadata().id)  # the catch-up to it
        done = _cli(conf, "inspect", "--json")
        assert done.returncode == 0, done.stderr
        shards = json.loads(done.stdout)["shards"]
        # Each shard was brought to batch 1's commit after it, and holds its own keys of the 3
        # hot days, plus the old day where the batch named one of its keys.
        assert [(s["state"], s["live"], s["held_by"]["pid"]) for s in shards] == [("held", True, os.getpid())] * 2
        assert [s["version"] for s in shards] == [version] * 2
        held = {s["shard"]: {p["partition"] for p in s["partitions"]} for s in shards}
        hot = {f"dt={(TODAY - dt.timedelta(days=d)).date().isoformat()}" for d in range(3)}
        old_shard = keys.shard_of(b"k8-0", 2)
        assert held == {s: hot | ({f"dt={old_day}"} if s == old_shard else set()) for s in (0, 1)}

        done = _cli(conf, "verify")
        assert done.returncode == 0, done.stdout + done.stderr
        assert "OK: every replica matches the table (2 checked)" in done.stdout

        done = _cli(conf, "inspect")
        assert f"held open by pid {os.getpid()}" in done.stdout and "checkpointed for this read" in done.stdout
    finally:
        close_kept_open(under=conf.parent / "index")
    done = _cli(conf, "inspect", "--json")
    assert [s["state"] for s in json.loads(done.stdout)["shards"]] == ["closed", "closed"]


def test_inspect_names_a_replica_whose_holder_exited_without_closing_it(setup, capsys):
    conf, _ = setup
    run(capsys, "bootstrap", "--config", str(conf))
    path = next((conf.parent / "index").glob("*/shard-0-of-2"))
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    ShardReplica.open(path, replica_spec(["id"], ["dt"], "ts"))._close_db()  # as a killed process leaves it
    held = json.loads((path / holder.HOLDER_FILE).read_text())
    (path / holder.HOLDER_FILE).write_text(json.dumps({**held, "pid": int(gone.stdout)}))
    code, out = run(capsys, "inspect", "--config", str(conf))
    assert code == 0
    assert f"left dirty by pid {int(gone.stdout)} on {held['host']}" in out.out
    assert "which has exited: the sink rebuilds it on its next open" in out.out


def test_verify_without_replicas_says_it_checked_nothing(setup, capsys):
    conf, _ = setup
    code, out = run(capsys, "verify", "--config", str(conf))
    assert code == 0
    assert "nothing to verify" in out.out and "OK" not in out.out
