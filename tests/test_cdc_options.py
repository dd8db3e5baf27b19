"""CDC options, checked on the published examples they come from."""

import pyarrow as pa
import pytest
from deltalake import DeltaTable, QueryBuilder

from sink import SchemaError, SinkConfig, UpsertSink, cli
from sink.config.options import HIDDEN_ORDERING_PREFIX
from sink.errors import ConfigError, ContractMismatchError
from tests.engines import ENGINE_OPTIONS, UPDATES_COMMIT
from tests.examples import USER_CHANGES
from tests.oracle import verify_replicas

pytestmark = pytest.mark.spark

# Databricks' AUTO CDC (APPLY CHANGES) SCD type 1 example (tests.examples), stored without the
# operation column.
USERS = "userId INT, name STRING, city STRING, operation STRING, sequenceNum INT"
CHANGES = USER_CHANGES


def users_config(tmp_path, **extra):
    options = {"index_dir": str(tmp_path / "index"), **extra}
    return SinkConfig(table_uri=str(tmp_path / "users"), key=["userId"], ordering="sequenceNum",
                      delete_when="operation = 'DELETE'", writer_id="users", num_shards=2, metrics_port=0, **options)


@pytest.mark.parametrize("tag_on", ["driver", "executors"])
@pytest.mark.connect
def test_except_columns_route_records_but_are_not_stored(spark, tmp_path, tag_on):
    cfg = users_config(tmp_path, except_columns=["operation"], tag_on=tag_on)
    sink = UpsertSink(cfg)
    sink(spark.createDataFrame(CHANGES[:4], USERS), 0)
    sink(spark.createDataFrame(CHANGES[4:], USERS), 1)
    table = DeltaTable(cfg.table_uri)
    assert table.schema().to_arrow().names == ["userId", "name", "city", "sequenceNum"]
    # The published result (the example also drops sequenceNum; the sink keeps its ordering column).
    assert sorted(tuple(r.values()) for r in table.to_pyarrow_table().to_pylist()) == [
        (124, "Raul", "Oaxaca", 1), (125, "Mercedes", "Guadalajara", 6), (126, "Lily", "Cancun", 2)]


@pytest.mark.parametrize("tag_on, commit_mode, partial", [
    ("driver", "auto", False), ("executors", "auto", False), ("driver", "merge", False), ("executors", "merge", True),
    ("executors", "auto", True)])
def test_identical_redeliveries_write_no_file_and_count_as_unchanged(spark, tmp_path, tag_on, commit_mode, partial):
    cfg = users_config(tmp_path, except_columns=["operation"], tag_on=tag_on, commit_mode=commit_mode,
                       ignore_null_updates=partial)
    sink = UpsertSink(cfg)
    sink(spark.createDataFrame(CHANGES[:4], USERS), 0)
    before = DeltaTable(cfg.table_uri).to_pyarrow_table().sort_by("userId")
    again = CHANGES[:4]  # delivered again, same sequenceNum (ties = "incoming": the re-delivery wins the tie)
    if partial:
        again = [(u, None, city, op, seq) for u, _, city, op, seq in again]  # a null keeps the stored name
    sink(spark.createDataFrame(again, USERS), 1)
    report = sink.reports[-1]
    assert (report.ops["update"], report.ops["unchanged"]) == (0, 4)
    table = DeltaTable(cfg.table_uri)
    assert table.to_pyarrow_table().sort_by("userId").equals(before)
    # The batch is recorded (its app transaction) by a commit that adds and removes no file (no MERGE).
    assert table.transaction_version("users") == 1 and table.history(1)[0]["operation"] == "WRITE"
    previous = DeltaTable(cfg.table_uri, version=table.version() - 1)
    assert table.file_uris() == previous.file_uris()


def test_except_columns_must_be_in_the_stream_and_leave_key_and_partition_stored(spark, tmp_path):
    with pytest.raises(ConfigError, match=r"except_columns \['userId'\] are key or partition columns"):
        users_config(tmp_path, except_columns=["operation", "userId"])
    sink = UpsertSink(users_config(tmp_path, except_columns=["op"]))
    with pytest.raises(SchemaError, match=r"except_columns \['op'\] are not in the stream"):
        sink.validate(spark.createDataFrame(CHANGES, USERS))


def visible_rows(uri):
    return sorted(tuple(r.values()) for r in DeltaTable(uri).to_pyarrow_table().drop_columns(
        [HIDDEN_ORDERING_PREFIX + "sequenceNum"]).to_pylist())


@pytest.mark.parametrize("engine", ENGINE_OPTIONS)
@pytest.mark.parametrize("tag_on", ["driver", "executors"])
@pytest.mark.parametrize("split", [[8], [4, 4], [6, 2]], ids=["one-batch", "two-batches", "stale-after-restart"])
@pytest.mark.connect(split=[6, 2], engine="deltalake")
def test_the_published_type_1_example_excepting_its_sequence_column(spark, tmp_path, tag_on, split, engine):
    """`COLUMNS * EXCEPT (operation, sequenceNum)`: the table keeps the sequence as
    __ordering_sequenceNum, where a restarted sink's index loads it from (the last split's
    second batch is all stale: its updates are older than the stored row and the delete)."""
    options = dict(except_columns=["operation", "sequenceNum"], tag_on=tag_on, **ENGINE_OPTIONS[engine])
    cfg = users_config(tmp_path, **options)
    start = 0
    for b, size in enumerate(split):
        index = {"index_dir": str(tmp_path / f"index-{b}")}  # each batch a new sink on a new index
        sink = UpsertSink(users_config(tmp_path, **options, **index))
        sink(spark.createDataFrame(CHANGES[start:start + size], USERS), b)
        start += size
    table = DeltaTable(cfg.table_uri)
    assert table.schema().to_arrow().names == ["userId", "name", "city", "__ordering_sequenceNum"]
    assert visible_rows(cfg.table_uri) == [(124, "Raul", "Oaxaca"), (125, "Mercedes", "Guadalajara"),
                                           (126, "Lily", "Cancun")]
    if split == [6, 2]:
        assert (sink.reports[-1].ops["stale"], sink.reports[-1].ops["update"]) == (2, 0)
    verify_replicas(sink.config)  # the index agrees with the hidden column


def test_the_cli_reads_the_contract_and_the_index_of_an_excepted_sequence_column(spark, tmp_path, capsys):
    UpsertSink(users_config(tmp_path, except_columns=["operation", "sequenceNum"]))(
        spark.createDataFrame(CHANGES, USERS), 0)
    conf = tmp_path / "sink.toml"
    conf.write_text('[sink]\ntable_uri = "users"\nkey = ["userId"]\nordering = "sequenceNum"\n'
                    'except_columns = ["operation", "sequenceNum"]\ndelete_when = "operation = \'DELETE\'"\n'
                    'writer_id = "users"\nindex_dir = "index"\nnum_shards = 2\n')
    assert cli.main(["contract", "--config", str(conf)]) == 0
    assert "table and config agree: key ['userId'], partition_by [], ordering '__ordering_sequenceNum'" in \
        capsys.readouterr().out
    assert cli.main(["verify", "--config", str(conf)]) == 0
    assert "OK: every replica matches the table" in capsys.readouterr().out


def test_moving_the_sequence_column_into_except_columns_on_an_existing_table_is_refused(spark, tmp_path):
    UpsertSink(users_config(tmp_path, except_columns=["operation"]))(spark.createDataFrame(CHANGES[:4], USERS), 0)
    sink = UpsertSink(users_config(tmp_path, except_columns=["operation", "sequenceNum"]))
    with pytest.raises(SchemaError, match=r"except_columns \['sequenceNum'\] are columns .* stores"):
        sink(spark.createDataFrame(CHANGES[4:], USERS), 1)


def test_moving_the_sequence_column_out_of_except_columns_on_an_existing_table_is_refused(spark, tmp_path):
    hidden = users_config(tmp_path, except_columns=["operation", "sequenceNum"])
    UpsertSink(hidden)(spark.createDataFrame(CHANGES[:4], USERS), 0)
    sink = UpsertSink(users_config(tmp_path, except_columns=["operation"]))
    with pytest.raises(ContractMismatchError, match=r"keeps the ordering column\(s\) \[.sequenceNum.\] as "
                                                    r"\[.__ordering_sequenceNum.\]: except_columns named them"):
        sink(spark.createDataFrame(CHANGES[4:], USERS), 1)
    assert visible_rows(hidden.table_uri) == [(123, "Isabel", "Monterrey"), (124, "Raul", "Oaxaca"),
                                              (125, "Mercedes", "Tijuana"), (126, "Lily", "Cancun")]


def test_an_excepted_sequence_column_is_checked_and_quarantined_under_its_own_name(spark, tmp_path):
    sink = UpsertSink(users_config(tmp_path, except_columns=["operation", "sequenceNum"]))
    sink(spark.createDataFrame([(1, "a", "x", "INSERT", 1), (2, "b", "y", "INSERT", None)], USERS), 0)
    assert visible_rows(sink.config.table_uri) == [(1, "a", "x")]
    quarantined = DeltaTable(sink.config.resolved_quarantine_uri).to_pyarrow_table()
    assert HIDDEN_ORDERING_PREFIX + "sequenceNum" not in quarantined.column_names
    assert [(r["userId"], r["_quarantine_reason"]) for r in quarantined.to_pylist()] == [
        (2, "null ordering column sequenceNum")]
    clashing = spark.createDataFrame([(1, "a", "x", "INSERT", 1, 1)], USERS + ", __ordering_sequenceNum INT")
    with pytest.raises(SchemaError, match="the stream has a column '__ordering_sequenceNum', where the table keeps "
                                          "the ordering column 'sequenceNum'"):
        sink.validate(clashing)


def test_excepting_a_column_the_table_stores_is_refused(spark, tmp_path):
    UpsertSink(users_config(tmp_path))(spark.createDataFrame(CHANGES[:4], USERS), 0)
    sink = UpsertSink(users_config(tmp_path, except_columns=["operation"]))
    with pytest.raises(SchemaError, match=r"except_columns \['operation'\] are columns .* stores"):
        sink(spark.createDataFrame(CHANGES[4:], USERS), 1)


# Paimon's partial-update merge engine example: <1, 23.0, 10, NULL>, <1, NULL, NULL, 'This is a
# book'>, <1, 25.2, NULL, NULL> end as <1, 25.2, 10, 'This is a book'>; here sequenced by seq.
PARTIAL = "k INT, price DOUBLE, stock INT, title STRING, seq INT"
PARTIAL_RECORDS = [(1, 23.0, 10, None, 1), (1, None, None, "This is a book", 2), (1, 25.2, None, None, 3)]


def partial_config(tmp_path, **extra):
    options = {"ignore_null_updates": True, **extra}
    return SinkConfig(table_uri=str(tmp_path / "books"), key=["k"], ordering="seq", writer_id="books",
                      index_dir=str(tmp_path / "index"), num_shards=2, metrics_port=0, **options)


def rows_of(uri):
    """The table's rows as delta-rs' query engine reads them (deletion vectors applied)."""
    rows = QueryBuilder().register("t", DeltaTable(uri)).execute("SELECT * FROM t").read_all()
    return sorted(tuple(r.values()) for r in pa.table(rows).to_pylist())


@pytest.mark.parametrize("engine", ENGINE_OPTIONS)
@pytest.mark.parametrize("tag_on", ["driver", "executors"])
@pytest.mark.connect(engine="deltalake")
def test_ignore_null_updates_gives_paimons_partial_update_result_across_batches(spark, tmp_path, tag_on, engine):
    cfg = partial_config(tmp_path, tag_on=tag_on, **ENGINE_OPTIONS[engine])
    sink = UpsertSink(cfg)
    for batch_id, record in enumerate(PARTIAL_RECORDS):
        sink(spark.createDataFrame([record], PARTIAL), batch_id)
    assert rows_of(cfg.table_uri) == [(1, 25.2, 10, "This is a book", 3)]
    assert [r.mode for r in sink.reports] == ["append", UPDATES_COMMIT[engine], UPDATES_COMMIT[engine]]


def test_ignore_null_updates_folds_one_keys_records_in_one_batch(spark, tmp_path):
    cfg = partial_config(tmp_path)
    sink = UpsertSink(cfg)
    sink(spark.createDataFrame([(1, 1.0, 1, "stored", 0), (2, 2.0, 2, "two", 0)], PARTIAL), 0)
    # Key 1: the example's records on top of a stored row; key 2: deleted, then upserted with
    # nulls in the same batch, which keep nothing of the deleted row.
    schema = PARTIAL + ", op STRING"
    batch = [(*r, "u") for r in PARTIAL_RECORDS] + [(2, None, None, None, 1, "d"), (2, 5.0, None, None, 2, "u")]
    sink = UpsertSink(partial_config(tmp_path, delete_when="op = 'd'", except_columns=["op"]))
    sink(spark.createDataFrame(batch, schema), 1)
    assert rows_of(cfg.table_uri) == [(1, 25.2, 10, "This is a book", 3), (2, 5.0, None, None, 2)]
    assert sink.reports[-1].ops["update"] == 2 and sink.reports[-1].ops["superseded"] == 3


def test_ignore_null_updates_off_stores_the_nulls(spark, tmp_path):
    cfg = partial_config(tmp_path, ignore_null_updates=False)
    sink = UpsertSink(cfg)
    for batch_id, record in enumerate(PARTIAL_RECORDS):
        sink(spark.createDataFrame([record], PARTIAL), batch_id)
    assert rows_of(cfg.table_uri) == [(1, 25.2, None, None, 3)]


@pytest.mark.parametrize("engine", ENGINE_OPTIONS)
@pytest.mark.parametrize("tag_on", ["driver", "executors"])
def test_ignore_null_updates_keeps_stored_values_when_a_global_key_moves(spark, tmp_path, tag_on, engine):
    cfg = partial_config(tmp_path, scope="global", partition_by=["dt"], tag_on=tag_on, **ENGINE_OPTIONS[engine])
    schema = "k INT, dt STRING, price DOUBLE, title STRING, seq INT"
    sink = UpsertSink(cfg)
    sink(spark.createDataFrame([(1, "2026-11-01", 9.5, "kept", 1), (2, "2026-11-01", 1.0, "two", 1)], schema), 0)
    sink(spark.createDataFrame([(1, "2026-11-02", None, None, 2), (2, "2026-11-02", 3.0, None, 2)], schema), 1)
    assert rows_of(cfg.table_uri) == [(1, "2026-11-02", 9.5, "kept", 2), (2, "2026-11-02", 3.0, "two", 2)]
    # Executor tagging: the moved rows were filled by Spark tasks, and written by them (or by
    # Spark's MERGE from them), not by the driver.
    report = sink.reports[-1]
    assert (report.write_seconds > 0) == (report.write_tasks > 0) == (tag_on == "executors" and engine == "deltalake")
    assert 0 < report.write_busiest_share <= 1 if report.write_tasks else report.write_busiest_share == 0


def test_ignore_null_updates_must_be_a_boolean(tmp_path):
    with pytest.raises(ConfigError, match="ignore_null_updates must be true or false, got 'yes'"):
        partial_config(tmp_path, ignore_null_updates="yes")


# Several ordering columns, like AUTO CDC's SEQUENCE BY STRUCT(ts, seq): ts first, seq on a tie.
SEQUENCED = "userId INT, name STRING, city STRING, operation STRING, ts INT, seq INT"


def sequenced_config(tmp_path, index="index", **extra):
    options = {"ordering": ["ts", "seq"], **extra}
    return SinkConfig(table_uri=str(tmp_path / "users"), key=["userId"], delete_when="operation = 'DELETE'",
                      except_columns=["operation"], writer_id="users", index_dir=str(tmp_path / index), num_shards=2,
                      metrics_port=0, **options)


@pytest.mark.parametrize("tag_on, fresh_replica", [("driver", False), ("driver", True), ("executors", False)])
@pytest.mark.parametrize("scope", ["partitioned", "global"])
def test_several_ordering_columns_break_ties_on_the_first_with_the_next(spark, tmp_path, tag_on, fresh_replica,
                                                                         scope):
    sink = UpsertSink(sequenced_config(tmp_path, tag_on=tag_on, scope=scope))
    sink(spark.createDataFrame([(1, "Ana", "Lima", "INSERT", 10, 1), (2, "Bo", "Oslo", "INSERT", 10, 1)],
                               SEQUENCED), 0)
    # Ties on ts: seq decides, whatever the arrival order.
    sink(spark.createDataFrame([(1, "Ana", "Quito", "UPDATE", 10, 3), (1, "Ana", "Cusco", "UPDATE", 10, 2),
                                (2, None, None, "DELETE", 10, 2)], SEQUENCED), 1)
    if fresh_replica:  # entries and tombstones loaded from the tables compare the same way
        sink = UpsertSink(sequenced_config(tmp_path, index="other-index", tag_on=tag_on, scope=scope))
    sink(spark.createDataFrame([(2, "Bo", "Bergen", "UPDATE", 10, 1), (1, "Ana", "Cusco", "UPDATE", 10, 2),
                                (3, "Cy", "Rome", "INSERT", 9, 9)], SEQUENCED), 2)
    assert sink.reports[-1].ops["stale"] == 2 and sink.reports[-1].ops["insert"] == 1
    assert rows_of(str(tmp_path / "users")) == [(1, "Ana", "Quito", 10, 3), (3, "Cy", "Rome", 9, 9)]


def test_the_table_records_several_ordering_columns_and_refuses_another_ordering(spark, tmp_path):
    sink = UpsertSink(sequenced_config(tmp_path))
    sink(spark.createDataFrame([(1, "Ana", "Lima", "INSERT", 10, 1)], SEQUENCED), 0)
    assert DeltaTable(str(tmp_path / "users")).metadata().configuration["upsert_sink.ordering"] == '["ts", "seq"]'
    cfg = SinkConfig(table_uri=str(tmp_path / "users"), key=["userId"], ordering="ts", writer_id="users",
                     except_columns=["operation"], index_dir=str(tmp_path / "index"), num_shards=2, metrics_port=0)
    with pytest.raises(ContractMismatchError, match=r"ordering: \('ts', 'seq'\) vs 'ts'"):
        UpsertSink(cfg)(spark.createDataFrame([(1, "Ana", "Lima", "INSERT", 10, 2)], SEQUENCED), 1)


def test_several_ordering_columns_are_checked_like_one(tmp_path):
    with pytest.raises(ConfigError, match="ordering column 'userId' must not be a key or partition column"):
        sequenced_config(tmp_path, ordering=["ts", "userId"])
    with pytest.raises(ConfigError, match=r"ordering lists a column twice: \['ts', 'ts'\]"):
        sequenced_config(tmp_path, ordering=["ts", "ts"])


# unchanged_value: Debezium's placeholder for a PostgreSQL TOAST value an update left alone.
UNAVAILABLE = "__debezium_unavailable_value"
TOASTED = "k INT, price DOUBLE, title STRING, note STRING, seq INT"


def toasted_config(tmp_path, **extra):
    options = {"unchanged_value": UNAVAILABLE, **extra}
    return SinkConfig(table_uri=str(tmp_path / "docs"), key=["k"], ordering="seq", writer_id="docs",
                      index_dir=str(tmp_path / "index"), num_shards=2, metrics_port=0, **options)


@pytest.mark.parametrize("tag_on, options, updates", [
    ("driver", {}, "rewrite"), ("executors", {}, "rewrite"),
    ("driver", {"commit_mode": "merge-on-read"}, "merge-on-read"),
    ("executors", {"commit_mode": "merge-on-read"}, "merge-on-read"),
    ("executors", {"commit_mode": "merge"}, "merge"), ("driver", ENGINE_OPTIONS["delta-spark"], "merge")])
def test_unchanged_values_keep_the_stored_value_and_the_rest_of_the_update_applies(spark, tmp_path, tag_on, options,
                                                                                   updates):
    cfg = toasted_config(tmp_path, tag_on=tag_on, **options)
    sink = UpsertSink(cfg)
    sink(spark.createDataFrame([(1, 9.5, "long text 1", "n1", 1), (2, 1.0, "long text 2", "n2", 1),
                                (3, 3.0, "t3", "n3", 1)], TOASTED), 0)
    # Key 1: the title unchanged, the note set to null (a null is a value here); key 2: two
    # updates in one batch, both leaving the title alone.
    sink(spark.createDataFrame([(1, 10.0, UNAVAILABLE, None, 2), (2, 2.0, UNAVAILABLE, UNAVAILABLE, 2),
                                (2, 2.5, UNAVAILABLE, "n2b", 3)], TOASTED), 1)
    sink(spark.createDataFrame([(3, 4.0, UNAVAILABLE, "n3c", 2)], TOASTED), 2)
    assert rows_of(cfg.table_uri) == [(1, 10.0, "long text 1", None, 2), (2, 2.5, "long text 2", "n2b", 3),
                                      (3, 4.0, "t3", "n3c", 2)]
    assert [r.mode for r in sink.reports] == ["append", updates, updates]
    assert [r.ops["update"] for r in sink.reports] == [0, 2, 1]


@pytest.mark.parametrize("tag_on", ["driver", "executors"])
def test_unchanged_values_stay_when_a_global_key_moves(spark, tmp_path, tag_on):
    cfg = toasted_config(tmp_path, scope="global", partition_by=["dt"], tag_on=tag_on)
    schema = "k INT, dt STRING, title STRING, seq INT"
    sink = UpsertSink(cfg)
    sink(spark.createDataFrame([(1, "2026-11-01", "kept", 1), (2, "2026-11-01", "two", 1)], schema), 0)
    sink(spark.createDataFrame([(1, "2026-11-02", UNAVAILABLE, 2), (2, "2026-11-02", None, 2)], schema), 1)
    assert rows_of(cfg.table_uri) == [(1, "2026-11-02", "kept", 2), (2, "2026-11-02", None, 2)]


@pytest.mark.parametrize("tag_on", ["driver", "executors"])
def test_an_unchanged_value_for_a_key_the_table_lacks_is_set_aside_and_the_rest_applied(spark, tmp_path, tag_on):
    """unsent_values = "quarantine", the default: the record goes to quarantine naming key and
    column, its shard's other records are written, and the metrics count it once."""
    cfg = toasted_config(tmp_path, tag_on=tag_on)
    sink = UpsertSink(cfg)
    sink(spark.createDataFrame([(1, 9.5, "long text 1", "n1", 1)], TOASTED), 0)
    sink(spark.createDataFrame([(1, 10.0, UNAVAILABLE, "n1b", 2), (9, 1.0, UNAVAILABLE, "n9", 1),
                                (5, 2.0, "long text 5", "n5", 1)], TOASTED), 1)
    assert rows_of(cfg.table_uri) == [(1, 10.0, "long text 1", "n1b", 2), (5, 2.0, "long text 5", "n5", 1)]
    quarantined = DeltaTable(sink.config.resolved_quarantine_uri).to_pyarrow_table().to_pylist()
    assert [(r["k"], r["_quarantine_reason"]) for r in quarantined] == [
        (9, f"unsent value: column 'title' holds unchanged_value '{UNAVAILABLE}' (the source did not send it), and "
            "no stored row of key {'k': 9} is there to keep it from (the key is new to the table, or deleted earlier "
            "in the batch)")]
    report = sink.reports[-1]
    assert (report.records_in, report.ops["quarantined"], report.ops["insert"], report.ops["update"]) == (3, 1, 1, 1)
    assert report.hits + report.misses == 2  # the set-aside record's lookup is not counted


@pytest.mark.parametrize("tag_on", ["driver", "executors"])
def test_an_unchanged_value_for_a_key_the_table_lacks_fails_the_batch_and_writes_nothing(spark, tmp_path, tag_on):
    cfg = toasted_config(tmp_path, tag_on=tag_on, unsent_values="fail")
    sink = UpsertSink(cfg)
    sink(spark.createDataFrame([(1, 9.5, "long text 1", "n1", 1)], TOASTED), 0)
    before = DeltaTable(cfg.table_uri).version()
    with pytest.raises(Exception, match="column 'title' of the record for key {'k': 9} holds unchanged_value "
                                        f"'{UNAVAILABLE}'"):
        sink(spark.createDataFrame([(1, 10.0, UNAVAILABLE, "n1b", 2), (9, 1.0, UNAVAILABLE, "n9", 1)], TOASTED), 1)
    assert DeltaTable(cfg.table_uri).version() == before
    assert rows_of(cfg.table_uri) == [(1, 9.5, "long text 1", "n1", 1)]


@pytest.mark.parametrize("options, message", [
    ({"unchanged_value": ""}, "unchanged_value must be a non-empty string, got ''"),
    ({"unchanged_value": 5}, "unchanged_value must be a non-empty string, got 5"),
    ({"scd_type": 2}, "unchanged_value applies to scd_type = 1")])
def test_unchanged_value_config_errors(tmp_path, options, message):
    with pytest.raises(ConfigError, match=message):
        toasted_config(tmp_path, **options)
