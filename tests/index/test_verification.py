"""The sampled verification (sink.index.verification, verify_fraction): a replica's entries
against what a load from the tables would hold, before a batch is tagged against them."""

from pathlib import Path

import pyarrow as pa
import pytest
from deltalake import DeltaTable

from sink import SinkConfig, UpsertSink
from sink.index import verification
from sink.index.entry import Entry
from sink.index.registry import kept_open
from sink.index.replica import ShardReplica
from sink.ops import metrics
from tests.oracle import SCHEMA, Event, expected_rows, taken_back


def test_a_sample_takes_a_share_of_each_chosen_partitions_keys_and_at_most_a_few_partitions():
    pids = pa.array([f"p{i % 6}" for i in range(1200)])
    keys = pa.array([f"k{i % 600}".encode() for i in range(1200)])  # each key twice: distinct keys count
    chosen = verification.sample(pids, keys, among={f"p{i}" for i in range(5)}, fraction=0.1, seed=3)
    assert len(chosen) == verification.MAX_PARTITIONS and "p5" not in chosen
    assert all(len(ks) == 10 and len(set(ks)) == 10 for ks in chosen.values())
    assert len({tuple(verification.sample(pids, keys, {f"p{i}" for i in range(5)}, 0.1, seed=s))
                for s in range(20)}) > 1  # other batches, other partitions
    assert all(int(k[1:]) % 6 == int(pid[1:]) for pid, ks in chosen.items() for k in ks)
    assert verification.sample(pids, keys, {f"p{i}" for i in range(5)}, 0.1, seed=3) == chosen  # a re-run: same
    one = verification.sample(pa.array(["p0"]), pa.array([b"k"]), {"p0"}, 0.001, seed=1)
    assert one == {"p0": [b"k"]}
    assert verification.sample(pids, keys, among=set(), fraction=1.0, seed=1) == {}


def test_a_check_reports_each_disagreement_by_the_key_columns_values():
    held = {b"a": Entry(5).pack(), b"b": Entry(7, True, 100).pack(), b"c": Entry(9).pack(), b"d": None}
    table = {b"a": Entry(5).pack(), b"b": Entry(7, True, 100).pack(), b"c": Entry(8).pack(), b"d": Entry(1).pack()}
    found = verification.check({"dt=1": [b"a", b"b", b"c", b"d"]}, lambda pid, ks: [held[k] for k in ks],
                               lambda pid, ks: {k.as_py(): table[k.as_py()] for k in ks}, None,
                               lambda k: f"id={k.decode()!r}")
    assert (found.keys, found.mismatches, found.drifted) == (4, 2, ["dt=1"])
    assert found.examples == ["partition dt=1, key id='c': the index says live at ordering 9, the table live at "
                              "ordering 8", "partition dt=1, key id='d': the index says absent, the table live at "
                              "ordering 1"]


def test_a_delete_older_than_the_ttl_counts_as_absent_on_both_sides():
    assert verification.state(Entry(7, True, 100).pack(), expire_before=200) is None
    assert verification.state(Entry(7, True, 300).pack(), expire_before=200) == ((7,), True)
    assert verification.state(Entry(7).pack(), expire_before=200) == ((7,), False)


@pytest.mark.spark
@pytest.mark.parametrize("tag_on", ["driver", "executors"])
def test_an_index_entry_overwritten_between_batches_is_reported_within_the_next_batch_and_reloaded(
        spark, tmp_path, tag_on, caplog):
    cfg = SinkConfig(table_uri=str(tmp_path / "t"), key=["id"], partition_by=["dt"], ordering="ts",
                     delete_when="op = 'd'", writer_id=f"w-{tag_on}", index_dir=str(tmp_path / "index"),
                     num_shards=1, metrics_port=0, tag_on=tag_on, verify_fraction=1.0)
    first = [Event(f"k{i}", "2025-01-01", 10, "u", "first") for i in range(20)]
    touch = [Event("k0", "2025-01-01", 11, "u", "touch")]
    sink = UpsertSink(cfg)
    sink(spark.createDataFrame(first, SCHEMA), 0)
    assert (sink.reports[-1].verified_keys, sink.reports[-1].verify_mismatches) == (0, 0)  # all loaded fresh
    sink(spark.createDataFrame(touch, SCHEMA), 1)  # the first batch's entries are promoted by now
    assert (sink.reports[-1].verified_keys, sink.reports[-1].verify_mismatches) == (1, 0)
    # k3's entry claims a newer row than the table has: an update older than that would be stale.
    overwrite_entry(Path(cfg.index_dir), DeltaTable(cfg.table_uri).metadata().id, "dt=2025-01-01", b"k3",
                    Entry(99))
    mismatches = metrics.VERIFY_MISMATCHES.labels(cfg.writer_id)._value.get()
    second = [Event("k3", "2025-01-01", 20, "u", "second"), Event("k4", "2025-01-01", 20, "u", "second")]
    sink(spark.createDataFrame(second, SCHEMA), 2)
    report = sink.reports[-1]
    assert (report.verified_keys, report.verify_mismatches) == (2, 1)
    assert report.verify_examples == ["partition dt=2025-01-01, key id='k3': the index says live at ordering 99, "
                                      "the table live at ordering 10"]
    assert metrics.VERIFY_MISMATCHES.labels(cfg.writer_id)._value.get() == mismatches + 1
    assert any(r.levelname == "ERROR" and "disagreed with the table on 1 of 2" in r.getMessage()
               for r in caplog.records)
    # Reloaded before tagging: the batch was written as the table says.
    assert sorted(DeltaTable(cfg.table_uri).to_pyarrow_table().to_pylist(), key=lambda r: r["id"]) == \
        expected_rows([first, touch, second])
    assert report.ops["update"] == 2 and report.partition_loads["invalidated"] == 1
    sink.close()


def overwrite_entry(index_dir: Path, table_id: str, pid: str, key: bytes, entry: Entry) -> None:
    """Write one entry into the replica that holds `key`, wherever it is kept open."""
    taken_back(index_dir)
    for path in sorted((index_dir / table_id).glob("shard-*")):
        replica = kept_open(path)
        if replica is not None:
            replica.put_entries(pid, {key: entry})
            continue
        view = ShardReplica.open_read_only(path)
        spec = view.spec
        view.close()
        with ShardReplica.open(path, spec) as replica:
            replica.put_entries(pid, {key: entry})
