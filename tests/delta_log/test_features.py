"""Tables with a feature a hand-written file would break commit their updates through MERGE:
the fallback happens, is logged once, and the table stays exact."""

import json
import logging
import re

import pyarrow as pa
import pytest
from deltalake import DeltaTable, Field, QueryBuilder, Schema

from sink.delta_log.features import check_constraints, mentions, merge_only_reason, row_checks
from sink.errors import UnsupportedTableError
from sink.lakehouse.engines.delta_rs import WRITE_COLUMN, DeltaTarget
from tests.lakehouse.spark_sql_tables import spark_table

COLUMNS = [("id", "string", pa.string()), ("dt", "string", pa.string()), ("ts", "long", pa.int64()),
           ("g", "long", pa.int64())]
ARROW = pa.schema([(name, t) for name, _, t in COLUMNS])


def create(uri, configuration=None, g_metadata=None):
    fields = [Field(name, t, metadata=g_metadata if name == "g" and g_metadata else None) for name, t, _ in COLUMNS]
    DeltaTable.create(uri, Schema(fields), partition_by=["dt"], configuration=configuration)


def add_constraint(uri):
    create(uri)
    DeltaTable(uri).alter.add_constraint({"ts_positive": "ts >= 0"})


FEATURES = {
    "deletion vectors": lambda uri: create(uri, {"delta.enableDeletionVectors": "true"}),
    "column mapping": lambda uri: create(uri, {"delta.columnMapping.mode": "name"}),
    "change data feed": lambda uri: create(uri, {"delta.enableChangeDataFeed": "true"}),
    "CHECK constraints": add_constraint,
    "column invariants": lambda uri: create(uri, g_metadata={
        "delta.invariants": json.dumps({"expression": {"expression": "g >= 0"}})}),
    "generated columns": lambda uri: create(uri, g_metadata={"delta.generationExpression": "ts * 2"}),
}


def rows(*records):
    cols = list(zip(*records))
    return pa.table({"id": pa.array(cols[0], pa.string()), "dt": pa.array(cols[1], pa.string()),
                     "ts": pa.array(cols[2], pa.int64()), "g": pa.array([2 * t for t in cols[2]], pa.int64()),
                     WRITE_COLUMN: pa.array(cols[3], pa.string())})


def test_a_plain_table_is_rewritten(tmp_path):
    uri = str(tmp_path / "t")
    create(uri)
    assert merge_only_reason(DeltaTable(uri)) is None


@pytest.mark.parametrize("feature", list(FEATURES))
def test_a_table_with_the_feature_commits_updates_through_merge_or_the_log_commit(tmp_path, caplog, feature):
    """Deletion vectors: the sink marks rows itself (merge-on-read); a change data feed: the
    rewrite writes the changes; column mapping: the rewrite reads and writes physical names;
    the others (rows committed unchecked here): MERGE, with a warning naming the feature once."""
    uri = str(tmp_path / "t")
    FEATURES[feature](uri)
    assert merge_only_reason(DeltaTable(uri)).startswith(feature)
    update_mode = {"deletion vectors": "merge-on-read", "change data feed": "rewrite",
                   "column mapping": "rewrite"}.get(feature, "merge")
    target = DeltaTarget(uri, ["dt"])
    target.open_or_create(ARROW, None)

    def commit(batch, *records):
        return target.commit(rows(*records), ["id"], "ts", "w", batch, {}, incoming_wins_ties=True)

    assert commit(0, ("a", "d1", 1, "insert"), ("b", "d1", 1, "insert"), ("c", "d2", 1, "insert")).mode == "append"
    with caplog.at_level(logging.WARNING, logger="sink"):
        assert commit(1, ("a", "d1", 5, "update"), ("c", "d2", 5, "delete"), ("d", "d2", 5, "insert")).mode == \
            update_mode
        assert commit(2, ("b", "d1", 7, "update"), ("a", "d1", 3, "update")).mode == update_mode
    warnings = [r.getMessage() for r in caplog.records if "commit through MERGE" in r.getMessage()]
    assert len(warnings) == (update_mode == "merge") and all(feature in w for w in warnings)
    # delta-rs' own reader (pyarrow's would miss deletion vectors and column mapping).
    read = QueryBuilder().register("t", DeltaTable(uri)).execute("SELECT id, dt, ts, g FROM t").read_all()
    table = sorted((r["id"], r["dt"], r["ts"], r["g"]) for r in pa.table(read).to_pylist())
    assert table == [("a", "d1", 5, 10), ("b", "d1", 7, 14), ("d", "d2", 5, 10)]
    assert DeltaTable(uri).transaction_version("w") == 2


def test_check_constraints_read_as_spark_sql_whoever_wrote_them(tmp_path):
    uri = str(tmp_path / "t")
    DeltaTable.create(uri, Schema([Field("userId", "long"), Field("dt", "string")]), partition_by=["dt"])
    # delta-rs records its constraints in DataFusion's SQL, a mixed-case column double-quoted.
    DeltaTable(uri).alter.add_constraint({"known_user": "userId > 0"})
    recorded = DeltaTable(uri).metadata().configuration["delta.constraints.known_user"]
    assert recorded == '"userId" > 0'
    assert check_constraints(DeltaTable(uri)) == {"known_user": "`userId` > 0"}
    create(str(tmp_path / "plain"))
    assert check_constraints(DeltaTable(str(tmp_path / "plain"))) == {}


ROW_CHECKED = {"CHECK constraints": {"CHECK constraint ts_positive": "ts >= 0"},
               "column invariants": {"invariant on column g": "g >= 0"},
               "generated columns": {"generated column g": "`g` <=> (ts * 2)"}}


@pytest.mark.parametrize("feature", list(ROW_CHECKED))
def test_what_every_row_must_meet_is_checked_by_the_sink_where_rows_are_its_records(tmp_path, feature):
    """The batch checks its records against the table's row checks (sink.batch.checks): where
    every written row is a record, those features need no MERGE."""
    uri = str(tmp_path / "t")
    FEATURES[feature](uri)
    assert row_checks(DeltaTable(uri)) == ROW_CHECKED[feature]
    modes = []
    for checks_rows in (False, True):
        target = DeltaTarget(uri, ["dt"], checks_rows=checks_rows)
        target.open_or_create(ARROW, None)
        modes.append(target.update_mode())
    assert modes == ["merge", "rewrite"]
    create(str(tmp_path / "plain"))
    assert row_checks(DeltaTable(str(tmp_path / "plain"))) == {}


@pytest.mark.parametrize("expression, reads", [
    ("n > 0", True), ("`n` <=> (v * 2)", True), ("N >= 1", True), ("t.n > 0", True),
    ("v = 'n'", True),  # a literal holding the name counts: never a check missed
    ("nn > 0", False), ("x_n > 0", False), ("amount >= 0", False),
])
def test_a_check_reads_a_column_where_it_names_it(expression, reads):
    assert mentions(expression, "n") is reads


@pytest.mark.parametrize(("reader", "writer", "named"), [
    ([], ["inCommitTimestamp"], "in-commit timestamps (the inCommitTimestamp feature)"),
    (["typeWidening"], ["typeWidening"], "type widening (the typeWidening feature)"),
    (["deletionVectors"], ["deletionVectors", "someFutureFeature"], "a table feature (the someFutureFeature feature)"),
], ids=["in-commit timestamps", "type widening", "unknown"])
def test_a_feature_the_sink_does_not_write_is_refused_naming_it_before_anything_is_written(
        tmp_path, reader, writer, named):
    uri = spark_table(tmp_path / "t", {"minReaderVersion": 3, "minWriterVersion": 7, "readerFeatures": reader,
                                       "writerFeatures": writer}, {})
    target = DeltaTarget(uri, [])
    with pytest.raises(UnsupportedTableError, match=re.escape(f"{uri} uses {named}: delta-rs cannot write it; "
                                                              "engine = 'delta-spark', or 'auto' in a session with "
                                                              "Delta's extension, writes it through Spark")):
        target.check_writable()
    assert DeltaTable(uri).version() == 0
