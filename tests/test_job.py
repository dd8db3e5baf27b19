import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pytest
from deltalake import DeltaTable

import jobs.upsert_stream
from jobs.job_config import SOURCE_FORMATS, load_job_config
from jobs.upsert_stream import run
from sink import SchemaError, SinkConfig
from sink.delta_log import log_commit
from sink.errors import ConfigError
from tests.lakehouse.spark_sql_tables import FEATURE_RICH_REASON, amount_of, create_feature_rich
from tests.oracle import Event, expected_history, expected_rows, random_batches
from tests.scaleout_stream import history_rows

pytestmark = pytest.mark.spark

CONFIG = """
[sink]
table_uri = "data/table"
key = ["id"]
partition_by = ["dt"]
ordering = "ts"
delete_when = "op = 'd'"
checkpoint_dir = "data/checkpoint"
index_dir = "data/index"
metrics_port = 0

[source]
format = "json"
path = "data/landing"
schema = "id STRING, dt STRING, ts BIGINT, op STRING, v STRING"
max_files_per_trigger = 1
"""


def drop_file(landing, name, events, record=lambda e: e._asdict()):
    """A landing file, one second newer than the ones before it: a file stream admits files by
    modification time, and the oracle assumes the order they were dropped in."""
    landing.mkdir(parents=True, exist_ok=True)
    path = landing / name
    path.write_text("".join(json.dumps(record(e)) + "\n" for e in events))
    mtime = 1_700_000_000 + len(list(landing.iterdir()))
    os.utime(path, (mtime, mtime))


def table_rows(uri):
    return sorted(DeltaTable(uri).to_pyarrow_table().to_pylist(), key=lambda r: (r["dt"], r["id"]))


def test_job_processes_new_files_once_and_continues_after_a_restart(spark, tmp_path):
    conf = tmp_path / "sink.toml"
    conf.write_text(CONFIG)
    landing = tmp_path / "data" / "landing"
    batches = random_batches(7, batches=4, per_batch=200)
    for i in range(2):
        drop_file(landing, f"f{i}.json", batches[i])
    (first,) = run(str(conf), once=True)
    assert [r.batch_id for r in first.reports] == [0, 1]  # one file per trigger
    table_uri = str(tmp_path / "data" / "table")
    assert table_rows(table_uri) == expected_rows(batches[:2])

    for i in range(2, 4):
        drop_file(landing, f"f{i}.json", batches[i])
    (second,) = run(str(conf), once=True)  # a restart: same checkpoint, only the new files
    assert [r.batch_id for r in second.reports] == [2, 3]
    assert sum(r.records_in for r in second.reports) == 400
    assert table_rows(table_uri) == expected_rows(batches)


def _sink_table(table: str, extra: str = "") -> str:
    """CONFIG's [sink] as one [[sink]] table of its own table and checkpoint."""
    body = CONFIG.split("[source]")[0].replace("[sink]", "[[sink]]")
    return body.replace('"data/table"', f'"data/{table}"').replace('"data/checkpoint"',
                                                                   f'"data/checkpoint-{table}"') + extra


TWO_TABLES = (_sink_table("current") + _sink_table("history", "scd_type = 2\n") + "[source]"
              + CONFIG.split("[source]")[1])


def test_one_job_feeds_several_tables_from_one_source_each_with_its_own_checkpoint(spark, tmp_path, capsys):
    """A current-state table and its SCD type 2 history from one feed: one Spark start-up, a
    query per table, each continuing from its own checkpoint after a restart."""
    from sink.cli import main as cli

    conf = tmp_path / "sink.toml"
    conf.write_text(TWO_TABLES)
    landing = tmp_path / "data" / "landing"
    batches = random_batches(8, batches=3, per_batch=200)
    for i in range(2):
        drop_file(landing, f"f{i}.json", batches[i])
    current, history = run(str(conf), once=True)
    assert [r.batch_id for r in current.reports] == [0, 1] and [r.batch_id for r in history.reports] == [0, 1]
    drop_file(landing, "f2.json", batches[2])
    current, history = run(str(conf), once=True)
    assert [r.batch_id for r in current.reports] == [2] and [r.batch_id for r in history.reports] == [2]
    assert table_rows(str(tmp_path / "data" / "current")) == expected_rows(batches)
    assert history_rows(str(tmp_path / "data" / "history")) == expected_history(batches)
    assert current.writer_id != history.writer_id

    assert cli(["contract", "--config", str(conf), "--sink", "1"]) == 0
    assert "scd_type" not in capsys.readouterr().err
    assert cli(["inspect", "--config", str(conf)]) == 2
    assert "has 2 [[sink]] tables (['data/current', 'data/history']): name one (--sink" in capsys.readouterr().err


def test_a_table_whose_query_keeps_failing_is_restarted_with_backoff_and_the_others_go_on(spark, tmp_path):
    """The "broken" table fails a batch on a value its source did not send, for a key it does
    not hold (unsent_values = "fail"): its query fails at every restart. It is restarted
    max_restarts times, counted each time, while the other table streams every file; the job
    then ends with an error naming the broken table."""
    from prometheus_client import REGISTRY

    from jobs.supervisor import TablesFailedError

    conf = tmp_path / "sink.toml"
    broken = 'unchanged_value = "__unsent__"\nunsent_values = "fail"\n'
    conf.write_text(_sink_table("good") + _sink_table("broken", broken) + "[source]" + CONFIG.split("[source]")[1]
                    + "[job]\nrestart_backoff_seconds = 0.1\nrestart_backoff_max_seconds = 0.2\nmax_restarts = 2\n")
    landing = tmp_path / "data" / "landing"
    batches = random_batches(9, batches=3, per_batch=100)
    batches[0].append(Event("new-key", "2025-01-01", 5, "u", "__unsent__"))
    for i, events in enumerate(batches):
        drop_file(landing, f"f{i}.json", events)
    sinks = []
    original = jobs.upsert_stream.UpsertSink

    def kept(cfg):
        sinks.append(original(cfg))
        return sinks[-1]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(jobs.upsert_stream, "UpsertSink", kept)
        with pytest.raises(TablesFailedError, match=r"data/broken stopped after 3 failures in a row: .*"
                                                     r"UnchangedValueError.*'new-key'"):
            run(str(conf), once=True)
    good, broken = sinks
    assert table_rows(str(tmp_path / "data" / "good")) == expected_rows(batches)
    assert REGISTRY.get_sample_value("upsert_sink_query_failures_total", {"sink": broken.writer_id}) == 3
    assert REGISTRY.get_sample_value("upsert_sink_query_failures_total", {"sink": good.writer_id}) is None
    assert DeltaTable(str(tmp_path / "data" / "broken")).to_pyarrow_table().num_rows == 0  # its batch never committed


def test_several_tables_need_their_own_checkpoint(tmp_path):
    conf = tmp_path / "sink.toml"
    conf.write_text(TWO_TABLES.replace("checkpoint-history", "checkpoint-current"))
    with pytest.raises(ConfigError, match=r"share checkpoint_dir .*each table needs its own"):
        load_job_config(conf)


def test_under_spark_connect_several_tables_need_their_own_metrics_port(tmp_path):
    conf = tmp_path / "sink.toml"
    conf.write_text(TWO_TABLES.replace("metrics_port = 0", "metrics_port = 9108"))
    with pytest.raises(ConfigError, match=r"share metrics_port \[9108, 9108\]: under Spark Connect each table's"):
        run(str(conf), once=True, remote="sc://localhost:1")


def test_job_fails_before_the_first_batch_when_a_column_is_missing(spark, tmp_path):
    conf = tmp_path / "sink.toml"
    conf.write_text(CONFIG.replace('ordering = "ts"', 'ordering = "event_time"'))
    with pytest.raises(SchemaError, match="ordering column 'event_time' is not in the stream"):
        run(str(conf), once=True)
    assert not DeltaTable.is_deltatable(str(tmp_path / "data" / "table"))


def test_job_config_errors_name_the_key(tmp_path):
    conf = tmp_path / "sink.toml"
    conf.write_text(CONFIG.replace('format = "json"', 'format = "avro"'))
    accepted = r"source.format = 'avro' is not accepted; accepted values: \['json', 'csv', 'parquet', 'kafka'\]"
    with pytest.raises(ConfigError, match=accepted):
        load_job_config(conf)
    conf.write_text(CONFIG.replace("max_files_per_trigger = 1", 'max_files_per_trigger = 1\nselect = "id"'))
    with pytest.raises(ConfigError, match="source.select must be a list of Spark SQL expressions, got 'id'"):
        load_job_config(conf)
    conf.write_text(CONFIG + "\n[job]\ntrigger = 5\n")
    with pytest.raises(ConfigError, match=r"unknown job key\(s\) \['trigger'\]"):
        load_job_config(conf)
    conf.write_text(CONFIG + '\n[job]\nspark_log_level = "quiet"\n')
    with pytest.raises(ConfigError, match=r"job.spark_log_level = 'quiet' is not accepted; accepted values: "
                                          r"\['ALL', 'TRACE', 'DEBUG', 'INFO', 'WARN', 'ERROR', 'FATAL', 'OFF'\]"):
        load_job_config(conf)


KAFKA_SOURCE = """
[source]
format = "kafka"
schema = "id STRING, dt STRING, ts BIGINT, op STRING, v STRING"
"""


@pytest.mark.parametrize(("source", "error"), [
    ("topics = ['t']", "source.format = 'kafka' needs source.bootstrap_servers"),
    ("bootstrap_servers = 'b:9092'", "needs exactly one of source.topics .* and source.subscribe_pattern"),
    ("bootstrap_servers = 'b:9092'\ntopics = ['t']\nsubscribe_pattern = 't.*'", "needs exactly one of"),
    ("bootstrap_servers = 'b:9092'\ntopics = 't'", "source.topics must be a list of topic names, got 't'"),
    ("bootstrap_servers = 'b:9092'\ntopics = ['t']\nvalue_format = 'avro'",
     r"source.value_format = 'avro' is not accepted; accepted values: \['json', 'json-with-schema'\]"),
    ("bootstrap_servers = 'b:9092'\ntopics = ['t']\npath = 'landing'", "source.path and source.max_files_per_trigger"),
    ("bootstrap_servers = 'b:9092'\ntopics = ['t']\nmax_offsets_per_trigger = 0",
     "source.max_offsets_per_trigger must be a positive integer, got 0"),
    ("bootstrap_servers = 'b:9092'\ntopics = ['t']\nenvelope = 'debezium'\nkey_schema = 'id STRING'",
     "source.key_schema is for plain records"),
])
def test_a_kafka_source_config_error_names_the_key(tmp_path, source, error):
    conf = tmp_path / "sink.toml"
    conf.write_text(CONFIG.split("[source]")[0] + KAFKA_SOURCE + source + "\n")
    with pytest.raises(ConfigError, match=error):
        load_job_config(conf)


def test_a_file_source_refuses_the_kafka_keys(tmp_path):
    conf = tmp_path / "sink.toml"
    conf.write_text(CONFIG + "topics = ['t']\nstarting_offsets = 'latest'\n")
    with pytest.raises(ConfigError, match=r"source key\(s\) \['topics', 'starting_offsets'\] are read by "
                                          "source.format = 'kafka' only, not 'json'"):
        load_job_config(conf)


def test_each_table_may_read_a_source_of_its_own_which_the_cli_leaves_to_the_job(tmp_path):
    conf = tmp_path / "sink.toml"
    sink = CONFIG.split("[sink]")[1].split("[source]")[0]
    conf.write_text(f"""
[[sink]]{sink.replace('data/table', 'data/orders').replace('data/checkpoint', 'data/orders_checkpoint')}
[sink.source]
topics = ["cdc.public.orders"]
schema = "id STRING, dt STRING, ts BIGINT, op STRING, v STRING, amount BIGINT"

[[sink]]{sink}
[sink.source]
topics = ["cdc.public.customers"]
{KAFKA_SOURCE}bootstrap_servers = "b:9092"
""")
    cfg = load_job_config(conf)
    assert [s.topics for s in cfg.sources] == [["cdc.public.orders"], ["cdc.public.customers"]]
    assert [s.schema.endswith("amount BIGINT") for s in cfg.sources] == [True, False]
    assert {s.bootstrap_servers for s in cfg.sources} == {"b:9092"}
    assert SinkConfig.from_file(conf, "1").table_uri == str(tmp_path / "data" / "table")
    conf.write_text(conf.read_text().replace('topics = ["cdc.public.customers"]', 'value_format = "avro"'))
    with pytest.raises(ConfigError, match=r"source \(with \[sink.source\] of table 1\): source.format = 'kafka' "
                                          "needs exactly one of source.topics"):
        load_job_config(conf)


def test_the_shipped_example_config_loads():
    from pathlib import Path

    conf = Path(__file__).resolve().parent.parent / "conf" / "sink.toml"
    cfg = load_job_config(conf)
    assert [s.key for s in cfg.sinks] == [["event_id"]] and cfg.source.format == "json"
    # Its comment lists the formats the job reads.
    line = next(ln for ln in conf.read_text().splitlines() if ln.startswith("format ="))
    assert line.split("#", 1)[1].split() == " | ".join(SOURCE_FORMATS).split()


def test_the_job_with_replicas_kept_open_exits_zero_and_quietly(tmp_path):
    """Driver tagging keeps replicas open for the process's life: they close at exit, with no
    abort and no traceback after the work is done (a scheduler reads the exit code)."""
    conf = tmp_path / "sink.toml"
    conf.write_text(CONFIG.replace("metrics_port = 0", 'metrics_port = 0\ntag_on = "driver"'))
    drop_file(tmp_path / "data" / "landing", "f0.json", random_batches(3, batches=1, per_batch=200)[0])
    run = subprocess.run([sys.executable, "-m", "jobs.upsert_stream", "--config", str(conf), "--once"],
                         cwd=Path(__file__).resolve().parent.parent, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "upsert batch batch=0" in run.stderr
    for noise in ("terminate called", "Traceback", "Exception ignored"):
        assert noise not in run.stderr


def test_the_job_on_two_executors_ends_quietly_with_their_replicas_closed(tmp_path):
    """local-cluster: the executors' Python workers keep their replicas open. The job used to
    end with hundreds of lines of executor loss (exit code 143, 'Master removed our
    application') and replicas left dirty, rebuilt by the next run. A job that ends normally
    checkpoints and closes them before Spark stops, and stops Spark itself."""
    import pyspark

    conf = tmp_path / "sink.toml"
    conf.write_text(CONFIG.replace("metrics_port = 0", 'metrics_port = 0\ntag_on = "executors"\nnum_shards = 2'))
    batches = random_batches(4, batches=2, per_batch=300, bad_share=0)
    for i, events in enumerate(batches):
        drop_file(tmp_path / "data" / "landing", f"f{i}.json", events)
    env = {**os.environ, "SPARK_HOME": os.path.dirname(pyspark.__file__), "PYSPARK_PYTHON": sys.executable}
    run = subprocess.run([sys.executable, "-m", "jobs.upsert_stream", "--config", str(conf), "--once",
                          "--master", "local-cluster[2,1,1024]"], cwd=Path(__file__).resolve().parent.parent,
                         env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert table_rows(str(tmp_path / "data" / "table")) == expected_rows(batches)
    for noise in ("Lost executor", "exited with code", "Master removed our application", "Traceback"):
        assert noise not in run.stderr, run.stderr[-3000:]
    inspect = subprocess.run([sys.executable, "-m", "sink", "inspect", "--config", str(conf), "--json"],
                             capture_output=True, text=True, timeout=120)
    shards = json.loads(inspect.stdout)["shards"]
    assert [(s["shard"], s["state"], s["clean"]) for s in shards] == [(0, "closed", True), (1, "closed", True)]


@pytest.mark.parametrize("tag_on", ["driver", "executors"])
def test_the_job_through_spark_connect_matches_the_oracle_and_leaves_its_replicas_clean(tmp_path, tag_on):
    """--remote local[2]: the job starts a local Connect server and runs its query through it;
    the sink runs in the server's foreachBatch Python worker (driver tagging) or its tasks."""
    conf = tmp_path / "sink.toml"
    conf.write_text(CONFIG.replace("metrics_port = 0", f'metrics_port = 0\ntag_on = "{tag_on}"\nnum_shards = 2'))
    batches = random_batches(5, batches=3, per_batch=300)
    for i, events in enumerate(batches):
        drop_file(tmp_path / "data" / "landing", f"f{i}.json", events)
    job = [sys.executable, "-m", "jobs.upsert_stream", "--config", str(conf), "--once", "--remote", "local[2]"]
    run = subprocess.run(job, cwd=Path(__file__).resolve().parent.parent, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert table_rows(str(tmp_path / "data" / "table")) == expected_rows(batches)
    assert "Traceback" not in run.stderr, run.stderr[-3000:]
    # The server's foreachBatch worker logs the sink's batch lines (to the server's log: here the job's).
    assert "upsert batch batch=2" in run.stderr
    inspect = subprocess.run([sys.executable, "-m", "sink", "inspect", "--config", str(conf), "--json"],
                             capture_output=True, text=True, timeout=120)
    shards = json.loads(inspect.stdout)["shards"]
    assert [(s["shard"], s["state"], s["clean"]) for s in shards] == [(0, "closed", True), (1, "closed", True)]


@pytest.mark.connect_server
def test_the_job_through_a_connect_server_started_with_deltas_recipe(spark, connect_server, tmp_path):
    """docs/spark-connect.md's recipe: a Connect server started by spark-submit with Delta's
    package, extension and catalog (the Connect pass's own: tests/connect_server.py); the job
    connects to it (`--remote sc://...`) and feeds, under `engine = "delta-spark"`, the tables
    a Connect user created with Spark SQL: deletion vectors, a change data feed, an identity
    column, a generated column and a CHECK constraint, one tagged on the driver and one on the
    executors; the sink's own commits mark rows and generate the identity values. The
    negative amounts the constraint refuses go to quarantine naming it; the client sets none
    of the server's static settings (no CANNOT_MODIFY_CONFIG warnings), and the batch lines
    are in the server's log."""
    tables = {tag_on: str(tmp_path / "data" / tag_on) for tag_on in ("driver", "executors")}
    sinks = "".join(_sink_table(tag_on, f'tag_on = "{tag_on}"\nnum_shards = 2\nengine = "delta-spark"\n')
                    for tag_on in tables)
    source = CONFIG.split("[source]")[1].replace('v STRING"',
                                                 'v STRING, amount BIGINT"\nselect = ["*", "upper(v) AS g"]')
    conf = tmp_path / "sink.toml"
    conf.write_text(sinks + "[source]" + source)
    for uri in tables.values():
        create_feature_rich(spark, uri)  # by Spark SQL, through this process's Connect session
    batches = random_batches(6, batches=2, per_batch=200, bad_share=0)
    landing = tmp_path / "data" / "landing"
    for i, events in enumerate(batches):
        drop_file(landing, f"f{i}.json", events, record=lambda e: {**e._asdict(), "amount": amount_of(e)})
    logged = connect_server.log.stat().st_size
    job = [sys.executable, "-m", "jobs.upsert_stream", "--config", str(conf), "--once", "--remote", connect_server.url]
    run = subprocess.run(job, cwd=Path(__file__).resolve().parent.parent, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    for noise in ("CANNOT_MODIFY_CONFIG", "Failed to set", "Traceback"):
        assert noise not in run.stderr, run.stderr[-3000:]
    written = [[e for e in events if e.op == "d" or amount_of(e) >= 0] for events in batches]
    expected = [{**r, "amount": amount_of(Event(**r)), "g": r["v"].upper()} for r in expected_rows(written)]
    negative = sum(e.op != "d" and amount_of(e) < 0 for events in batches for e in events)
    for uri in tables.values():
        rows = pa.table(DeltaTable(uri).scan(columns=["id", "dt", "ts", "op", "v", "amount", "g"])).to_pylist()
        assert sorted(rows, key=lambda r: (r["dt"], r["id"])) == expected, uri
        reasons = DeltaTable(f"{uri}_quarantine").to_pyarrow_table(columns=["_quarantine_reason"]).column(0)
        assert (len(reasons), set(reasons.to_pylist())) == (negative, {FEATURE_RICH_REASON})
        # The sink's own commits (merge-on-read) gave the identity values: set, each once.
        merges = [h for h in DeltaTable(uri).history() if h["operation"] == "MERGE"]
        assert merges and all(h["engineInfo"] == log_commit.ENGINE_INFO for h in merges)
        ids = pa.table(DeltaTable(uri).scan(columns=["n"])).column(0).to_pylist()
        assert None not in ids and len(set(ids)) == len(ids) == len(expected)
    with open(connect_server.log) as log:
        log.seek(logged)
        assert "upsert batch batch=1" in log.read()
