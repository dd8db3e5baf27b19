"""A streaming query whose foreachBatch is the sink, as Spark Connect runs it: the function
pickled to the server and run in its Python worker, which serves metrics_port. Marked
`connect`: the same test runs under the classic session (the driver runs the batches)."""

import json
import urllib.request

import pytest
from deltalake import DeltaTable

from sink import SinkConfig, UpsertSink
from tests.ops.test_metrics import free_port
from tests.oracle import SCHEMA, expected_rows, random_batches

pytestmark = [pytest.mark.spark, pytest.mark.connect]


def scrape(port: int) -> set[str]:
    return set(urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode().splitlines())


@pytest.mark.parametrize("tag_on", ["driver", "executors"])
def test_the_process_running_the_batches_serves_their_metrics(spark, tmp_path, tag_on):
    landing = tmp_path / "landing"
    landing.mkdir()
    batches = random_batches(21, batches=1, per_batch=200, bad_share=0)
    (landing / "f0.json").write_text("".join(json.dumps(e._asdict()) + "\n" for e in batches[0]))
    port = free_port()
    cfg = SinkConfig(table_uri=str(tmp_path / "table"), key=["id"], partition_by=["dt"], ordering="ts",
                     delete_when="op = 'd'", writer_id=f"served-{tag_on}", index_dir=str(tmp_path / "index"),
                     num_shards=2, metrics_port=port, tag_on=tag_on)
    query = (spark.readStream.schema(SCHEMA).json(str(landing)).writeStream.foreachBatch(UpsertSink(cfg))
             .option("checkpointLocation", str(tmp_path / "checkpoint")).trigger(processingTime="1 second").start())
    try:
        query.processAllAvailable()
        lines = scrape(port)  # while the query runs: under Connect its worker is the server
    finally:
        query.stop()
    expected = expected_rows(batches)
    table = sorted(DeltaTable(cfg.table_uri).to_pyarrow_table().to_pylist(), key=lambda r: (r["dt"], r["id"]))
    assert table == expected
    assert f'upsert_sink_records_total{{op="insert",sink="served-{tag_on}"}} {float(len(expected))}' in lines
    assert f'upsert_sink_commits_total{{mode="append",sink="served-{tag_on}"}} 1.0' in lines
    assert f'upsert_sink_table_version{{sink="served-{tag_on}"}} 1.0' in lines
