import datetime as dt

import pyarrow as pa
import pytest
from pyspark.sql import functions as F

from sink import columns as C
from sink import keys
from sink.config import SinkConfig
from sink.routing import prepare

NON_ASCII = ["ü", "日本語キー", "emoji-🙂", "a b\tc", ""]


def test_single_key_encodes_as_its_string():
    t = pa.table({"id": ["a", "ü"]})
    assert keys.encode_keys(t, ["id"]).to_pylist() == ["a", "ü"]


def test_multi_column_keys_are_length_prefixed_so_they_cannot_collide():
    t = pa.table({"a": ["x:1", "x"], "b": ["y", "1:y"]})
    encoded = keys.encode_keys(t, ["a", "b"]).to_pylist()
    assert encoded == ["3:x:11:y", "1:x3:1:y"]
    assert len(set(encoded)) == 2


def test_an_encoded_key_reads_back_as_its_columns_values():
    table = pa.table({"tenant": ["a:1", "é", "x"], "order": [7, 12, None]})
    encoded = [k.encode() for k in keys.encode_keys(table, ["tenant", "order"]).to_pylist() if k is not None]
    assert [keys.decode_key(k, ["tenant", "order"]) for k in encoded] == [{"tenant": "a:1", "order": "7"},
                                                                            {"tenant": "é", "order": "12"}]
    assert keys.describe_key(encoded[0], ["tenant", "order"]) == "tenant='a:1', order='7'"
    assert keys.describe_key(b"k1", ["id"]) == "id='k1'"
    assert keys.describe_key(b"\xff", ["id"]) == "b'\\xff'"  # not of this key spec: as bytes


def test_partition_id_round_trips_and_escapes():
    pid = keys.partition_id(["dt", "region"], ["2025-01-01", "eu/west=1"])
    assert pid == "dt=2025-01-01/region=eu%2Fwest%3D1"
    assert keys.partition_values(pid) == {"dt": "2025-01-01", "region": "eu/west=1"}
    assert keys.partition_id([], []) == keys.UNPARTITIONED
    assert keys.partition_values(keys.UNPARTITIONED) == {}


def test_partition_ids_per_row():
    t = pa.table({"d": pa.array([dt.date(2025, 1, 2), dt.date(2025, 1, 1), dt.date(2025, 1, 2)]),
                  "n": pa.array([1, 2, 1], pa.int32())})
    assert keys.partition_ids(t, ["d", "n"]).to_pylist() == ["d=2025-01-02/n=1", "d=2025-01-01/n=2",
                                                               "d=2025-01-02/n=1"]


def test_partition_values_are_set_from_ids_typed_and_the_null_partition_gives_nulls():
    cols = ["d", "n", "s"]
    rows = pa.table({"d": pa.array([None, None], pa.date32()), "n": pa.array([None, 7], pa.int32()),
                     "s": pa.array(["x", "y"]), "v": [1, 2]})
    null = keys.null_partition_id(cols)
    assert null == "d=/n=/s="
    placed = keys.with_partition_values(rows, pa.array([keys.partition_id(cols, ["2025-07-01", "3", "a/b"]), null]),
                                        cols)
    assert placed.to_pylist() == [{"d": dt.date(2025, 7, 1), "n": 3, "s": "a/b", "v": 1},
                                  {"d": None, "n": None, "s": None, "v": 2}]
    assert placed.schema == rows.schema


def test_ordering_values_are_comparable_int64():
    ts = pa.array([dt.datetime(1970, 1, 1, 0, 0, 1)], pa.timestamp("ms", tz="UTC"))
    assert keys.ordering_values(ts).to_pylist() == [1_000_000]
    assert keys.ordering_values(pa.array([dt.date(1970, 1, 11)])).to_pylist() == [10]
    assert keys.ordering_values(pa.array([7], pa.int16())).to_pylist() == [7]


def test_shard_of_is_python_modulo_of_signed_xxh64():
    # pmod semantics: never negative, below n.
    assert all(0 <= keys.shard_of(f"k{i}".encode(), 7) < 7 for i in range(200))


@pytest.mark.spark
def test_spark_routing_equals_the_python_shard_function(spark):
    ids = [f"key-{i}" for i in range(1500)] + NON_ASCII + ["x" * 300]
    rows = [(k, i % 5, dt.date(2025, 1, 1 + i % 3), i % 2 == 0, -(2**40) * i, i % 7 - 3, 1) for i, k in enumerate(ids)]
    df = spark.createDataFrame(rows, "id string, n int, d date, b boolean, l long, t tinyint, ts long")
    single = SinkConfig(table_uri="/t", key=["id"], ordering="ts", writer_id="w")
    multi = SinkConfig(table_uri="/t", key=["id", "n", "d"], ordering="ts", writer_id="w")
    other_types = SinkConfig(table_uri="/t", key=["b", "l", "t"], ordering="ts", writer_id="w")
    for cfg in (single, multi, other_types):
        out = prepare(df, cfg, 13).select("id", "n", "d", "b", "l", "t", C.KEY, C.SHARD,
                                          F.xxhash64(C.KEY).alias("h")).toArrow()
        python_keys = keys.encode_keys(out, cfg.key)
        assert python_keys.to_pylist() == out.column(C.KEY).to_pylist()
        assert keys.shards_of(python_keys, 13).to_pylist() == out.column(C.SHARD).to_pylist()
        # The sample holds keys whose hash is negative: pmod must still agree.
        assert sum(h < 0 for h in out.column("h").to_pylist()) > 100


@pytest.mark.spark
def test_the_python_murmur3_is_sparks_hash_of_a_bigint(spark):
    values = [0, 1, -1, 7, 2**31, -(2**31) - 1, 2**63 - 1, -(2**63), *range(2, 300)]
    got = spark.createDataFrame([(v,) for v in values], "v long").selectExpr("hash(v) AS h").toArrow()
    assert [keys.spark_hash_long(v) for v in values] == got.column("h").to_pylist()


@pytest.mark.spark
@pytest.mark.parametrize("num_shards", [1, 2, 3, 4, 13, 200])
def test_each_shard_lands_in_its_own_spark_partition(spark, num_shards):
    """Routed by `spark_route_expr`, shard s is exactly Spark partition s: one shard per
    tagging task, none left idle (repartitioning by the shard itself put both of 2 shards in
    one task)."""
    df = spark.range(num_shards * 50).selectExpr(f"pmod(id, {num_shards}) AS {C.SHARD}")
    routed = df.repartition(num_shards, F.expr(keys.spark_route_expr(num_shards)))
    placed = routed.select(C.SHARD, F.spark_partition_id().alias("p")).distinct().toArrow().to_pylist()
    assert sorted((r[C.SHARD], r["p"]) for r in placed) == [(s, s) for s in range(num_shards)]


@pytest.mark.spark
@pytest.mark.parametrize("tasks", [1, 2, 3, 8])
def test_writes_that_change_stored_rows_meet_in_their_partitions_task_new_keys_spread(spark, tasks):
    """Routed by `spark_write_route_expr`: a partition's updates and deletes all in one task (a
    file's changes must meet there), its new keys over that task and the next (INSERT_SPLIT 2)."""
    rows = [(f"2026-01-{d:02d}", f"k{i}", "insert" if i % 3 else "update") for d in range(1, 21) for i in range(60)]
    df = spark.createDataFrame(rows, f"dt string, {C.KEY} string, {C.WRITE} string")
    route = keys.spark_write_route_expr(["dt"], f"{C.WRITE} = 'insert'", tasks, 2)
    placed = df.repartition(tasks, F.expr(route)).select("dt", C.WRITE, F.spark_partition_id().alias("p"))
    by_partition: dict[tuple[str, str], set[int]] = {}
    for r in placed.toArrow().to_pylist():
        by_partition.setdefault((r["dt"], r[C.WRITE]), set()).add(r["p"])
    for d in range(1, 21):
        dt = f"2026-01-{d:02d}"
        (changing,) = by_partition[(dt, "update")]
        assert by_partition[(dt, "insert")] == {changing, (changing + 1) % tasks}
