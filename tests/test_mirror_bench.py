"""The mirror benchmark's batches have the shape it claims, and its oracle is independent of
the sink: a hand-applied replay of the same records agrees with it."""

import numpy as np
import pyarrow.compute as pc
import pyarrow.parquet as pq

from bench import mirror_bench


def test_batches_are_updates_anywhere_inserts_and_deletes_in_the_stated_shares(tmp_path):
    mirror_bench.write_batches(tmp_path, table_rows=10_000, batches=3, batch_rows=2_000)
    seen_deleted: set[str] = set()
    for path in sorted(tmp_path.glob("*.parquet")):
        batch = pq.read_table(path).to_pylist()
        ops = [r["op"] for r in batch]
        updates = [r for r in batch if r["op"] == "u"]
        assert ops.count("c") == 400 and ops.count("d") == 100
        assert len(updates) == 1_500 + 30  # 75%, and the second record of each repeated key (2%)
        ids = [r["id"] for r in batch]
        assert not seen_deleted & set(ids)  # a deleted key never comes back
        seen_deleted |= {r["id"] for r in batch if r["op"] == "d"}
        stored = [int(r["id"].removeprefix("user-")) for r in updates]
        # Uniform over the stored keys: each tenth of the key space gets its share.
        counts = np.bincount(np.array([k for k in stored if k < 10_000]) // 1_000, minlength=10)
        assert counts.min() > 0.6 * counts.mean()


def test_the_oracle_is_the_newest_record_per_key_without_deleted_keys(tmp_path):
    mirror_bench.write_batches(tmp_path, table_rows=1_000, batches=2, batch_rows=200)
    expected = {r["id"]: r for r in mirror_bench._stored(np.arange(1_000)).to_pylist()}
    for path in sorted(tmp_path.glob("*.parquet")):
        for r in sorted(pq.read_table(path).to_pylist(), key=lambda r: r["event_time"]):
            if r["id"] not in expected or r["event_time"] > expected[r["id"]]["event_time"]:
                expected[r["id"]] = r
    kept = sorted((r for r in expected.values() if r["op"] != "d"), key=lambda r: r["id"])
    oracle = mirror_bench.oracle(1_000, tmp_path)
    assert oracle.to_pylist() == kept
    assert pc.count_distinct(oracle.column("id")).as_py() == oracle.num_rows
