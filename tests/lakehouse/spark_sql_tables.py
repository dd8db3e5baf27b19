"""Tables created by Spark SQL, as Spark users create them, and their rows as Spark reads them."""

import json
from pathlib import Path

from sink import SinkConfig

COLUMNS = "id STRING, dt STRING, ts BIGINT, op STRING, v STRING"

# The table a Spark Connect user created (issue: other writers): every feature Spark users turn
# on, and a CHECK constraint that about one upsert in eight breaks (`amount_of`).
FEATURE_RICH = (COLUMNS + ", amount BIGINT, n BIGINT GENERATED ALWAYS AS IDENTITY, "
                "g STRING GENERATED ALWAYS AS (upper(v))")
FEATURE_RICH_PROPERTIES = ("TBLPROPERTIES ('delta.enableDeletionVectors' = 'true', "
                           "'delta.enableChangeDataFeed' = 'true')")
FEATURE_RICH_CONSTRAINT = "amount_not_negative CHECK (amount >= 0)"
FEATURE_RICH_REASON = "CHECK constraint amount_not_negative (amount >= 0) violated"


def sink_config(tmp_path, uri: str, **options) -> SinkConfig:
    """The sink on a Spark SQL table of COLUMNS, under its deltalake engine."""
    return SinkConfig(**{"table_uri": uri, "key": ["id"], "partition_by": ["dt"], "ordering": "ts",
                         "delete_when": "op = 'd'", "writer_id": "w", "index_dir": str(tmp_path / "index"),
                         "num_shards": 2, "metrics_port": 0, "tag_on": "driver", "engine": "deltalake", **options})


def create(spark, uri: str, columns: str = COLUMNS, properties: str = "", constraint: str = "") -> None:
    spark.sql(f"CREATE TABLE delta.`{uri}` ({columns}) USING delta PARTITIONED BY (dt) {properties}")
    if constraint:
        spark.sql(f"ALTER TABLE delta.`{uri}` ADD CONSTRAINT {constraint}")


def create_feature_rich(spark, uri: str) -> None:
    create(spark, uri, columns=FEATURE_RICH, properties=FEATURE_RICH_PROPERTIES, constraint=FEATURE_RICH_CONSTRAINT)


def amount_of(e) -> int:
    """An event's amount in the feature-rich table; about one upsert in eight is negative."""
    return sum(map(ord, e.v or "")) % 80 - 10


def spark_rows(spark, uri):
    rows = [r.asDict() for r in spark.read.format("delta").load(uri).select("id", "dt", "ts", "op", "v").collect()]
    return sorted(rows, key=lambda r: (r["dt"], r["id"]))


def log_actions(uri: str, first: int = 0) -> list[tuple[int, str, dict]]:
    """Every action of the table's log from version `first` on: (version, name, value)."""
    found = []
    for path in sorted(Path(uri, "_delta_log").glob("*.json")):
        version = int(path.stem)
        if version >= first:
            found += [(version, name, value) for line in path.read_text().splitlines() if line
                      for name, value in json.loads(line).items()]
    return found


def last_action(uri: str, name: str) -> dict:
    """The table's latest `protocol` or `metaData` action, as its log spells it."""
    return [value for _, n, value in log_actions(uri) if n == name][-1]


SPARK_SCHEMA = {"type": "struct", "fields": [
    {"name": "id", "type": "long", "nullable": True, "metadata": {}},
    {"name": "v", "type": "string", "nullable": True, "metadata": {}}]}


def spark_table(path, protocol: dict, configuration: dict, schema: dict = SPARK_SCHEMA) -> str:
    """Version 0 as Spark's CREATE TABLE writes it."""
    (path / "_delta_log").mkdir(parents=True)
    lines = [{"commitInfo": {"timestamp": 1, "operation": "CREATE TABLE", "engineInfo": "Apache-Spark/4.2.0"}},
             {"protocol": protocol},
             {"metaData": {"id": "spark-table-id", "name": "orders", "format": {"provider": "parquet", "options": {}},
                           "schemaString": json.dumps(schema, separators=(",", ":")), "partitionColumns": [],
                           "configuration": configuration, "createdTime": 1}}]
    (path / "_delta_log" / f"{0:020d}.json").write_text("".join(json.dumps(line) + "\n" for line in lines))
    return str(path)
