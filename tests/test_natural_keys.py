"""A natural key that includes a partition column (`key = ["dt", "id"]`, `partition_by =
["dt"]`): the way most users write keys, and what Delta's MERGE takes. It names the same rows
as the key without its partition columns in partitioned scope, and a key that cannot move
partitions in global scope: the table holds what the oracle of (dt, id) keys says."""

import pytest

from sink import SinkConfig, UpsertSink
from tests.oracle import SCHEMA, expected_history, expected_rows, random_batches, verify_replicas
from tests.scaleout_stream import history_rows
from tests.test_foreach_batch import table_rows

pytestmark = pytest.mark.spark


def natural(tmp_path, index="index", **extra):
    return SinkConfig(table_uri=str(tmp_path / "table"), key=["dt", "id"], partition_by=["dt"], ordering="ts",
                      delete_when="op = 'd'", writer_id="natural", index_dir=str(tmp_path / index), num_shards=2,
                      metrics_port=0, **extra)


@pytest.mark.parametrize("tag_on", ["driver", "executors"])
@pytest.mark.parametrize("scope", ["partitioned", "global"])
def test_a_key_with_its_partition_column_streams_exactly_with_a_replay_and_a_lost_replica(
        spark, tmp_path, scope, tag_on):
    batches = random_batches(11, batches=4, per_batch=400)
    sink = UpsertSink(natural(tmp_path, scope=scope, tag_on=tag_on))
    for b, events in enumerate(batches):
        if b == 3:  # the replica lost: a new sink on an empty index
            sink = UpsertSink(natural(tmp_path, index="index-2", scope=scope, tag_on=tag_on))
        sink(spark.createDataFrame(events, SCHEMA), b)
        if b == 1:
            sink(spark.createDataFrame(events, SCHEMA), b)  # replayed: skipped
            assert sink.reports[-1].mode == "skipped"
        assert table_rows(sink.config.table_uri) == expected_rows(batches[: b + 1]), f"after batch {b}"
        # A key names one partition: no batch warns of keys in several partitions.
        assert sink.reports[-1].keys_in_several_partitions == 0
    verify_replicas(sink.config)


def test_a_history_table_keyed_with_its_partition_column(spark, tmp_path):
    batches = random_batches(12, batches=3, per_batch=300)
    sink = UpsertSink(natural(tmp_path, scd_type=2))
    for b, events in enumerate(batches):
        sink(spark.createDataFrame(events, SCHEMA), b)
        assert history_rows(sink.config.table_uri) == expected_history(batches[: b + 1]), f"after batch {b}"
