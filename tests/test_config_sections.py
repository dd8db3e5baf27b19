"""SinkConfig's flat keys grouped into typed sections, and the task context built from them."""

import typing

import pyarrow as pa
import pytest

from sink.config import SinkConfig, sections
from sink.errors import ConfigError
from sink.lakehouse.commit.writes import REWRITE_MARKED_SHARE
from sink.tagging.task_context import task_context

BASE = dict(table_uri="/data/t", key=["store", "sku"], partition_by=["store"], ordering=["ts", "seq"],
            checkpoint_dir="/data/cp")


def test_each_section_holds_its_keys_typed():
    cfg = SinkConfig(**BASE, partition_date=None, hot_cache_entries=5, tombstone_ttl_hours=0.5, delete_when="op = 'd'")
    assert cfg.table == sections.TableSection("/data/t", ("store", "sku"), ("store",), ("ts", "seq"), "partitioned", ())
    assert cfg.table.tombstone_columns == ["store", "sku", "ts", "seq"]  # the key's partition column once
    assert (cfg.index.hot_cache_entries, cfg.index.block_cache_bytes) == (5, 64 << 20)
    assert cfg.side_tables == sections.SideTablesSection("/data/t_quarantine", "/data/t_tombstones", 1800,
                                                         "/data/t_index_changelog", 1000, "/data/t_index_snapshots")
    assert cfg.stream.incoming_wins_ties and cfg.stream.delete_when == "op = 'd'"
    assert cfg.commit == sections.CommitSection("auto", "auto", False, 10, None, "/data/cp", 0.5)
    assert cfg.runtime.tags_on_driver("local[2]") and not cfg.runtime.tags_on_driver("local-cluster[2,1,1024]")
    assert cfg.history == sections.HistorySection(1, None, None)


def test_the_modes_are_literal_types_whose_values_the_checks_accept():
    hints = typing.get_type_hints(sections.TableSection)
    assert typing.get_args(hints["scope"]) == sections.SCOPES == ("partitioned", "global")
    assert typing.get_args(typing.get_type_hints(sections.RuntimeSection)["tag_on"]) == ("auto", "executors", "driver")
    accepted = r"commit_mode = 'always' is not accepted; accepted values: \['auto', 'merge-on-read', 'merge'\]"
    with pytest.raises(ConfigError, match=accepted):
        SinkConfig(**BASE, commit_mode="always")


def test_the_rewrite_marked_share_option_defaults_to_what_the_commit_uses_without_it():
    assert SinkConfig(**BASE).commit.rewrite_marked_share == REWRITE_MARKED_SHARE


@pytest.mark.parametrize("share", [1.5, -0.1, "half", True, None])
def test_a_rewrite_marked_share_outside_zero_to_one_names_the_key_and_the_range(share):
    with pytest.raises(ConfigError, match=r"rewrite_marked_share must be a number from 0 \(rewrite every file a "
                                          r"batch changes\) to 1 \(mark rows in it unless every row goes\), got "):
        SinkConfig(**BASE, rewrite_marked_share=share)


def test_a_section_checks_its_keys_when_the_config_is_made_and_when_changed_after():
    cfg = SinkConfig(**BASE)
    cfg.peek_max_keys = -1  # a dataclass: a field can be set after the check
    with pytest.raises(ConfigError, match="peek_max_keys must be an integer from 0 to 1000000, got -1"):
        cfg.index  # noqa: B018


def test_the_task_context_takes_the_sections_whole():
    cfg = SinkConfig(**BASE, scd_type=2, ignore_null_updates=True, tombstone_ttl_hours=2)
    ctx = task_context(cfg, table_id="tid", table_version=3, writer_id="w", batch_id=4, num_shards=2,
                       output_schema=pa.schema([]), now=10.0)
    assert (ctx.table, ctx.stream, ctx.index) == (cfg.table, cfg.stream, cfg.index)
    assert (ctx.tombstone_uri, ctx.tombstone_ttl_seconds, ctx.history) == ("/data/t_tombstones", 7200, True)
    assert not ctx.ignore_null_updates  # a history table fills nulls when it rebuilds, not in the tasks


@pytest.mark.parametrize("every, uri, expected", [
    (0, None, None), (0, "s3://b/snaps", None),  # off: the tasks neither publish nor restore
    (10, None, "/data/t_index_snapshots"), (10, "s3://b/snaps", "s3://b/snaps")])
def test_the_tasks_get_the_snapshot_location_only_when_snapshots_are_on(every, uri, expected):
    cfg = SinkConfig(**BASE, replica_snapshot_every_versions=every, replica_snapshot_uri=uri)
    ctx = task_context(cfg, table_id="tid", table_version=3, writer_id="w", batch_id=4, num_shards=2,
                       output_schema=pa.schema([]), now=10.0)
    assert (ctx.snapshot_uri, ctx.index.replica_snapshot_every_versions) == (expected, every)


@pytest.mark.parametrize("every", [-1, 1.5, "10"])
def test_a_snapshot_interval_that_is_not_a_count_of_versions_names_the_key(every):
    with pytest.raises(ConfigError, match="replica_snapshot_every_versions must be an integer from 0 to 100000000"):
        SinkConfig(**BASE, replica_snapshot_every_versions=every)


def test_a_snapshot_interval_past_the_changelog_retention_is_refused_naming_both_keys():
    with pytest.raises(ConfigError, match=r"replica_snapshot_every_versions \(2000\) must be at most "
                                          r"changelog_retention_versions \(1000\)"):
        SinkConfig(**BASE, replica_snapshot_every_versions=2000)
    assert SinkConfig(**BASE, replica_snapshot_every_versions=2000,
                      changelog_retention_versions=2000).index.replica_snapshot_every_versions == 2000


@pytest.mark.parametrize("every", [1, 3])
def test_the_shards_of_an_unpartitioned_table_verify_in_turn(every):
    """Each shard's check there reads the whole table: one shard a checked batch, each in turn;
    on a partitioned table every shard checks every checked batch."""
    index = SinkConfig(**BASE, verify_fraction=0.25, verify_every_batches=every).index
    checked = [b for b in range(12 * every) if b % every == 0]
    for shards in (1, 3):
        turns = [[s for s in range(shards) if index.verifies(b, shard=s, num_shards=shards, whole_table=True)]
                 for b in checked]
        assert turns == [[(b // every) % shards] for b in checked]
        assert all(index.verifies(b, shard=s, num_shards=shards) == 0.25 for b in checked for s in range(shards))
    assert all(index.verifies(b, shard=s, num_shards=3, whole_table=w) == 0.0
               for b in range(12 * every) if b % every for s in range(3) for w in (True, False))
