"""The mirror shape under another writer's maintenance: an unpartitioned table Spark SQL created
with deletion vectors, keyed by `id`, its updates anywhere (every batch marks rows in files
all over the table, and divides its write into shares), written by two sinks, one tagging on
the driver and one on the executors (two batches of the first, one of the second, in turn),
while Spark runs OPTIMIZE, DELETE, UPDATE, MERGE, RESTORE
and REORG ... PURGE between batches and during them. Every batch ends with the table equal to
an independent model (tests.oracle.TableModel). Both sinks publish replica snapshots to the
table's one snapshot location, and every other batch of a sink starts it again with its
replicas lost: it restores a snapshot from before the outside commit and catches up from
there, so every kind of commit meets both a replica that followed it and one restored from
before it."""

from __future__ import annotations

import random

import pyarrow as pa
import pytest
from deltalake import DeltaTable

from sink import SinkConfig, UpsertSink
from tests import damage
from tests.lakehouse.spark_sql_tables import COLUMNS
from tests.oracle import SCHEMA, Event, TableModel, verify_replicas
from tests.test_concurrent_writers import racing

pytestmark = pytest.mark.spark

DT = "-"  # a column like any other here: the table has no partition
SEED_FILES = 4
SEED_KEYS = 400
UPDATES = 60  # a batch's records of stored keys: updates, deletes, stale and repeated ones
INSERTS = 15
ROUND = ("driver", "driver", "executors")


def table_rows(uri):
    rows = pa.table(DeltaTable(uri).scan(columns=["id", "dt", "ts", "op", "v"])).to_pylist()
    return sorted(rows, key=lambda r: (r["dt"], r["id"]))


class Mirror:
    def __init__(self, spark, tmp_path):
        self.spark, self.tmp_path = spark, tmp_path
        self.uri = str(tmp_path / "table")
        self.model = TableModel()
        self.rng = random.Random(72)
        self.ts = 10
        self.next_key = SEED_KEYS
        self.sinks: dict[str, tuple[SinkConfig, list]] = {}
        self.reports = {}
        self.races = 0

    def create(self) -> None:
        self.spark.sql(f"CREATE TABLE delta.`{self.uri}` ({COLUMNS}) USING delta "
                       "TBLPROPERTIES ('delta.enableDeletionVectors' = 'true')")
        keys = list(range(SEED_KEYS))
        self.rng.shuffle(keys)  # every file holds keys from all over the key space
        for part in range(SEED_FILES):
            rows = [Event(f"k{k}", DT, 0, "u", "seed") for k in keys[part::SEED_FILES]]
            self.spark.createDataFrame(rows, SCHEMA).coalesce(1).write.format("delta").mode("append").save(self.uri)
            self.model.written(rows)
        self.check("seeded")

    def sink(self, tag_on: str) -> tuple[SinkConfig, list]:
        """The config of the sink tagging on `tag_on`, and [the sink, its next batch number]."""
        if tag_on not in self.sinks:
            cfg = SinkConfig(table_uri=self.uri, key=["id"], partition_by=[], ordering="ts", delete_when="op = 'd'",
                             writer_id=tag_on, index_dir=str(self.tmp_path / tag_on), num_shards=2, metrics_port=0,
                             tag_on=tag_on, replica_snapshot_every_versions=1)
            self.sinks[tag_on] = (cfg, [UpsertSink(cfg), 0])
            self.reports[tag_on] = []
        return self.sinks[tag_on]

    def events(self) -> list[Event]:
        """Updates of stored keys anywhere, some deletes, some stale (older than the stored
        row), some sent twice (the later record newer), and new keys."""
        self.ts += 10
        out = []
        for j, (_, key) in enumerate(self.rng.sample(sorted(self.model.live()), UPDATES)):
            roll = self.rng.random()
            if roll < 0.08:
                out.append(Event(key, DT, self.ts, "d", ""))
            elif roll < 0.16:
                out.append(Event(key, DT, self.model.state[(DT, key)].ts - 1, "u", "stale"))
            else:
                out.append(Event(key, DT, self.ts - self.rng.randrange(3), "u", f"b{self.ts}-{j}"))
                if roll > 0.94:
                    out.append(Event(key, DT, self.ts + 1, "u", f"b{self.ts}-{j}-again"))
        for j in range(INSERTS):
            out.append(Event(f"k{self.next_key}", DT, self.ts, "u", f"b{self.ts}-new{j}"))
            self.next_key += 1
        return out

    def batch(self, tag_on: str, race=None) -> None:
        """One batch of the sink tagging on `tag_on`; every other one starts it again first,
        its replicas lost. `race()` commits between its tagging and its commit and returns
        how the model follows."""
        cfg, state = self.sink(tag_on)
        sink, number = state
        if number % 2:
            sink.close()
            damage.lose(self.tmp_path / tag_on)
            sink = state[0] = UpsertSink(cfg)
        pending = []
        if race is not None:
            racing(sink, lambda: pending.append(race()))
        events = self.events()
        sink(self.spark.createDataFrame(events, SCHEMA), number)
        state[1] += 1
        self.reports[tag_on].append(sink.reports[-1])
        if race is not None:
            assert pending, f"the race raced no commit of {tag_on} batch {number}"
            pending[0]()
            self.races += 1
        self.model.batch(events)
        self.check(f"{tag_on} batch {number}")

    def round(self, race_on: str | None = None, race=None) -> None:
        """Two batches tagged on the driver (the second started again with no commit since its
        first: its snapshot and its changelog bring it up to date), then one on the executors.
        A race lands in the first batch of the sink tagging on `race_on`."""
        raced = ROUND.index(race_on) if race_on else None
        for i, tag_on in enumerate(ROUND):
            self.batch(tag_on, race if i == raced else None)

    def check(self, where: str) -> None:
        self.model.remember(DeltaTable(self.uri).version())
        assert table_rows(self.uri) == self.model.rows(), where

    def sql(self, text: str) -> None:
        self.spark.sql(text.format(t=f"delta.`{self.uri}`")).collect()

    def live_keys(self, n: int) -> list[tuple[str, str]]:
        return self.rng.sample(sorted(self.model.live()), n)

    def close(self) -> None:
        for _, (sink, _) in self.sinks.values():
            sink.close()


def in_list(keys) -> str:
    return ", ".join(f"'{k}'" for _, k in keys)


@pytest.fixture
def vacuum_allowed(spark):
    spark.conf.set("spark.databricks.delta.retentionDurationCheck.enabled", "false")
    yield
    spark.conf.unset("spark.databricks.delta.retentionDurationCheck.enabled")


def test_a_mirror_stays_exact_through_sparks_maintenance_with_replicas_restored_from_snapshots(spark, tmp_path,
                                                                                               vacuum_allowed):
    m = Mirror(spark, tmp_path)
    m.create()
    m.round()
    m.round()

    def delete():
        gone = m.live_keys(8)
        m.sql(f"DELETE FROM {{t}} WHERE id IN ({in_list(gone)})")
        return lambda: m.model.removed(gone)

    def update():
        keys = m.live_keys(8)
        m.sql(f"UPDATE {{t}} SET v = 'updated', ts = ts + 3 WHERE id IN ({in_list(keys)})")
        return lambda: m.model.written([m.model.state[k]._replace(v="updated", ts=m.model.state[k].ts + 3)
                                        for k in keys])

    def merge():
        keys = m.live_keys(4) + [(DT, f"m{i}-{m.ts}") for i in range(2)]  # two keys the sink never saw
        rows = [Event(k, DT, m.ts - 5, "u", "merged") for _, k in keys]
        source = ", ".join(f"('{e.id}', '{e.dt}', {e.ts}, 'u', 'merged')" for e in rows)
        m.sql(f"MERGE INTO {{t}} t USING (SELECT * FROM VALUES {source} AS s(id, dt, ts, op, v)) s "
              "ON t.id = s.id WHEN MATCHED THEN UPDATE SET ts = s.ts, op = s.op, v = s.v "
              "WHEN NOT MATCHED THEN INSERT (id, dt, ts, op, v) VALUES (s.id, s.dt, s.ts, s.op, s.v)")
        return lambda: m.model.written(rows)

    def optimize():
        m.sql("OPTIMIZE {t}")
        return lambda: None

    def restore():
        target = m.model.versions()[-5]  # a few batches back

        def undo():
            m.model.restore(target)
        m.sql(f"RESTORE TABLE {{t}} TO VERSION AS OF {target}")
        return undo

    def purge():
        m.sql("REORG TABLE {t} APPLY (PURGE)")
        m.sql("VACUUM {t} RETAIN 0 HOURS")
        return lambda: None

    for operation in (optimize, delete, update, merge, restore, purge, optimize):
        operation()()
        m.check(f"after {operation.__name__}")
        m.round()
    for race_on, operation in (("driver", delete), ("executors", update), ("driver", optimize),
                               ("executors", restore)):
        m.round(race_on, operation)
    m.round()
    m.close()

    assert spark.read.format("delta").load(m.uri).count() == len(m.model.live())
    assert m.races == 4
    restored = {tag_on: [(sum(r.partition_loads.values()) > 0, r.changelog_applied > 0)
                         for r in reports if r.snapshots_restored] for tag_on, reports in m.reports.items()}
    # Restored and brought up to date by its changelog alone (no commit but its own since the
    # snapshot); restored, then reloaded after other writers' commits.
    assert (False, True) in restored["driver"] and (True, False) in restored["executors"], restored
    for tag_on, reports in m.reports.items():
        assert sum(r.retries for r in reports) >= 2, f"{tag_on} lost its two races and followed"
        assert sum(r.snapshots_restored for r in reports) > 0, f"{tag_on} never restored a snapshot"
        assert sum(r.files_marked for r in reports) > 0, f"{tag_on} never marked a row"
        assert sum(r["entries_checked"] for r in verify_replicas(m.sinks[tag_on][0])) > 0
