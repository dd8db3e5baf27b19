import pytest

from sink.config import SinkConfig
from sink.errors import ConfigError

BASE = dict(table_uri="/data/t", key=["id"], ordering="ts", checkpoint_dir="/data/cp")


def test_defaults_follow_the_design():
    cfg = SinkConfig(**BASE)
    assert cfg.partition_by == []
    assert cfg.scope == "partitioned"
    assert cfg.tag_on == "auto"
    assert cfg.engine == "auto"
    assert cfg.bootstrap_days == 7
    assert cfg.partition_ttl_hours == 168
    assert cfg.metrics_port == 9466
    assert cfg.resolved_quarantine_uri == "/data/t_quarantine"
    assert cfg.resolved_tombstone_uri == "/data/t_tombstones"


@pytest.mark.parametrize(
    "override, words",
    [
        (dict(scope="table"), ["scope", "'table'", "partitioned", "global"]),
        (dict(engine="spark"), ["engine", "auto", "deltalake", "delta-spark"]),
        (dict(ties="newest"), ["ties", "incoming", "existing"]),
        (dict(tag_on="cluster"), ["tag_on", "auto", "executors", "driver"]),
        (dict(key=[]), ["key", "at least one"]),
        (dict(key=["id", "id"]), ["key", "twice"]),
        (dict(num_shards=0), ["num_shards", "1 to 4096"]),
        (dict(metrics_port=70000), ["metrics_port", "0 to 65535"]),
        (dict(bootstrap_days="7"), ["bootstrap_days", "integer"]),
        (dict(cross_partition_check=-1), ["cross_partition_check", "0 to 10000000"]),
        (dict(peek_max_keys=-1), ["peek_max_keys", "0 to 1000000"]),
        (dict(resident_keys=-1), ["resident_keys", "0 to 1000000000"]),
        (dict(peek_max_keys=True), ["peek_max_keys", "integer"]),
        (dict(file_cache_bytes=-1), ["file_cache_bytes", "0 to 1099511627776"]),
        (dict(probe_cache_bytes=-1), ["probe_cache_bytes", "0 to 1099511627776"]),
        (dict(partition_by=["id"]), ["key ['id'] names partition columns only", "tells its rows apart"]),
        (dict(ordering="id"), ["ordering", "id"]),
    ],
)
def test_bad_values_name_the_key_and_what_is_accepted(override, words):
    with pytest.raises(ConfigError) as err:
        SinkConfig(**{**BASE, **override})
    for word in words:
        assert word in str(err.value)


def test_a_key_may_include_partition_columns():
    """`key = ["store_id", "sku"]` with `partition_by = ["store_id"]`, as Delta's MERGE takes it."""
    cfg = SinkConfig(**{**BASE, "key": ["store_id", "sku"], "partition_by": ["store_id"]})
    assert cfg.identity_columns == ["store_id", "sku"]
    assert SinkConfig(**{**BASE, "key": ["store_id", "sku"], "partition_by": ["store_id"], "scope": "global"}
                      ).identity_columns == ["store_id", "sku"]


def test_writer_id_or_checkpoint_is_required():
    with pytest.raises(ConfigError, match="checkpoint_dir .* or writer_id"):
        SinkConfig(table_uri="/t", key=["id"], ordering="ts")


def test_writer_id_is_stable_and_changes_with_the_checkpoint():
    a = SinkConfig(**BASE).resolved_writer_id
    assert a == SinkConfig(**BASE).resolved_writer_id
    assert a != SinkConfig(**{**BASE, "checkpoint_dir": "/data/cp2"}).resolved_writer_id
    assert SinkConfig(**{**BASE, "writer_id": "mine"}).resolved_writer_id == "mine"


def test_from_file_resolves_paths_against_the_file(tmp_path):
    conf = tmp_path / "conf" / "sink.toml"
    conf.parent.mkdir()
    conf.write_text(
        '[sink]\ntable_uri = "../data/t"\nkey = "id"\nordering = "ts"\n'
        'checkpoint_dir = "../data/cp"\npartition_by = ["dt"]\ndelete_when = "op = \'d\'"\n'
    )
    cfg = SinkConfig.from_file(conf)
    assert cfg.table_uri == str(tmp_path / "data" / "t")
    assert cfg.checkpoint_dir == str(tmp_path / "data" / "cp")
    assert cfg.key == ["id"]
    assert cfg.delete_when == "op = 'd'"


def test_from_file_rejects_unknown_keys(tmp_path):
    conf = tmp_path / "sink.toml"
    conf.write_text('[sink]\ntable_uri = "t"\nkey = ["id"]\nordering = "ts"\nwriter_id = "w"\nshards = 4\n')
    with pytest.raises(ConfigError, match=r"unknown sink key\(s\) \['shards'\].*num_shards"):
        SinkConfig.from_file(conf)


def test_from_file_missing_required_and_missing_table(tmp_path):
    conf = tmp_path / "sink.toml"
    conf.write_text('[sink]\ntable_uri = "t"\n')
    with pytest.raises(ConfigError, match=r"\['key', 'ordering'\] are required"):
        SinkConfig.from_file(conf)
    conf.write_text('[source]\npath = "x"\n')
    with pytest.raises(ConfigError, match=r"no \[sink\] table"):
        SinkConfig.from_file(conf)
    with pytest.raises(ConfigError, match="not found"):
        SinkConfig.from_file(tmp_path / "nope.toml")


@pytest.mark.parametrize("master, one_process", [
    ("local", True), ("local[2]", True), ("local[*]", True), ("local[4, 2]", True),
    ("local-cluster[2,1,1024]", False), ("spark://host:7077", False), ("yarn", False), ("k8s://https://h:6443", False),
])
def test_auto_tags_on_the_driver_only_when_one_process_runs_everything(master, one_process):
    assert SinkConfig(**BASE).tags_on_driver(master) is one_process
    assert SinkConfig(**BASE, tag_on="executors").tags_on_driver(master) is False
    assert SinkConfig(**BASE, tag_on="driver").tags_on_driver(master) is True


def test_a_tombstone_row_stands_for_a_key_in_its_partition_or_for_each_delete_of_a_history():
    base = dict(table_uri="t", key=["id"], partition_by=["dt"], ordering="seq", writer_id="w")
    assert SinkConfig(**base).tombstone_key == ["dt", "id"]
    assert SinkConfig(**base, scope="global").tombstone_key == ["id"]
    assert SinkConfig(**base, scd_type=2).tombstone_key == ["dt", "id", "seq"]
    assert SinkConfig(**base, scd_type=2, scope="global").tombstone_key == ["id", "seq"]
