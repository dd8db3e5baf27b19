"""The maintenance matrix: what an operator runs on a table Spark SQL created (a plain one, one
with column mapping and a CHECK constraint, one with a generated column and a change data
feed), between the sink's batches and during them, under both Delta engines and both tagging
paths.

Four sinks write one table (deltalake and delta-spark, each tagging on the driver and on the
executors): the deltalake sinks a batch after every operation, the delta-spark ones in turn a
batch after about four (their Spark MERGE costs 5-7 s here). Every batch ends with the table
equal to an independent model that applies the documented rule (tests.oracle.TableModel: a
row another writer removed is deleted at its ordering, one it wrote stands, a RESTORE puts
everything back as it was at its version), or the operation is refused with an error naming
it. Every other batch of a sink starts it again with its replicas lost, as a SIGKILL leaves
them (rebuilt from the table and the tombstone table), so the sinks meet the kinds of commit
both with a replica that followed them and with one rebuilt after them. Some operations land
between a sink's tagging and its commit (a race the sink loses, then follows)."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pyarrow as pa
import pytest
from deltalake import DeltaTable

from sink import SchemaError, SinkConfig, UpsertSink
from tests import damage
from tests.lakehouse.spark_sql_tables import COLUMNS, create, spark_rows
from tests.oracle import SCHEMA, Event, TableModel
from tests.test_concurrent_writers import racing

pytestmark = pytest.mark.spark

DAYS = ("2025-01-01", "2025-01-02", "2025-01-03")
KEYS = 90
PER_BATCH = 60
WRITERS = [("deltalake", "driver"), ("deltalake", "executors"), ("delta-spark", "driver"),
           ("delta-spark", "executors")]


@dataclass
class Writer:
    cfg: SinkConfig
    sink: UpsertSink
    batch: int = 0

    def restart(self, tmp_path) -> None:
        """As after a SIGKILL: a new sink object, its replicas gone (rebuilt from the tables)."""
        self.sink.close()
        if (tmp_path / self.cfg.writer_id).exists():
            damage.lose(tmp_path / self.cfg.writer_id)
        self.sink = UpsertSink(self.cfg)


class Matrix:
    def __init__(self, spark, tmp_path, computed: tuple[str, ...] = ()):
        self.spark, self.tmp_path = spark, tmp_path
        self.computed = computed  # the generated columns' expressions, which the stream carries
        self.uri = str(tmp_path / "table")
        self.model = TableModel()
        self.rng = random.Random(55)
        self.extra = False  # the stream carries the column ADD COLUMNS added
        self.writers = []
        for engine, tag_on in WRITERS:
            name = f"{engine}-{tag_on}"
            # Every writer rewrites files; once deletion vectors are on, marks rows in them
            # (merge-on-read), and once the change data feed is on too, writes its changes.
            cfg = SinkConfig(table_uri=self.uri, key=["id"], partition_by=["dt"], ordering="ts",
                             delete_when="op = 'd'", writer_id=name, index_dir=str(tmp_path / name), num_shards=2,
                             metrics_port=0, engine=engine, tag_on=tag_on)
            self.writers.append(Writer(cfg, UpsertSink(cfg)))
        self.ts = 0
        self.retries = 0
        self.modes: dict[str, None] = {}  # the commit paths the writers' batches took, in order

    def events(self) -> list[Event]:
        """One batch: upserts and deletes of random keys, some late (older than what is stored)."""
        self.ts += 10
        out = []
        for j in range(PER_BATCH):
            k = self.rng.randrange(KEYS)
            ts = self.ts - self.rng.randrange(0, 25)
            op = "d" if self.rng.random() < 0.15 else "u"
            out.append(Event(f"k{k}", DAYS[k % len(DAYS)], ts, op, f"b{self.ts}-{j}"))
        return out

    def frame(self, events):
        df = self.spark.createDataFrame(events, SCHEMA).selectExpr("*", *self.computed)
        return df.selectExpr("*", "concat('x-', v) AS extra") if self.extra else df

    def run(self, writer: Writer, race=None, race_model=None) -> None:
        events = self.events()
        if race is not None:
            racing(writer.sink, lambda: (race(), race_model()))
        writer.sink(self.frame(events), writer.batch)
        self.retries += writer.sink.reports[-1].retries
        self.modes[writer.sink.reports[-1].mode] = None
        writer.batch += 1
        self.model.batch(events)
        self.check(f"{writer.cfg.writer_id} batch {writer.batch - 1}")

    def check(self, where: str) -> None:
        self.model.remember(self.version())
        assert table_rows(self.uri) == self.model.rows(), where

    def version(self) -> int:
        return DeltaTable(self.uri).version()

    def sql(self, text: str) -> None:
        self.spark.sql(text.format(t=f"delta.`{self.uri}`")).collect()

    def live_keys(self, n: int) -> list[tuple[str, str]]:
        live = sorted(self.model.live())
        return self.rng.sample(live, min(n, len(live)))

    def round(self, step: int, race_writer: int | None = None, race=None, race_model=None) -> None:
        """A batch of each deltalake sink; every other step, of one of the two delta-spark sinks
        in turn; the racing sink's always. Every other batch of a sink starts it again first,
        its replicas lost."""
        for i, writer in enumerate(self.writers):
            if i != race_writer and WRITERS[i][0] == "delta-spark" and step % 4 != 2 * (i - 2):
                continue
            if writer.batch % 2:
                writer.restart(self.tmp_path)
            if i == race_writer:
                self.run(writer, race, race_model)
            else:
                self.run(writer)


def table_rows(uri):
    rows = pa.table(DeltaTable(uri).scan(columns=["id", "dt", "ts", "op", "v"])).to_pylist()
    return sorted(rows, key=lambda r: (r["dt"], r["id"]))


def in_list(keys) -> str:
    return ", ".join(f"'{k}'" for _, k in keys)


@pytest.fixture
def vacuum_allowed(spark):
    """VACUUM and REORG ... PURGE with no retention, as an operator reclaiming space does."""
    spark.conf.set("spark.databricks.delta.retentionDurationCheck.enabled", "false")
    yield
    spark.conf.unset("spark.databricks.delta.retentionDurationCheck.enabled")


# The tables the matrix runs on: a plain one; one whose files the sink writes under physical
# column names, checking a CHECK constraint on every record; one with a generated column the
# records lack and a change data feed from the start (no MERGE on any of them).
TABLES = {
    "plain": {},
    "column-mapped-with-a-check": {"properties": "TBLPROPERTIES ('delta.columnMapping.mode' = 'name')",
                                   "constraint": "v_present CHECK (v IS NOT NULL)"},
    "generated-column-with-a-change-feed": {"columns": f"{COLUMNS}, g STRING GENERATED ALWAYS AS (upper(v))",
                                            "properties": "TBLPROPERTIES ('delta.enableChangeDataFeed' = 'true')"},
}
# What the stream selects for a table's generated columns (Delta checks each value).
COMPUTED = {"generated-column-with-a-change-feed": ("upper(v) AS g",)}


@pytest.mark.parametrize("table", TABLES)
def test_maintenance_between_and_during_batches_under_both_engines_and_tagging_paths(spark, tmp_path,
                                                                                        vacuum_allowed, table):
    m = Matrix(spark, tmp_path, COMPUTED.get(table, ()))
    create(spark, m.uri, **TABLES[table])
    m.check("created")
    m.round(0)

    def delete():
        gone = m.live_keys(6)
        m.sql(f"DELETE FROM {{t}} WHERE id IN ({in_list(gone)})")
        return lambda: m.model.removed(gone)

    def update():
        keys = m.live_keys(6)
        m.sql(f"UPDATE {{t}} SET v = 'updated', ts = ts + 3 WHERE id IN ({in_list(keys)})")
        return lambda: m.model.written([m.model.state[k]._replace(v="updated", ts=m.model.state[k].ts + 3)
                                        for k in keys])

    def merge():
        keys = [(DAYS[k % 3], f"k{k}") for k in m.rng.sample(range(KEYS), 6)]
        rows = [Event(k, dt, m.ts - 5, "u", "merged") for dt, k in keys]
        source = ", ".join(f"('{e.id}', '{e.dt}', {e.ts}, 'u', 'merged')" for e in rows)
        m.sql(f"MERGE INTO {{t}} t USING (SELECT * FROM VALUES {source} AS s(id, dt, ts, op, v)) s "
              "ON t.id = s.id AND t.dt = s.dt WHEN MATCHED THEN UPDATE SET ts = s.ts, op = s.op, v = s.v "
              "WHEN NOT MATCHED THEN INSERT (id, dt, ts, op, v) VALUES (s.id, s.dt, s.ts, s.op, s.v)")
        return lambda: m.model.written(rows)

    def maintenance(text):
        def run():
            m.sql(text)
            return lambda: None
        return run

    def between(step, operation):
        apply = operation()
        apply()
        m.check(f"after {operation.__name__} (step {step})")
        m.round(step)

    def during(step, writer, operation):
        """`operation` commits while `writer`'s batch is between its tagging and its commit."""
        pending = []
        m.round(step, race_writer=writer, race=lambda: pending.append(operation()),
                race_model=lambda: pending[-1]())
        assert pending, f"{operation.__name__} raced no commit (step {step})"

    step = 2
    for name, operation in [("optimize", maintenance("OPTIMIZE {t}")), ("delete", delete), ("update", update),
                            ("merge", merge)]:
        operation.__name__ = name
        between(step, operation)
        step += 1
    # Deletion vectors on: Spark's DELETE (racing a batch) now marks rows instead of rewriting files.
    between(step, maintenance("ALTER TABLE {t} SET TBLPROPERTIES ('delta.enableDeletionVectors' = 'true')"))
    step += 1
    during(step, 1, delete)
    step += 1
    during(step, 2, maintenance("OPTIMIZE {t} ZORDER BY (id)"))
    # RESTORE two commits back, between batches, then during one.
    for timing in ("between", "during"):
        step += 1
        target = m.model.versions()[-3]  # two sink batches back

        def restore(target=target):
            m.sql(f"RESTORE TABLE {{t}} TO VERSION AS OF {target}")
            return lambda: m.model.restore(target)
        restore.__name__ = "restore"
        if timing == "between":
            between(step, restore)
        else:
            during(step, 3, restore)
    # Two commits that change no row between the same batches: the purge and the vacuum.
    step += 1
    m.sql("REORG TABLE {t} APPLY (PURGE)")
    between(step, maintenance("VACUUM {t} RETAIN 0 HOURS"))
    step += 1
    between(step, maintenance("ALTER TABLE {t} SET TBLPROPERTIES ('delta.enableChangeDataFeed' = 'true')"))
    step += 1
    during(step, 0, merge)

    # A column added by another writer: a stream without it is refused, naming it; with it, goes on.
    m.sql("ALTER TABLE {t} ADD COLUMNS (extra STRING)")
    m.check("after ADD COLUMNS")
    with pytest.raises(SchemaError, match=r"column\(s\) \['extra'\] are not in the stream"):
        m.writers[0].sink(m.frame(m.events()), m.writers[0].batch)
    m.extra = True
    step += 1
    m.round(step)

    # An overwrite by another job: what it removed is deleted at its ordering, what it wrote stands.
    step += 2  # a delta-spark sink's turn too
    kept = [e for key, e in sorted(m.model.live().items()) if key[0] == DAYS[0]]
    rows = [e._replace(v="overwritten") for e in kept[: len(kept) // 2]]
    frame = spark.createDataFrame(rows, SCHEMA).selectExpr("*", "CAST(NULL AS STRING) AS extra")
    frame.write.format("delta").mode("overwrite").save(m.uri)
    m.model.removed(list(m.model.live()))
    m.model.written(rows)
    m.check("after an overwrite")
    m.round(step)

    assert spark_rows(spark, m.uri) == m.model.rows()
    if table in COMPUTED:  # every writer's rows hold the expression's value
        assert spark.read.format("delta").load(m.uri).where("g IS DISTINCT FROM upper(v)").count() == 0
    for writer in m.writers:
        writer.sink.close()
    assert m.retries >= 4, "every race (four) was lost and followed"
    assert [mode for mode in m.modes if mode not in ("append", "skipped", "none")] == ["rewrite", "merge-on-read"]
