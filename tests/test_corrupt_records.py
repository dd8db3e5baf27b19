"""Records that did not parse never overwrite stored data: Spark's PERMISSIVE reader nulls a
value of the wrong type, and the sink must quarantine that record, with its raw text, instead
of writing the null (issue: CDC feeds, point 1)."""

import json
import os

import pytest
from deltalake import DeltaTable

from jobs.job_config import load_job_config
from jobs.upsert_stream import run, source_schema
from sink import SchemaError, SinkConfig, UpsertSink
from sink.errors import ConfigError

pytestmark = pytest.mark.spark

CONFIG = """
[sink]
table_uri = "data/orders"
key = ["order_id"]
partition_by = ["month"]
ordering = "lsn"
delete_when = "op = 'd'"
quarantine_when = "total_cents < 0"
checkpoint_dir = "data/checkpoint"
index_dir = "data/index"
metrics_port = 0

[source]
format = "{fmt}"
path = "data/landing"
schema = "order_id BIGINT, month STRING, lsn BIGINT, op STRING, total_cents BIGINT"
{extra}
"""

CORRUPT = ("corrupt record: _corrupt_record holds its raw text (a value that did not parse as its schema type, "
           "or a malformed line)")


def drop(landing, name, lines):
    """A landing file of raw lines, newer than the ones before it (a file stream admits by mtime)."""
    landing.mkdir(parents=True, exist_ok=True)
    path = landing / name
    path.write_text("".join(line + "\n" for line in lines))
    mtime = 1_700_000_000 + len(list(landing.iterdir()))
    os.utime(path, (mtime, mtime))


def order(order_id, lsn, total, op="u", month="2025-07"):
    return {"order_id": order_id, "month": month, "lsn": lsn, "op": op, "total_cents": total}


def rows(uri, *columns):
    return sorted(tuple(r[c] for c in columns) for r in DeltaTable(uri).to_pyarrow_table().to_pylist())


def job(tmp_path, fmt="json", extra=""):
    conf = tmp_path / "sink.toml"
    conf.write_text(CONFIG.format(fmt=fmt, extra=extra))
    return conf, tmp_path / "data" / "landing", str(tmp_path / "data" / "orders")


def test_a_string_in_a_bigint_column_keeps_the_stored_value_and_quarantines_the_raw_line(spark, tmp_path):
    conf, landing, table = job(tmp_path)
    snapshot = [order(i, 10 + i, 1000 * i) for i in range(1, 6)]
    drop(landing, "f0.json", [json.dumps(o) for o in snapshot])
    run(str(conf), once=True)

    wrong_type = json.dumps(order(2, 50, 0)).replace('"total_cents": 0', '"total_cents": "56305"')
    malformed = '{"order_id": 4, "month": "2025-07", "lsn": 51, "op": "u", "total_cents": 1'
    negative = json.dumps(order(5, 52, -300))
    good = order(3, 53, 3333)
    drop(landing, "f1.json", [wrong_type, malformed, negative, json.dumps(good)])
    (sink,) = run(str(conf), once=True)

    # Independent expectation: the snapshot, then the only record that parsed and passed the rule.
    expected = {o["order_id"]: o["total_cents"] for o in snapshot} | {3: 3333}
    assert rows(table, "order_id", "total_cents") == sorted(expected.items())
    assert "_corrupt_record" not in DeltaTable(table).schema().to_arrow().names
    quarantine = DeltaTable(sink.config.resolved_quarantine_uri).to_pyarrow_table().to_pylist()
    assert sorted(((r["_corrupt_record"], r["_quarantine_reason"]) for r in quarantine), key=repr) == sorted([
        (wrong_type, CORRUPT), (malformed, CORRUPT), (None, "quarantine_when: total_cents < 0")], key=repr)
    assert sink.reports[-1].ops["quarantined"] == 3 and sink.reports[-1].ops["update"] == 1


def test_csv_drops_are_read_with_the_corrupt_record_column_too(spark, tmp_path):
    conf, landing, table = job(tmp_path, fmt="csv", extra='[source.options]\nheader = "true"')
    header = "order_id,month,lsn,op,total_cents"
    drop(landing, "f0.csv", [header, "1,2025-07,10,u,100", "2,2025-07,11,u,200"])
    run(str(conf), once=True)
    drop(landing, "f1.csv", [header, "1,2025-07,20,u,12x", "2,2025-07,21,u,250"])
    (sink,) = run(str(conf), once=True)
    assert rows(table, "order_id", "total_cents") == [(1, 100), (2, 250)]
    quarantine = DeltaTable(sink.config.resolved_quarantine_uri).to_pyarrow_table().to_pylist()
    assert [(r["_corrupt_record"], r["_quarantine_reason"]) for r in quarantine] == [("1,2025-07,20,u,12x", CORRUPT)]


def test_the_job_adds_the_corrupt_record_column_to_text_sources_only_unless_turned_off(spark, tmp_path):
    conf, _, _ = job(tmp_path)
    schema, options = source_schema(load_job_config(conf))
    assert schema.fieldNames()[-1] == "_corrupt_record" and options["columnNameOfCorruptRecord"] == "_corrupt_record"
    conf, _, _ = job(tmp_path, extra="corrupt_records = false")
    schema, options = source_schema(load_job_config(conf))
    assert "_corrupt_record" not in schema.fieldNames() and "columnNameOfCorruptRecord" not in options
    conf, _, _ = job(tmp_path, fmt="parquet")
    assert "_corrupt_record" not in source_schema(load_job_config(conf))[0].fieldNames()
    conf, _, _ = job(tmp_path, extra="corrupt_records = 1")
    with pytest.raises(ConfigError, match="source.corrupt_records must be true or false, got 1"):
        load_job_config(conf)


def sink_config(tmp_path, **extra):
    return SinkConfig(table_uri=str(tmp_path / "t"), key=["id"], ordering="ts", writer_id="w",
                      index_dir=str(tmp_path / "index"), num_shards=2, metrics_port=0, **extra)


def test_a_table_that_already_stores_the_corrupt_record_column_keeps_it(spark, tmp_path):
    """Tables written before the sink knew the column (e.g. with a hand-written workaround)
    keep taking it: no refusal for a 'dropped' column, and good rows store it empty."""
    UpsertSink(sink_config(tmp_path, corrupt_record_column="raw"))(
        spark.createDataFrame([(1, 1, None)], "id INT, ts INT, _corrupt_record STRING"), 0)
    assert "_corrupt_record" in DeltaTable(str(tmp_path / "t")).schema().to_arrow().names
    sink = UpsertSink(sink_config(tmp_path))
    sink(spark.createDataFrame([(1, 2, None), (2, 2, "{bad")], "id INT, ts INT, _corrupt_record STRING"), 1)
    assert rows(str(tmp_path / "t"), "id", "ts", "_corrupt_record") == [(1, 2, None)]
    assert sink.reports[-1].ops["quarantined"] == 1


def test_config_errors_for_the_corrupt_record_column_and_quarantine_when(spark, tmp_path):
    with pytest.raises(ConfigError, match="corrupt_record_column 'ts' is a key, partition or ordering column"):
        sink_config(tmp_path, corrupt_record_column="ts")
    with pytest.raises(ConfigError, match="quarantine_when must be a non-empty string"):
        sink_config(tmp_path, quarantine_when=" ")
    df = spark.createDataFrame([(1, 1, 5)], "id INT, ts INT, _corrupt_record INT")
    with pytest.raises(SchemaError, match="corrupt_record_column '_corrupt_record' has type integer"):
        UpsertSink(sink_config(tmp_path)).validate(df)
    df = spark.createDataFrame([(1, 1, 5)], "id INT, ts INT, total INT")
    with pytest.raises(SchemaError, match=r"quarantine_when = 'total \+ 1' must be a boolean expression"):
        UpsertSink(sink_config(tmp_path, quarantine_when="total + 1")).validate(df)
    with pytest.raises(SchemaError, match="quarantine_when = 'nope > 1' does not apply to the stream"):
        UpsertSink(sink_config(tmp_path, quarantine_when="nope > 1")).validate(df)


def _validate_warnings(spark, tmp_path, caplog, reader, cfg=None) -> list[str]:
    landing = tmp_path / "landing"
    landing.mkdir(exist_ok=True)
    cfg = cfg or SinkConfig(table_uri=str(tmp_path / "t"), key=["order_id"], ordering="lsn", writer_id="w",
                            metrics_port=0)
    caplog.clear()
    with caplog.at_level("WARNING", logger="sink.routing"):
        UpsertSink(cfg).validate(reader(spark.readStream).load(str(landing)))
    return [r.getMessage() for r in caplog.records if r.name == "sink.routing"]


@pytest.mark.parametrize("fmt", ["json", "csv"])
@pytest.mark.connect
def test_validate_warns_once_of_a_file_source_that_would_store_nulls_for_what_did_not_parse(
        spark, tmp_path, caplog, fmt):
    schema = "order_id BIGINT, lsn BIGINT, total_cents BIGINT"
    warned = _validate_warnings(spark, tmp_path, caplog, lambda r: r.format(fmt).schema(schema))
    assert len(warned) == 1
    assert f"reads {fmt} files in PERMISSIVE mode without the corrupt-record column '_corrupt_record'" in warned[0]
    assert "Add `_corrupt_record STRING` to the reader's schema" in warned[0]
    # With the column, or in FAILFAST mode, or from a source that does not parse text: no warning.
    assert _validate_warnings(spark, tmp_path, caplog,
                              lambda r: r.format(fmt).schema(schema + ", _corrupt_record STRING")) == []
    assert _validate_warnings(spark, tmp_path, caplog,
                              lambda r: r.format(fmt).schema(schema).option("mode", "FAILFAST")) == []
    assert _validate_warnings(spark, tmp_path, caplog, lambda r: r.format("parquet").schema(schema)) == []


@pytest.mark.connect
def test_validate_warns_when_the_reader_keeps_corrupt_records_in_another_column(spark, tmp_path, caplog):
    schema = "order_id BIGINT, lsn BIGINT, bad STRING"
    warned = _validate_warnings(spark, tmp_path, caplog, lambda r: r.format("json").schema(schema).option(
        "columnNameOfCorruptRecord", "bad"))
    assert warned == ["the stream's json source keeps unparseable records in 'bad' (columnNameOfCorruptRecord), "
                      "but corrupt_record_column = '_corrupt_record': set corrupt_record_column = 'bad' so that "
                      "such records are quarantined"]
    cfg = SinkConfig(table_uri=str(tmp_path / "t"), key=["order_id"], ordering="lsn", writer_id="w", metrics_port=0,
                     corrupt_record_column="bad")
    assert _validate_warnings(spark, tmp_path, caplog, lambda r: r.format("json").schema(schema).option(
        "columnNameOfCorruptRecord", "bad"), cfg) == []
