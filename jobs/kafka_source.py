"""The ready job's Kafka source (`[source] format = "kafka"`): Spark's Kafka connector, each
message's value parsed as JSON into `source.schema`, before the envelope and `select` apply.

- A message with a null value (a Kafka tombstone, which Debezium sends after a delete so that
  compaction can drop the key) is not a record: it is left out.
- `value_format = "json-with-schema"`: the Kafka Connect JSON converter's
  `{"schema": ..., "payload": ...}` wrapper (`value.converter.schemas.enable = true`, its
  default); the record is the payload.
- A message that does not parse (not JSON, not wrapped where the wrapper is expected, a value
  of the wrong type) goes to quarantine: the corrupt-record column holds its topic, partition,
  offset and raw text.
- With `json-with-schema`, values are decoded by the Connect schemas their messages carry
  (`jobs.connect_types`: a `Decimal` as DECIMAL, a `Date` as DATE, ...), batch by batch; a
  value that does not decode goes to quarantine, its column, Connect type and raw value in
  the corrupt-record column's first line. `schema_from_messages` (its default there): each
  batch's schema is `source.schema` widened by the fields the messages carry and it lacks
  (for a Debezium envelope: the fields of `before` and `after`), so a column added at the
  source reaches the table with the first batch carrying it, without a restart;
  `source.schema`'s own columns keep their declared types.
- `key_schema`: the message key parsed as JSON too (in the same value format); its fields fill
  the record's columns of the same name where the value leaves them null, or add them.
- Arrival order: Spark reads each topic-partition's offset range in one task, in offset order,
  so among records of a key with equal ordering values the later offset wins (`sink.arrival`:
  records not read from files arrive in scan order).

- Lag: after each batch, the offsets behind per topic-partition (`KafkaLag`, a listener on
  the queries' progress) as `upsert_sink_kafka_lag` and a log line.

`python -m jobs.kafka_source` prints the connector's Maven package; `--jar`, where Maven keeps
its jar; `--fetch-command`, the command that puts it into ~/.m2, where Spark's Ivy resolves it
(`make kafka-jars`).
"""

from __future__ import annotations

import argparse
import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import metadata
from typing import NamedTuple

from pyspark.sql import DataFrame
from pyspark.sql import functions as F
from pyspark.sql.streaming import StreamingQueryListener
from pyspark.sql.types import StringType, StructField, StructType

from jobs import connect_types
from sink.errors import ConfigError
from sink.keys import quoted_column
from sink.lakehouse.engines import spark_delta
from sink.ops import metrics
from sink.routing import CANNOT_DECODE, sql_string

log = logging.getLogger(__name__)

VALUE_FORMATS = ("json", "json-with-schema")
# Spark's Kafka source names topics by one of these (exactly one is set).
SUBSCRIPTIONS = ("topics", "subscribe_pattern")
_VALUE, _PAYLOAD, _RECORD, _KEY, _SCHEMA = ("__kafka_value", "__kafka_payload", "__kafka_record", "__kafka_key",
                                            "__kafka_schema")



def package() -> str:
    """Spark's Kafka connector at the installed Spark's version (the connector's Spark classes
    must match the running ones)."""
    return f"org.apache.spark:spark-sql-kafka-0-10_2.13:{metadata.version('pyspark')}"


def fetch_command() -> str:
    """The command that puts the connector and its dependencies where Spark resolves them offline.
    The dependency plugin from 3.x: 2.8 (Maven's default) also fetches test jars, some unserved."""
    return f"mvn -q org.apache.maven.plugins:maven-dependency-plugin:3.8.1:get -Dartifact={package()}"


def widened(base: StructType, found: StructType, within: tuple[str, ...] = ()) -> StructType:
    """`base` with the fields of `found` it lacks appended, nested structs alike, its own
    fields' types kept; `within`: widen only these top-level struct fields (a Debezium
    envelope's `before` and `after`), adding no top-level field."""
    by_name = {f.name: f for f in found.fields}
    fields = []
    for f in base.fields:
        other = by_name.get(f.name)
        if other is not None and isinstance(f.dataType, StructType) and isinstance(other.dataType, StructType) \
                and (not within or f.name in within):
            f = StructField(f.name, widened(f.dataType, other.dataType), f.nullable)
        fields.append(f)
    if not within:
        fields += [StructField(f.name, f.dataType, True) for f in found.fields if f.name not in base.fieldNames()]
    return StructType(fields)


# The JSON converter writes `{"schema":...,"payload":...}` compactly, schema first: the schema's
# text is what comes before `,"payload":` (no JSON parse of the message); other writers' JSON
# is parsed for it.
_TEXT, _SCHEMA_KEY, _PAYLOAD_KEY = "CAST(value AS STRING)", '{"schema":', ',"payload":'
SCHEMA_TEXT = (f"CASE WHEN startswith({_TEXT}, '{_SCHEMA_KEY}{{') AND instr({_TEXT}, '{_PAYLOAD_KEY}') > 0 "
               f"THEN substring_index({_TEXT}, '{_PAYLOAD_KEY}', 1) "
               f"ELSE concat('{_SCHEMA_KEY}', get_json_object({_TEXT}, '$.schema')) END")


def schema_of(text: str | None) -> dict | None:
    """The Connect schema of a message whose SCHEMA_TEXT is `text` (None: none, or not JSON)."""
    try:
        schema = json.loads(text[len(_SCHEMA_KEY):]) if text else None
    except ValueError:
        return None
    return schema if isinstance(schema, dict) else None


class BatchSchemas(NamedTuple):
    """A batch's distinct Connect schemas (text, schema), whether its flag held for a message,
    and how many messages carry each schema (by text)."""

    schemas: list[tuple[str, dict]]
    flagged: bool
    counts: dict[str, int]


def message_schemas(raw: DataFrame, flag: str | None = None) -> BatchSchemas:
    """The distinct Connect schemas of a batch's messages (Kafka rows, the JSON converter's
    wrapper), structs only, each with its text, and whether SQL `flag` holds for any message:
    one more pass over the batch, returning only its distinct schemas (with counts and flags).
    A message without one adds nothing (its decoding sends it to quarantine)."""
    texts = (raw.where("value IS NOT NULL").selectExpr(f"{SCHEMA_TEXT} AS {_SCHEMA}", f"{flag or 'false'} AS flagged")
             .groupBy(_SCHEMA).agg(F.count("*").alias("n"), F.max("flagged").alias("flagged")).collect())
    found, flagged = {}, any(row["flagged"] for row in texts)
    for row in texts:
        schema = schema_of(row[_SCHEMA])
        if schema is not None and schema.get("type") == "struct":
            found[row[_SCHEMA]] = schema
    return BatchSchemas(sorted(found.items(), key=lambda t: t[0]), flagged,
                        {row[_SCHEMA]: row["n"] for row in texts if row[_SCHEMA] in found})


def first_schemas(spark, src) -> tuple[dict | None, dict | None]:
    """The Connect schemas of the value and of the key of the first message of `src`'s topics
    (None, None: no message yet): a batch read of one message, from the earliest offsets."""
    options = {k: v for k, v in src.reader_options().items() if k not in ("startingOffsets", "maxOffsetsPerTrigger")}
    rows = (spark.read.format("kafka").options(**options, startingOffsets="earliest", endingOffsets="latest").load()
            .where("value IS NOT NULL")
            .selectExpr(f"{SCHEMA_TEXT} AS value", "get_json_object(CAST(key AS STRING), '$.schema') AS key")
            .limit(1).collect())
    if not rows:
        return None, None
    key = rows[0]["key"]
    return schema_of(rows[0]["value"]), json.loads(key) if key else None


@dataclass
class SchemaGroup:
    """Messages whose Connect schemas decode every field alike: the schemas' texts, and the
    schemas merged into one."""

    texts: list[str]
    merged: dict


def schema_groups(schemas: list[tuple[str, dict]]) -> list[SchemaGroup]:
    """`schemas` (text, schema) grouped so that no two of a group decode a field differently
    (one group, but around a column whose type changed at the source)."""
    groups: list[SchemaGroup] = []
    for text, s in schemas:
        for g in groups:
            try:
                g.merged = connect_types.merged([g.merged, s])
            except connect_types.SchemaConflictError:
                continue
            g.texts.append(text)
            break
        else:
            groups.append(SchemaGroup([text], s))
    return groups


def wire_schema(schema: StructType, connect: dict) -> StructType:
    """`schema` as its values are sent (their wire types: a Decimal's base64 text, a Date's
    days), which reading them with no decoding gives."""
    by_name = {f["field"]: f for f in connect.get("fields", [])}
    return StructType([StructField(f.name, connect_types.planned(f.name, f.dataType, by_name.get(f.name), f.name).wire)
                       for f in schema.fields])


def in_group(groups: list[SchemaGroup], i: int, foreign: list[str] = ()) -> str:
    """SQL true for a message of group `i` of `groups`; the first takes the messages of none
    (without a schema, or not JSON), which its decoding quarantines, but those of `foreign`
    schemas (texts)."""
    if i > 0:
        return f"coalesce({SCHEMA_TEXT} IN ({_listed(groups[i].texts)}), false)"
    others = [*(t for g in groups[1:] for t in g.texts), *foreign]
    return f"coalesce({SCHEMA_TEXT} NOT IN ({_listed(others)}), true)" if others else "true"


def in_any(texts: list[str]) -> str:
    """SQL true for a message whose Connect schema is one of `texts`."""
    return f"coalesce({SCHEMA_TEXT} IN ({_listed(texts)}), false)"


def foreign(envelope: str) -> str:
    """SQL of why a message of another table's schema is refused: the first line of its
    corrupt-record text (sink.routing)."""
    return (f"concat('{CANNOT_DECODE} message: its Connect schema ', "
            f"coalesce(get_json_object(CAST(value AS STRING), '$.schema.name'), '?'), "
            f"' is of another table than ', {sql_string(envelope)})")


def table_envelope(batch: BatchSchemas) -> str | None:
    """The name of the Connect schema most of a batch's messages carry: the table's own (a
    Debezium envelope, `<server>.<schema>.<table>.Envelope`), which later batches hold on to."""
    names: dict[str, int] = {}
    for text, schema in batch.schemas:
        if schema.get("name"):
            names[schema["name"]] = names.get(schema["name"], 0) + batch.counts.get(text, 0)
    return min(names, key=lambda n: (-names[n], n)) if names else None


def foreign_schemas(schemas: list[tuple[str, dict]], envelope: str | None) -> tuple[list, list[str]]:
    """`schemas` split into the table's and the texts of other tables': a schema named other
    than the table's `envelope` is another table's (a producer's mistake, or a topic shared by
    two tables), whose fields must not widen this table."""
    own, foreign = [], []
    for text, schema in schemas:
        if envelope is not None and schema.get("name") not in (None, envelope):
            foreign.append(text)
        else:
            own.append((text, schema))
    return own, foreign


def _listed(texts: list[str]) -> str:
    return ", ".join(sql_string(t) for t in texts)


def message_type(groups: list[SchemaGroup]) -> StructType:
    """The Spark type of the records of `groups`: the first to name a field gives its type."""
    found = StructType([])
    for g in groups:
        found = widened(found, connect_types.connect_type(g.merged))
    return found


def reader_options(*, bootstrap_servers: str, topics: list[str], subscribe_pattern: str | None,
                   starting_offsets: str, max_offsets_per_trigger: int | None, fail_on_data_loss: bool,
                   options: dict[str, str]) -> dict[str, str]:
    """Spark's Kafka reader options for the source's keys; `options` (`[source.options]`, e.g.
    `kafka.security.protocol`, `kafka.sasl.jaas.config`) pass through unchanged and win."""
    out = {"kafka.bootstrap.servers": bootstrap_servers, "startingOffsets": starting_offsets,
           "failOnDataLoss": str(fail_on_data_loss).lower()}
    if topics:
        out["subscribe"] = ",".join(topics)
    else:
        out["subscribePattern"] = subscribe_pattern
    if max_offsets_per_trigger is not None:
        out["maxOffsetsPerTrigger"] = str(max_offsets_per_trigger)
    return {**out, **options}


def check_subscription(topics: list[str], subscribe_pattern: str | None) -> None:
    if not isinstance(topics, list) or not all(isinstance(t, str) and t for t in topics):
        raise ConfigError(f"source.topics must be a list of topic names, got {topics!r}")
    if bool(topics) == bool(subscribe_pattern):
        raise ConfigError("source.format = 'kafka' needs exactly one of source.topics (a list of topic names) and "
                          "source.subscribe_pattern (a Java regex of topic names)")


def decoded(raw: DataFrame, schema: StructType, *, value_format: str, key_schema: str | None,
            corrupt_column: str | None, connect: dict | None = None, carried: Mapping[str, str] = {},
            refused: str | None = None) -> DataFrame:
    """The Kafka source's rows (`key`, `value`, `topic`, `partition`, `offset`, ...) as records
    of `schema`, tombstones left out; `corrupt_column` (None: none) is added and set, for a
    message that did not parse, to where it came from and its raw text, and for a value that
    did not decode, to its column, Connect type and raw value first (CANNOT_DECODE). `connect`:
    the messages' Connect schema (merged), by which their values are decoded (None: each value
    read as `schema` says). `carried`: more columns, by name, as SQL over the Kafka rows.
    `refused`: SQL of why every message is refused (the first line of its corrupt-record text)."""
    fields = [f for f in schema.fields if f.name != corrupt_column]
    by_name = {f["field"]: f for f in (connect or {}).get("fields", [])}
    plans = [connect_types.planned(f"{_RECORD}.{quoted_column(f.name)}", f.dataType, by_name.get(f.name), f.name)
             for f in fields]
    wire = [StructField(f.name, p.wire, True) for f, p in zip(fields, plans)]
    record = StructType([*wire, *([StructField(corrupt_column, StringType())] if corrupt_column else [])])
    options = f", map('columnNameOfCorruptRecord', {sql_string(corrupt_column)})" if corrupt_column else ""
    stream = raw.where("value IS NOT NULL").selectExpr("*", f"CAST(value AS STRING) AS {_VALUE}")
    stream = stream.selectExpr("*", f"{_payload(_VALUE, value_format)} AS {_PAYLOAD}")
    parsed = [f"from_json({_PAYLOAD}, {sql_string(record.simpleString())}{options}) AS {_RECORD}"]
    if key_schema:
        key_type = StructType.fromDDL(key_schema)
        parsed.append(f"from_json({_payload('CAST(key AS STRING)', value_format)}, "
                      f"{sql_string(key_type.simpleString())}) AS {_KEY}")
    stream = stream.selectExpr("*", *parsed)
    # Each column decoded once, in a projection of its own: its failure checks read it there.
    stream = stream.selectExpr("*", *(f"{p.sql} AS {_decoded(i)}" for i, p in enumerate(plans)))
    keyed = {f.name for f in StructType.fromDDL(key_schema).fields} if key_schema else set()
    columns = []
    for i, f in enumerate(fields):
        q = quoted_column(f.name)
        columns.append(f"coalesce({_decoded(i)}, {_KEY}.{q}) AS {q}" if f.name in keyed else f"{_decoded(i)} AS {q}")
    columns += [f"{_KEY}.{quoted_column(n)} AS {quoted_column(n)}" for n in sorted(keyed - {f.name for f in fields})]
    columns += [f"{sql} AS {quoted_column(name)}" for name, sql in carried.items()]
    if corrupt_column:
        failed = f"{_PAYLOAD} IS NULL OR {_RECORD} IS NULL OR {_RECORD}.{quoted_column(corrupt_column)} IS NOT NULL"
        where = "concat('kafka topic ', topic, ' partition ', partition, ' offset ', offset)"
        whens = [f"WHEN true THEN concat({refused}, '\\n', {where}, ': ', {_VALUE})"] if refused else []
        whens.append(f"WHEN {failed} THEN concat({where}, ': ', {_VALUE})")
        for i, failure in ((i, x) for i, p in enumerate(plans) for x in p.failures):
            # One line: the reason; the raw value's line breaks would end it early.
            value = f"translate(left({failure.raw}, 200), '\\n\\r', '  ')"
            reason = sql_string(f"{CANNOT_DECODE} column {failure.path} (")
            whens.append(f"WHEN {failure.failed_in(_decoded(i))} THEN concat({reason}, {sql_string(failure.connect)}, "
                         f"') value ', {value}, '\\n', {where}, ': ', {_VALUE})")
        columns.append(f"CASE {' '.join(whens)} END AS {quoted_column(corrupt_column)}")
    return stream.selectExpr(*columns)


def _decoded(i: int) -> str:
    return f"__kafka_decoded_{i}"


def lag(end_offset: str | None, latest_offset: str | None) -> dict[tuple[str, int], int]:
    """Per (topic, partition): the offsets behind, from a batch's progress (Spark's Kafka source
    reports `endOffset`, where the batch ended, and `latestOffset`, the newest it saw, as JSON
    `{"topic": {"partition": offset}}`); empty when the progress has either missing: JSON
    null, as in a trigger that found no new offsets, or "None", PySpark's text for a Java null,
    as in the first batch after a restart, which replays an offset range already planned and
    asks the source for no newest offset."""
    end, latest = (json.loads(o) if o and o != "None" else None for o in (end_offset, latest_offset))
    if not end or not latest:
        return {}
    return {(topic, int(p)): max(0, newest - end.get(topic, {}).get(p, 0))
            for topic, partitions in latest.items() for p, newest in partitions.items()}


class KafkaLag(StreamingQueryListener):
    """After each batch of a query reading Kafka: its offsets behind per topic-partition, as
    `upsert_sink_kafka_lag` and a log line (each query `watch`ed: its name to its sink's writer id)."""

    def __init__(self):
        self._writers: dict[str, str] = {}

    def watch(self, query_name: str, writer_id: str) -> None:
        self._writers[query_name] = writer_id

    def onQueryProgress(self, event) -> None:
        publish_lag(self._writers.get(event.progress.name), event.progress)

    def onQueryStarted(self, event) -> None:
        pass

    def onQueryIdle(self, event) -> None:
        pass

    def onQueryTerminated(self, event) -> None:
        pass


class ProgressPoll:
    """Each query's latest progress, once per batch, as its Kafka lag: Spark Connect's way,
    where the client reads `lastProgress` instead of listening. Called with the job's tables
    (jobs.supervisor.Table: a writer id and its query)."""

    def __init__(self):
        self._published: dict[str, int] = {}

    def __call__(self, tables) -> None:
        for table in tables:
            progress = table.query.lastProgress if table.query is not None else None
            if progress is not None and self._published.get(table.writer_id) != progress.batchId:
                self._published[table.writer_id] = progress.batchId
                publish_lag(table.writer_id, progress)


def publish_lag(writer_id: str | None, progress) -> None:
    """A query's progress (`StreamingQueryProgress`) as its Kafka lag (nothing for other sources)."""
    if writer_id is None or progress is None:
        return
    behind = {}
    for source in progress.sources:
        behind.update(lag(source.endOffset, source.latestOffset))
    if not behind:
        return
    for (topic, partition), n in behind.items():
        metrics.KAFKA_LAG.labels(writer_id, topic, str(partition)).set(n)
    log.info("kafka lag %s after batch %s: %d offsets behind (%s)", writer_id, progress.batchId, sum(behind.values()),
             ", ".join(f"{t}[{p}]={n}" for (t, p), n in sorted(behind.items())))


def _payload(text: str, value_format: str) -> str:
    """SQL for the JSON text of a message's record: the text itself, or its converter wrapper's
    payload (null where the message has none)."""
    if value_format == "json":
        return text
    return f"from_json({text}, 'schema STRING, payload STRING').payload"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    shown = parser.add_mutually_exclusive_group()
    shown.add_argument("--jar", action="store_true", help="print the jar's path in ~/.m2 instead")
    shown.add_argument("--fetch-command", action="store_true", help="print the command that fetches it instead")
    args = parser.parse_args()
    print(spark_delta.local_jar(coordinate=package()) if args.jar else fetch_command() if args.fetch_command
          else package())


if __name__ == "__main__":
    main()
