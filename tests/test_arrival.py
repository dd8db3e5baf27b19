"""Arrival order across the files of a micro-batch: ties go to the newer file, however the
files were batched, and a re-run of the batch picks the same winner."""

import json
import os

import pyarrow as pa
import pytest
from deltalake import DeltaTable

from sink import SinkConfig, UpsertSink
from sink.arrival import arrival, file_order, modification_ms, path_order, spark_xxhash64


def test_file_order_is_oldest_first_then_path_each_file_once():
    files = [("file:///l/b.json", 20), ("file:///l/c.json", 10), ("file:///l/b.json", 20), ("file:///l/a.json", 20)]
    assert file_order(files) == tuple(spark_xxhash64(p) for p in
                                      ("file:///l/c.json", "file:///l/a.json", "file:///l/b.json"))


def test_arrival_ranks_by_file_order_then_scan_sequence_unknown_files_first():
    old, new, unknown = spark_xxhash64("old"), spark_xxhash64("new"), spark_xxhash64("")
    files = pa.array([new, old, new, unknown, old], pa.int64())
    seqs = pa.array([0, 5, 1, 9, 3], pa.int64())
    assert arrival(files, seqs, (old, new)).to_pylist() == [3, 2, 4, 0, 1]


def test_arrival_is_the_scan_sequence_when_the_batch_has_at_most_one_file():
    seqs = pa.array([7, 3], pa.int64())
    assert arrival(pa.array([1, 1], pa.int64()), seqs, (1,)) is seqs


def test_path_order_stats_the_files_oldest_first_then_by_path_leaving_out_records_of_no_file(tmp_path):
    for name, mtime in (("b 1.json", 200), ("c.json", 100), ("a.json", 200)):
        (tmp_path / name).write_text("{}")
        os.utime(tmp_path / name, (mtime, mtime))
    uri = (tmp_path / "x").as_uri()[:-1]  # file:///.../ as input_file_name() gives it, URL-encoded
    paths = [uri + "a.json", uri + "b%201.json", "", uri + "c.json"]
    assert modification_ms(uri + "b%201.json") == 200_000
    assert path_order(paths) == (uri + "c.json", uri + "a.json", uri + "b%201.json")


def test_a_file_whose_time_cannot_be_read_sorts_by_path_after_the_others(tmp_path, caplog):
    (tmp_path / "z.json").write_text("{}")
    gone, known = (tmp_path / "gone.json").as_uri(), (tmp_path / "z.json").as_uri()
    assert path_order([gone, known]) == (known, gone)
    assert "cannot read the modification time of 1 input files" in caplog.text


def test_arrival_orders_paths_itself_when_given_no_order(tmp_path):
    """Under Spark Connect the records carry their file's path (sink.session.connect)."""
    old, new = tmp_path / "z-old.json", tmp_path / "a-new.json"
    for path, mtime in ((old, 100), (new, 200)):
        path.write_text("{}")
        os.utime(path, (mtime, mtime))
    files = pa.array([new.as_uri(), old.as_uri(), new.as_uri(), "", old.as_uri()])
    seqs = pa.array([0, 5, 1, 9, 3], pa.int64())
    assert arrival(files, seqs, None).to_pylist() == [3, 2, 4, 0, 1]


@pytest.mark.spark
def test_spark_xxhash64_agrees_with_spark(spark):
    path = "file:///tmp/landing/part%2000.json"
    assert spark.sql(f"SELECT xxhash64('{path}') AS h").first().h == spark_xxhash64(path)


def land(folder, name, records, mtime):
    """A JSON landing file with the given modification time (the file source orders by it)."""
    path = folder / name
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    os.utime(path, (mtime, mtime))


def run_stream(spark, landing, cfg, checkpoint, **options):
    reader = spark.readStream.schema("id string, dt string, ts long, op string, v string")
    for k, v in options.items():
        reader = reader.option(k, v)
    query = (reader.json(str(landing)).writeStream.foreachBatch(UpsertSink(cfg))
             .option("checkpointLocation", str(checkpoint)).trigger(availableNow=True).start())
    query.awaitTermination()
    query.stop()


@pytest.mark.spark
@pytest.mark.connect  # the query's foreachBatch runs in the Connect server's Python worker
@pytest.mark.parametrize("larger, files_per_trigger, tag_on", [
    ("older", None, "executors"), ("newer", None, "executors"), ("newer", None, "driver"),
    ("older", 1, "executors"), ("newer", 1, "executors"),
])
def test_a_tie_across_files_goes_to_the_newer_file_however_batched(spark, tmp_path, larger, files_per_trigger,
                                                                    tag_on):
    # Spark's scan reads the larger file first; the winner must not depend on that.
    landing = tmp_path / "landing"
    landing.mkdir()
    padding = [{"id": f"pad{i}", "dt": "2025-01-01", "ts": 1, "op": "u", "v": "p"} for i in range(200)]
    tie = {"id": "k", "dt": "2025-01-01", "ts": 5, "op": "u"}
    land(landing, "b-older.json", [{**tie, "v": "older"}] + (padding if larger == "older" else []), 1_700_000_000)
    land(landing, "a-newer.json", [{**tie, "v": "newer"}] + (padding if larger == "newer" else []), 1_700_000_100)
    cfg = SinkConfig(table_uri=str(tmp_path / "table"), key=["id"], partition_by=["dt"], ordering="ts",
                     delete_when="op = 'd'", writer_id="ties", index_dir=str(tmp_path / "index"), num_shards=2,
                     metrics_port=0, tag_on=tag_on)
    options = {"maxFilesPerTrigger": files_per_trigger} if files_per_trigger else {}
    run_stream(spark, landing, cfg, tmp_path / "checkpoint", **options)
    table = DeltaTable(cfg.table_uri).to_pyarrow_table().to_pylist()
    assert [r["v"] for r in table if r["id"] == "k"] == ["newer"]
    assert len(table) == 1 + len(padding)
