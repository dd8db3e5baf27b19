"""The streaming job: a landing directory of JSON/CSV/Parquet files, or Kafka topics -> UpsertSink -> Delta.

    spark-submit jobs/upsert_stream.py --config conf/sink.toml [--once]
    python -m jobs.upsert_stream --config conf/sink.toml --trigger-seconds 30
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import logging
import os
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a file by spark-submit
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from deltalake import DeltaTable  # noqa: E402
from pyspark.sql.types import LongType, StringType, StructField, StructType  # noqa: E402

from jobs import connect_types, kafka_source, key_changes  # noqa: E402
from jobs.envelopes import DEBEZIUM_COLUMNS, UNAVAILABLE_VALUE, debezium_select, unavailable_guard  # noqa: E402
from jobs.job_config import KEY_FROM_MESSAGES, JobConfig, SourceConfig, load_job_config  # noqa: E402
from jobs.mirror import MirrorDiscovery, NoMessageError, kafka_topics  # noqa: E402
from jobs.spark_session import spark_session  # noqa: E402
from jobs.supervisor import Table, supervise  # noqa: E402
from sink import SinkConfig, UpsertSink  # noqa: E402
from sink.columns import PREFIX  # noqa: E402
from sink.config.options import HIDDEN_ORDERING_PREFIX  # noqa: E402
from sink.config.sections import ENGINES  # noqa: E402
from sink.errors import ConfigError  # noqa: E402
from sink.history import HISTORY_COLUMNS  # noqa: E402
from sink.keys import quoted_column  # noqa: E402
from sink.routing import PARSED_FORMATS  # noqa: E402
from sink.session import session_kind  # noqa: E402

log = logging.getLogger("jobs.upsert_stream")
# Columns of a table that are the sink's, not the source's.
RESERVED_PREFIXES = (PREFIX, HIDDEN_ORDERING_PREFIX)


# A Debezium envelope whose row's columns all come from the messages.
ENVELOPE = StructType([StructField("op", StringType()), StructField("ts_ms", LongType()),
                       StructField("source", StructType([StructField("lsn", LongType())])),
                       StructField("before", StructType([])), StructField("after", StructType([]))])


def declared_schema(src: SourceConfig) -> StructType:
    """`source.schema`; where it is left to the messages, a Debezium envelope without columns."""
    if src.schema is not None:
        return StructType.fromDDL(src.schema)
    return ENVELOPE if src.envelope == "debezium" else StructType([])


def source_schema(cfg: JobConfig, src: SourceConfig | None = None) -> tuple[StructType, dict[str, str]]:
    """The source's schema and reader options: for JSON, CSV and Kafka's JSON messages (unless
    source.corrupt_records is off) with the sink's corrupt-record column, which PERMISSIVE
    reading fills with the raw text of a record that did not parse (instead of only nulling
    its bad values). `src`: a table's source (default: `[source]`)."""
    src = src or cfg.source
    schema = declared_schema(src)
    options = src.reader_options()
    if src.format == "kafka":
        if src.corrupt_records and cfg.corrupt_record_column not in schema.fieldNames():
            schema = schema.add(cfg.corrupt_record_column, StringType(), True)
        return schema, options
    if src.format in PARSED_FORMATS and src.corrupt_records:
        name = cfg.corrupt_record_column
        if name not in schema.fieldNames():
            schema = schema.add(name, StringType(), True)
        options["columnNameOfCorruptRecord"] = name
    return schema, options


def selected(stream, select: list[str], corrupt_column: str):
    """The stream through `[source] select`, keeping the corrupt-record column the expressions
    leave out (records that did not parse must still reach the quarantine)."""
    if not select:
        return stream
    out = stream.selectExpr(*select)
    if corrupt_column in stream.columns and corrupt_column not in out.columns:
        out = stream.selectExpr(*select, quoted_column(corrupt_column))
    return out


def source_stream(spark, cfg: JobConfig, src: SourceConfig | None = None, schema: StructType | None = None):
    """A source as its sink sees it: read, its envelope flattened, selected (`src`: a table's
    source, default `[source]`; `schema`: its records' as `resolved`, default source_schema's)."""
    src = src or cfg.source
    own, options = source_schema(cfg, src)
    schema = schema or own
    if src.format == "kafka":
        return kafka_records(kafka_stream(spark, cfg, src), cfg, src, schema)
    reader = spark.readStream.format(src.format).schema(schema).options(**options)
    if src.max_files_per_trigger:
        reader = reader.option("maxFilesPerTrigger", src.max_files_per_trigger)
    return flattened(reader.load(src.path), cfg, src, schema)


def kafka_stream(spark, cfg: JobConfig, src: SourceConfig):
    """The Kafka source's rows (key, value, topic, partition, offset, ...; with a Debezium
    envelope decoded batch by batch, the headers, which name a key change's old key)."""
    reader = spark.readStream.format("kafka").options(**source_schema(cfg, src)[1])
    if src.decodes_per_batch and src.envelope == "debezium":
        reader = reader.option("includeHeaders", "true")
    return reader.load()


def kafka_records(raw, cfg: JobConfig, src: SourceConfig, schema: StructType, connect: dict | None = None,
                  resolve=None, refused: str | None = None):
    """Kafka rows (a stream, or one batch's) as the sink sees them, their values parsed into
    `schema` (decoded by their Connect schema `connect`, merged, when known). `resolve`: of a
    Debezium envelope's flattened records with their old key (key_changes.OLD_KEY), before
    `select`; `refused`: SQL of why every message goes to quarantine (kafka_source.decoded)."""
    corrupt = cfg.corrupt_record_column if src.corrupt_records else None
    carried = {key_changes.OLD_KEY: key_changes.OLD_KEY_SQL} if resolve else {}
    stream = kafka_source.decoded(raw, schema, value_format=src.value_format, key_schema=src.key_schema,
                                  corrupt_column=corrupt, connect=connect, carried=carried, refused=refused)
    return flattened(stream, cfg, src, schema, resolve)


def flattened(stream, cfg: JobConfig, src: SourceConfig, schema: StructType, resolve=None):
    """Records read with `schema`: their envelope flattened, then selected (`resolve`: of the
    flattened records with their old key, key_changes.OLD_KEY, which it drops)."""
    if src.envelope == "debezium":
        carried = (key_changes.OLD_KEY,) if resolve else ()
        stream = selected(stream, debezium_select(schema, carried), cfg.corrupt_record_column)
    if resolve:
        stream = resolve(stream).drop(key_changes.OLD_KEY)
    return selected(stream, src.select, cfg.corrupt_record_column)


def with_table_columns(schema: StructType, src: SourceConfig, table_uri: str) -> StructType:
    """`schema` with the columns the Delta table at `table_uri` has and it lacks, of the
    table's types (for a Debezium envelope, in `before` and `after`): a column the job added
    from the messages (or another writer added) is read again after a restart, instead of the
    sink refusing a stream without it. Not through `source.select`, whose names are the user's."""
    if src.select or not DeltaTable.is_deltatable(table_uri):
        return schema
    stored = StructType.fromJson(json.loads(DeltaTable(table_uri).schema().to_json()))
    own = set(DEBEZIUM_COLUMNS) if src.envelope == "debezium" else set()
    row = StructType([f for f in stored.fields if f.name not in own and not f.name.startswith(RESERVED_PREFIXES)
                      and f.name not in HISTORY_COLUMNS])
    if src.envelope != "debezium":
        return kafka_source.widened(schema, row)
    return kafka_source.widened(schema, StructType([StructField("before", row), StructField("after", row)]),
                                ("before", "after"))


def resolved(spark, cfg: JobConfig, sink: SinkConfig, src: SourceConfig) -> tuple[SinkConfig, StructType]:
    """A table's config and its source's schema as the job reads them: with the columns its
    Delta table has (`with_table_columns`), and where the config leaves the key or the row's
    columns to the messages, those the first message's Connect schemas give (its key's fields
    are the table's primary key); later columns arrive batch by batch."""
    schema = source_schema(cfg, src)[0]
    if src.format != "kafka":
        return sink, schema
    schema = with_table_columns(schema, src, sink.table_uri)
    unkeyed = sink.key == [KEY_FROM_MESSAGES]
    rowless = src.keys_from_messages and "after" in schema.fieldNames() and not schema["after"].dataType.fields
    if not (unkeyed or rowless):
        return sink, schema
    value, key = kafka_source.first_schemas(spark, src)
    if value is None:
        raise NoMessageError(f"{src.name} holds no message yet, and the table {sink.table_uri} leaves its key and "
                             "columns to the messages: set key, and the key's columns in source.schema, or start the "
                             "job once the topic has a message")
    schema = kafka_source.widened(schema, connect_types.connect_type(value), ("before", "after"))
    if unkeyed:
        fields = [f.get("field") for f in (key or {}).get("fields", [])]
        if not fields:
            raise ConfigError(f"key: the message keys of {src.name} carry no Connect schema to take the table's key "
                              "from (the key converter's schemas.enable = false?): set key for table "
                              f"{sink.table_uri}")
        log.info("%s: key %s, from the message key's Connect schema", sink.table_uri, fields)
        sink = dataclasses.replace(sink, key=fields)
    return sink, schema


class DecodedPerBatch:
    """foreachBatch of a `json-with-schema` Kafka source: each batch's Kafka rows decoded by the
    Connect schemas its messages carry, parsed with the source's schema (widened by their
    fields under `schema_from_messages`: for a Debezium envelope, within `before` and
    `after`), then handed to the sink, which adds the new columns. A widened schema is kept
    for later batches, so a column keeps the type it first got. A Debezium envelope named
    other than the one most of the first batch's messages carry is another table's: its
    messages go to quarantine."""

    def __init__(self, sink: UpsertSink, cfg: JobConfig, src: SourceConfig, schema: StructType):
        self.sink, self.cfg, self.src, self.schema = sink, cfg, src, schema
        self.envelope: str | None = None  # the name of the table's Debezium envelope schema, once seen

    def __call__(self, raw, batch_id: int) -> None:
        cfg = self.sink.config
        moves = self.src.envelope == "debezium" and cfg.unchanged_value is not None
        batch = kafka_source.message_schemas(raw, key_changes.flag_sql(cfg.unchanged_value) if moves else None)
        schemas, moved = batch.schemas, batch.flagged
        if self.src.envelope == "debezium":
            self.envelope = self.envelope or kafka_source.table_envelope(batch)
            schemas, foreign = kafka_source.foreign_schemas(schemas, self.envelope)
        else:
            foreign = []
        groups = kafka_source.schema_groups(schemas)
        resolve = functools.partial(key_changes.resolved, key=cfg.key, ordering=cfg.ordering_columns[0],
                                    placeholder=cfg.unchanged_value, table_uri=cfg.table_uri) if moved else None
        if self.src.widens:
            within = ("before", "after") if self.src.envelope == "debezium" else ()
            schema = kafka_source.widened(self.schema, kafka_source.message_type(groups), within)
            if schema != self.schema:
                log.info("%s: batch %d's messages widen source.schema to %s", self.sink.writer_id, batch_id,
                         schema.simpleString())
                self.schema = schema
        if len(groups) > 1:
            log.info("%s: batch %d's messages decode a column in %d ways (its type changed at the source): each "
                     "group is decoded by its own schemas", self.sink.writer_id, batch_id, len(groups))
        parts = [kafka_records(raw.where(kafka_source.in_group(groups, i, foreign)), self.cfg, self.src, self.schema,
                               g.merged, resolve) for i, g in enumerate(groups)] or \
            [kafka_records(raw.where(f"NOT {kafka_source.in_any(foreign)}") if foreign else raw, self.cfg, self.src,
                           self.schema)]
        if foreign:  # another table's messages: quarantined, their fields not this table's
            parts.append(kafka_records(raw.where(kafka_source.in_any(foreign)), self.cfg, self.src, self.schema,
                                       refused=kafka_source.foreign(self.envelope)))
        self.sink(functools.reduce(lambda a, b: a.unionByName(b), parts), batch_id)


# How often the job looks at its queries (under Spark Connect, for their Kafka lag).
POLL_SECONDS = 5


def for_debezium(sink: SinkConfig, src: SourceConfig, columns: list[str],
                 schema: StructType | None = None) -> SinkConfig:
    """A Debezium table's config: Debezium's placeholder for a value it did not receive
    (PostgreSQL's unchanged TOAST values under REPLICA IDENTITY DEFAULT) is its `unchanged_value`,
    so an update keeps the stored value. Where nothing stored can stand in, the records holding
    it go to quarantine: creates and snapshot reads (a primary key change's create carries the
    placeholder for its old key's value), and every event of a history table (scd_type = 2) or
    of a stream without `op`, where creates cannot be told apart. Its freshness is measured
    from the envelope's `ts_ms` unless `freshness_column` says otherwise. `schema`: the
    envelope's, as the job reads it (default: as `src` declares it)."""
    if src.envelope != "debezium":
        return sink
    changes = {}
    if sink.unchanged_value is None:
        keeps = sink.scd_type != 2 and "op" in columns
        guard = unavailable_guard(schema or declared_schema(src), columns, ("c", "r") if keeps else ())
        if keeps:
            changes["unchanged_value"] = UNAVAILABLE_VALUE
        if guard:
            given = sink.quarantine_when
            changes["quarantine_when"] = f"({given}) OR {guard}" if given else guard
    if sink.freshness_column is None and "ts_ms" in columns:
        changes["freshness_column"] = "ts_ms"
    return dataclasses.replace(sink, **changes)


def start_query(stream, cfg: JobConfig, sink: UpsertSink, once: bool, trigger_seconds: int | None,
                src: SourceConfig | None = None, schema: StructType | None = None):
    """One table's query: its own checkpoint (so its own progress and writer id). Under
    `src.decodes_per_batch` it streams the Kafka rows, decoded batch by batch (`schema`: the
    records' as `resolved`)."""
    sink.validate(stream)  # a config naming a missing column fails here, before any batch
    foreach = sink
    if src is not None and src.decodes_per_batch:
        stream, foreach = kafka_stream(stream.sparkSession, cfg, src), DecodedPerBatch(
            sink, cfg, src, schema or source_schema(cfg, src)[0])
    writer = stream.writeStream.foreachBatch(foreach).option("checkpointLocation", sink.config.checkpoint_dir)
    if once:
        writer = writer.trigger(availableNow=True)
    else:
        writer = writer.trigger(processingTime=f"{trigger_seconds or cfg.job.trigger_seconds} seconds")
    return writer.queryName(query_name(cfg, sink.config)).start()


def _started(stream, cfg: JobConfig, sink: UpsertSink, once: bool, trigger_seconds: int | None,
             src: SourceConfig, schema: StructType):
    query = start_query(stream, cfg, sink, once, trigger_seconds, src, schema)
    log.info("query %s started: %s -> %s (writer_id %s)", query.id, src.name, sink.config.table_uri, sink.writer_id)
    return query


def table_query(spark, cfg: JobConfig, sink: SinkConfig, src: SourceConfig, once: bool,
                trigger_seconds: int | None) -> tuple[UpsertSink, Table]:
    """A table's sink, and its query as the supervisor starts it (not started yet)."""
    sink, schema = resolved(spark, cfg, sink, src)
    stream = source_stream(spark, cfg, src, schema)
    upsert = UpsertSink(for_debezium(sink, src, stream.columns, schema))
    return upsert, Table(upsert.config.table_uri, upsert.writer_id,
                         functools.partial(_started, stream, cfg, upsert, once, trigger_seconds, src, schema))


def query_name(cfg: JobConfig, sink: SinkConfig) -> str:
    return cfg.job.app_name if len(cfg.sinks) == 1 and not cfg.mirror else f"{cfg.job.app_name}:{sink.table_uri}"


def run(config_path: str, once: bool, trigger_seconds: int | None = None, master: str | None = None,
        metrics_port: int | None = None, stop: bool = False, *, remote: str | None = None,
        engine: str | None = None) -> list[UpsertSink]:
    """Every `[[sink]]` table's query on one Spark session, until they end (`once`: each
    processes what is there); a query that fails is started again after a backoff while the
    others go on (jobs.supervisor), and a table that keeps failing raises TablesFailedError
    once the others have ended.
    `metrics_port`: instead of the config's; `stop`: stop Spark once the sinks have released
    their replicas (left to the process's exit, the executors were killed: hundreds of lines
    of executor loss on a standalone cluster, and their replicas left dirty). `remote`: run
    through Spark Connect (instead of job.remote); the sinks returned are then the client's
    copies, which see no batch: the server's Python worker runs them. `engine`: every table's,
    instead of the config's; with "delta-spark" the session gets Delta's package, extension
    and catalog (where this process starts Spark: spark-submit's `--packages` and `--conf`
    otherwise)."""
    cfg = load_job_config(config_path)
    overrides = {k: v for k, v in (("metrics_port", metrics_port), ("engine", engine)) if v is not None}
    cfg.sinks = [dataclasses.replace(s, **overrides) for s in cfg.sinks]
    if cfg.mirror and overrides:
        cfg.mirror = dataclasses.replace(cfg.mirror, sink={**cfg.mirror.sink, **overrides})
    unset = [s.table_uri for s in cfg.sinks if not s.checkpoint_dir]
    if unset:
        raise SystemExit(f"set checkpoint_dir for {unset} in the config: each table's query needs a checkpoint "
                         "location")
    remote = remote or cfg.job.remote
    ports = [s.metrics_port for s in cfg.sinks if s.metrics_port]
    if remote and len(ports) != len(set(ports)):
        raise ConfigError(f"[[sink]] tables share metrics_port {sorted(ports)}: under Spark Connect each table's "
                          "query runs its sink in a process of its own on the server; give each its own metrics_port")
    if remote and cfg.mirror:
        raise ConfigError("[mirror] lists the broker's topics with Kafka's admin client in the job's JVM, which a "
                          "Spark Connect client has not: run a mirror as a classic job (spark-submit, or job.master), "
                          "or name each table in a [[sink]]")
    if remote:
        log.info("connecting to Spark Connect at %s (its server's master runs the queries)", remote)
    else:
        log.info("starting Spark (%s); a local session takes 10-30 s", master or cfg.job.master or
                 "spark-submit's master")
    started = time.monotonic()
    delta = any(s.engine == "delta-spark" for s in cfg.tables)
    spark = spark_session(cfg.job.app_name, master or cfg.job.master, remote=remote, delta=delta,
                          kafka=cfg.mirror is not None or any(src.format == "kafka" for src in cfg.sources))
    session_kind(spark).set_log_level(cfg.job.spark_log_level)
    log.info("Spark ready in %.0f s", time.monotonic() - started)
    for src in cfg.sources:
        if src.path and "://" not in src.path:
            Path(src.path).mkdir(parents=True, exist_ok=True)  # a file stream needs the dir
    sinks, tables = [], []

    def build(sink: SinkConfig, src: SourceConfig) -> Table:
        upsert, table = table_query(spark, cfg, sink, src, once, trigger_seconds)
        sinks.append(upsert)
        if lag:
            lag.watch(query_name(cfg, upsert.config), upsert.writer_id)
        return table

    kafka = cfg.mirror is not None or any(src.format == "kafka" for src in cfg.sources)
    # The Kafka lag: a listener in a classic session; under Spark Connect a listener would run
    # on the server, away from these metrics, so the wait below polls the queries' progress.
    lag = kafka_source.KafkaLag() if kafka and not remote else None
    tables = [build(s, src) for s, src in zip(cfg.sinks, cfg.sources)]
    discovery = MirrorDiscovery(
        cfg.mirror, functools.partial(kafka_topics, spark, cfg.mirror.source), build,
        taken={t for src in cfg.sources for t in src.topics},
        locations={p for s in cfg.sinks for p in (s.table_uri, s.checkpoint_dir)},
        every=None if once else cfg.mirror.discover_seconds) if cfg.mirror else None
    if lag:
        spark.streams.addListener(lag)
    progress = kafka_source.ProgressPoll() if kafka else None
    # A query this session ran before (an earlier run in the process) would end the wait at once.
    spark.streams.resetTerminated()
    try:
        supervise(spark.streams, tables, cfg.job.backoff, poll_seconds=POLL_SECONDS,
                  polled=progress if remote else None, discovery=discovery)
    finally:
        for table in tables:
            if table.query is not None and table.query.isActive:
                table.query.stop()
        if lag:
            spark.streams.removeListener(lag)
        if progress:  # the last batch's, which the listener or the poll may not have had yet
            progress(tables)
        for sink in sinks:
            sink.close()
        if stop:
            spark.stop()
    return sinks


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="TOML file with [sink], [source] and [job] tables")
    parser.add_argument("--once", action="store_true", help="process what is in the landing dir, then stop")
    parser.add_argument("--trigger-seconds", type=int, help="processing-time trigger interval")
    parser.add_argument("--master", help="Spark master (default: spark-submit's, or job.master)")
    parser.add_argument("--remote", help="run through Spark Connect: sc://host:port, or local[N] for a server this "
                        "process starts (default: job.remote)")
    parser.add_argument("--engine", choices=ENGINES, help="every table's Delta engine (default: each table's engine)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("py4j").setLevel(logging.WARNING)
    if args.master and args.remote:
        parser.error("--master and --remote exclude each other: under Spark Connect the server's master runs the job")
    try:
        run(args.config, args.once, args.trigger_seconds, args.master, stop=True, remote=args.remote,
            engine=args.engine)
    except Exception:
        # `run` closed the sinks and stopped Spark. Exit with the error's code now: the
        # interpreter's teardown with native threads of a failed query still alive (Arrow,
        # delta-rs, gRPC under Connect) aborted now and then ("terminate called without an
        # active exception", exit 134 instead of 1).
        log.exception("the job failed")
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)


if __name__ == "__main__":
    main()
