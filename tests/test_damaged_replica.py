"""A damaged replica (a truncated or overwritten file) is wiped and rebuilt; the batch goes on."""

import shutil
import threading

import pytest
from prometheus_client import REGISTRY

from sink import SinkConfig, UpsertSink
from sink.cli import main
from sink.index.lifecycle import ShardSource
from tests import damage
from tests.oracle import SCHEMA, expected_rows, random_batches, taken_back
from tests.test_foreach_batch import table_rows

pytestmark = pytest.mark.spark


@pytest.mark.parametrize("how", ["truncate", "flip_bytes"])
def test_a_damaged_replica_is_rebuilt_and_the_stream_stays_exact(spark, tmp_path, how):
    writer = f"damaged-{how}"
    # No memory tier: a lookup must reach the damaged file.
    cfg = SinkConfig(table_uri=str(tmp_path / "table"), key=["id"], partition_by=["dt"], ordering="ts",
                     delete_when="op = 'd'", writer_id=writer, index_dir=str(tmp_path / "index"), num_shards=1,
                     metrics_port=0, hot_cache_entries=0)
    batches = random_batches(4, batches=3, per_batch=3000, keys=6000, days=2, bad_share=0)
    sink = UpsertSink(cfg)
    sink(spark.createDataFrame(batches[0], SCHEMA), 0)
    # Closed, as at the end of a process: a replica kept open is flushed once a minute, and the
    # batch's entries must be in the files damaged next.
    sink.close()
    replica_dir = next((tmp_path / "index").glob("*/shard-0-of-1"))
    getattr(damage, how)(replica_dir)
    for b in (1, 2):
        sink(spark.createDataFrame(batches[b], SCHEMA), b)
        assert table_rows(cfg.table_uri) == expected_rows(batches[: b + 1]), f"after batch {b}"
    assert [r.replicas_repaired for r in sink.reports] == [0, 1, 0]
    assert sink.reports[1].replicas_rebuilt == 1
    assert REGISTRY.get_sample_value("upsert_sink_index_replicas_repaired_total", {"sink": writer}) == 1


def test_verify_and_inspect_report_a_damaged_replica_and_bootstrap_repairs_it(spark, tmp_path, capsys):
    cfg = SinkConfig(table_uri=str(tmp_path / "table"), key=["id"], partition_by=["dt"], ordering="ts",
                     writer_id="w", index_dir=str(tmp_path / "index"), num_shards=1, metrics_port=0,
                     tag_on="executors")  # a Python worker keeps the replica: taken back, as when the job ends
    batches = random_batches(5, batches=1, per_batch=3000, keys=6000, days=2, bad_share=0)
    UpsertSink(cfg)(spark.createDataFrame(batches[0], SCHEMA), 0)
    taken_back(cfg.index_dir)
    conf = tmp_path / "sink.toml"
    conf.write_text(f'[sink]\ntable_uri = "{cfg.table_uri}"\nkey = ["id"]\npartition_by = ["dt"]\nordering = "ts"\n'
                    f'writer_id = "w"\nindex_dir = "{cfg.index_dir}"\nnum_shards = 1\n')
    damage.truncate(next((tmp_path / "index").glob("*/shard-0-of-1")))
    capsys.readouterr()
    assert main(["verify", "--config", str(conf)]) == 2
    out = capsys.readouterr().out
    assert "shard 0 of 1: cannot be read: Corruption: Sst file size mismatch" in out and "ERROR: 1 replica" in out
    assert main(["inspect", "--config", str(conf)]) == 0
    assert "shard 0 of 1: cannot be read: Corruption" in capsys.readouterr().out
    assert main(["bootstrap", "--config", str(conf)]) == 0
    assert "was damaged (Corruption: Sst file size mismatch" in capsys.readouterr().err
    assert main(["verify", "--config", str(conf)]) == 0


def test_the_index_directory_removed_during_a_partition_load_costs_a_rebuild_not_the_batch(
        spark, tmp_path, monkeypatch):
    """Invariant 3: an operator deleting the index directory while a batch loads partitions
    into it failed the run (PartitionLoadError: IO error, No such file or directory)."""
    cfg = SinkConfig(table_uri=str(tmp_path / "table"), key=["id"], partition_by=["dt"], ordering="ts",
                     delete_when="op = 'd'", writer_id="lost", index_dir=str(tmp_path / "index"), num_shards=1,
                     metrics_port=0, tag_on="driver")
    batches = random_batches(6, batches=3, per_batch=2000, keys=4000, days=4, bad_share=0)
    first_days = sorted({e.dt for e in batches[0]})[:2]
    batches[0] = [e for e in batches[0] if e.dt in first_days]  # the next batch loads other partitions
    sink = UpsertSink(cfg)
    sink(spark.createDataFrame(batches[0], SCHEMA), 0)

    original, removed, lock = ShardSource.read, [], threading.Lock()

    def read_after_removing_the_index(source, pid):
        with lock:
            if not removed:
                removed.append(pid)
                shutil.rmtree(tmp_path / "index")
        return original(source, pid)

    monkeypatch.setattr(ShardSource, "read", read_after_removing_the_index)
    for b in (1, 2):
        sink(spark.createDataFrame(batches[b], SCHEMA), b)
        assert table_rows(cfg.table_uri) == expected_rows(batches[: b + 1]), f"after batch {b}"
    assert removed and [r.replicas_repaired for r in sink.reports] == [0, 1, 0]
    assert sink.reports[1].replicas_rebuilt == 1
    sink.close()
