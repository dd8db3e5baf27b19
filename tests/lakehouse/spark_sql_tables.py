"""Tables created by Spark SQL, as Spark users create them, and their rows as Spark reads them."""

COLUMNS = "id STRING, dt STRING, ts BIGINT, op STRING, v STRING"


def create(spark, uri: str, columns: str = COLUMNS, properties: str = "", constraint: str = "") -> None:
    spark.sql(f"CREATE TABLE delta.`{uri}` ({columns}) USING delta PARTITIONED BY (dt) {properties}")
    if constraint:
        spark.sql(f"ALTER TABLE delta.`{uri}` ADD CONSTRAINT {constraint}")


def spark_rows(spark, uri):
    rows = [r.asDict() for r in spark.read.format("delta").load(uri).select("id", "dt", "ts", "op", "v").collect()]
    return sorted(rows, key=lambda r: (r["dt"], r["id"]))
