"""Tables created by Spark SQL, as Spark users create them, and their rows as Spark reads them."""

COLUMNS = "id STRING, dt STRING, ts BIGINT, op STRING, v STRING"

# The table a Spark Connect user created (issue: other writers): every feature Spark users turn
# on, and a CHECK constraint that about one upsert in eight breaks (`amount_of`).
FEATURE_RICH = (COLUMNS + ", amount BIGINT, n BIGINT GENERATED ALWAYS AS IDENTITY, "
                "g STRING GENERATED ALWAYS AS (upper(v))")
FEATURE_RICH_PROPERTIES = ("TBLPROPERTIES ('delta.enableDeletionVectors' = 'true', "
                           "'delta.enableChangeDataFeed' = 'true')")
FEATURE_RICH_CONSTRAINT = "amount_not_negative CHECK (amount >= 0)"
FEATURE_RICH_REASON = "CHECK constraint amount_not_negative (amount >= 0) violated"


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
