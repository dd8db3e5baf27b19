"""The ready job's config: the sink's `[sink]` table (or several `[[sink]]` tables, each
table fed from the one source by a query of its own), or `[mirror]` (a table per topic:
jobs.mirror), or both, plus `[source]` and `[job]`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jobs import kafka_source
from jobs.envelopes import ENVELOPES
from jobs.mirror import SAMPLE_TOPIC, MirrorConfig
from jobs.supervisor import Backoff
from sink.config.sink_config import SINK_SOURCE, SinkConfig, read_toml, sink_tables, without_source
from sink.errors import ConfigError
from sink.routing import PARSED_FORMATS

FILE_FORMATS = (*PARSED_FORMATS, "parquet")
SOURCE_FORMATS = (*FILE_FORMATS, "kafka")
# The keys only a Kafka source reads (jobs/kafka_source.py), with their defaults.
KAFKA_KEYS = ("bootstrap_servers", "topics", "subscribe_pattern", "starting_offsets", "max_offsets_per_trigger",
              "fail_on_data_loss", "value_format", "key_schema", "schema_from_messages")


@dataclass
class SourceConfig:
    """What the job streams from: a landing directory of files (`path`), or Kafka topics."""

    # Spark DDL of the records (for an envelope, of the envelope). Optional where messages
    # carry their Connect schemas (json-with-schema): the columns then come from them.
    schema: str | None = None
    format: str = "json"
    path: str | None = None
    max_files_per_trigger: int | None = None
    options: dict[str, str] = field(default_factory=dict)
    # JSON and CSV: read with the sink's corrupt-record column, so a record with a value that did
    # not parse goes to quarantine with its raw text instead of writing nulls over stored data.
    corrupt_records: bool = True
    # Spark SQL expressions the records are selected through before the sink sees them (empty:
    # as read), e.g. a CDC envelope's fields: "coalesce(after.id, before.id) AS id", "source.lsn AS lsn".
    # With an envelope, they apply to its flattened columns (e.g. "*", "date_format(...) AS month").
    select: list[str] = field(default_factory=list)
    # A CDC envelope the job flattens first (jobs/envelopes.py): "none" or "debezium".
    envelope: str = "none"
    # Kafka (format = "kafka"): the brokers, the topics (a list, or a Java regex), where a new
    # query starts ("earliest", "latest" or Spark's JSON of offsets per partition), a cap on
    # the offsets per batch, whether lost offsets fail the query, and how messages are encoded.
    bootstrap_servers: str | None = None
    topics: list[str] = field(default_factory=list)
    subscribe_pattern: str | None = None
    starting_offsets: str = "earliest"
    max_offsets_per_trigger: int | None = None
    fail_on_data_loss: bool = True
    value_format: str = "json"
    key_schema: str | None = None
    # json-with-schema: each batch's schema widened by the fields its messages' Connect schemas
    # carry, so a column added at the source arrives without a restart (jobs/kafka_source.py).
    # Default: on with json-with-schema, which it needs.
    schema_from_messages: bool | None = None

    @property
    def decodes_per_batch(self) -> bool:
        """Each batch's values are decoded by the Connect schemas its messages carry (the JSON
        converter's wrapper names them)."""
        return self.format == "kafka" and self.value_format == "json-with-schema"

    @property
    def keys_from_messages(self) -> bool:
        """A Debezium table's key may come from its message keys' Connect schemas (its primary key)."""
        return self.decodes_per_batch and self.envelope == "debezium"

    @property
    def widens(self) -> bool:
        """Batches widen `schema` by the fields their messages carry (`schema_from_messages`,
        on by default where messages carry their schemas)."""
        return self.decodes_per_batch if self.schema_from_messages is None else self.schema_from_messages

    @property
    def name(self) -> str:
        """The source as log lines name it."""
        if self.format != "kafka":
            return str(self.path)
        return f"kafka {','.join(self.topics) or self.subscribe_pattern} at {self.bootstrap_servers}"

    def reader_options(self) -> dict[str, str]:
        if self.format != "kafka":
            return dict(self.options)
        return kafka_source.reader_options(
            bootstrap_servers=self.bootstrap_servers, topics=self.topics, subscribe_pattern=self.subscribe_pattern,
            starting_offsets=self.starting_offsets, max_offsets_per_trigger=self.max_offsets_per_trigger,
            fail_on_data_loss=self.fail_on_data_loss, options=self.options)

    def _check_kafka(self) -> None:
        if not isinstance(self.bootstrap_servers, str) or not self.bootstrap_servers:
            raise ConfigError("source.format = 'kafka' needs source.bootstrap_servers, e.g. "
                              "'broker1:9092,broker2:9092'")
        kafka_source.check_subscription(self.topics, self.subscribe_pattern)
        if self.path is not None or self.max_files_per_trigger is not None:
            raise ConfigError("source.path and source.max_files_per_trigger are for files: a Kafka source reads "
                              "source.topics (or source.subscribe_pattern); cap a batch with max_offsets_per_trigger")
        if self.value_format not in kafka_source.VALUE_FORMATS:
            raise ConfigError(f"source.value_format = {self.value_format!r} is not accepted; accepted values: "
                              f"{list(kafka_source.VALUE_FORMATS)}")
        if not isinstance(self.fail_on_data_loss, bool):
            raise ConfigError(f"source.fail_on_data_loss must be true or false, got {self.fail_on_data_loss!r}")
        if self.max_offsets_per_trigger is not None and (
            not isinstance(self.max_offsets_per_trigger, int) or self.max_offsets_per_trigger < 1
        ):
            raise ConfigError(f"source.max_offsets_per_trigger must be a positive integer, got "
                              f"{self.max_offsets_per_trigger!r}")
        if self.key_schema is not None and self.envelope != "none":
            raise ConfigError("source.key_schema is for plain records: a Debezium envelope's before and after "
                              "carry the key columns already")

    def __post_init__(self) -> None:
        if self.format not in SOURCE_FORMATS:
            raise ConfigError(
                f"source.format = {self.format!r} is not accepted; accepted values: {list(SOURCE_FORMATS)}"
            )
        if self.schema is None and not (self.format == "kafka" and self.value_format == "json-with-schema"):
            raise ConfigError("source.schema is required (a Spark DDL string, e.g. 'id STRING, ts TIMESTAMP'), but "
                              "with format = 'kafka' and value_format = 'json-with-schema', whose messages carry "
                              "their schema")
        if self.schema is not None and (not isinstance(self.schema, str) or not self.schema.strip()):
            raise ConfigError("source.schema must be a Spark DDL string, e.g. 'id STRING, ts TIMESTAMP'")
        if not isinstance(self.select, list) or not all(isinstance(e, str) and e.strip() for e in self.select):
            raise ConfigError(f"source.select must be a list of Spark SQL expressions, got {self.select!r}")
        if self.envelope not in ENVELOPES:
            raise ConfigError(f"source.envelope = {self.envelope!r} is not accepted; accepted values: "
                              f"{list(ENVELOPES)}")
        if not isinstance(self.corrupt_records, bool):
            raise ConfigError(f"source.corrupt_records must be true or false, got {self.corrupt_records!r}")
        if self.schema_from_messages is not None and not isinstance(self.schema_from_messages, bool):
            raise ConfigError(f"source.schema_from_messages must be true or false, got {self.schema_from_messages!r}")
        if self.schema_from_messages and (self.format != "kafka" or self.value_format != "json-with-schema"):
            raise ConfigError("source.schema_from_messages reads the schema Kafka Connect's JSON converter wraps each "
                              "message in: it needs format = 'kafka' and value_format = 'json-with-schema'")
        if self.format == "kafka":
            self._check_kafka()
        else:
            if not isinstance(self.path, str) or not self.path:
                raise ConfigError(f"source.format = {self.format!r} reads files: set source.path to their landing "
                                  "directory")
            given = [f.name for f in dataclasses.fields(self)
                     if f.name in KAFKA_KEYS and getattr(self, f.name) != _default(f)]
            if given:
                raise ConfigError(f"source key(s) {given} are read by source.format = 'kafka' only, not "
                                  f"{self.format!r}")
        if self.max_files_per_trigger is not None and (
            not isinstance(self.max_files_per_trigger, int) or self.max_files_per_trigger < 1
        ):
            raise ConfigError(
                f"source.max_files_per_trigger must be a positive integer, got {self.max_files_per_trigger!r}"
            )


SPARK_LOG_LEVELS = ("ALL", "TRACE", "DEBUG", "INFO", "WARN", "ERROR", "FATAL", "OFF")


@dataclass
class JobSettings:
    app_name: str = "delta-upsert-sink"
    master: str | None = None
    # A Spark Connect server to run the queries through (`sc://host:port`, or `local[N]`: one
    # this process starts); the foreachBatch function then runs in the server's Python worker.
    remote: str | None = None
    trigger_seconds: int = 10
    # Spark's own log level once the session runs (spark-submit defaults to INFO: hundreds
    # of lines around the sink's one line per batch).
    spark_log_level: str = "WARN"
    # A table whose query fails is started again (the other tables going on) after a wait of
    # restart_backoff_seconds, doubling up to restart_backoff_max_seconds; after max_restarts
    # failures in a row it stays stopped, and the job ends with an error once the others end.
    restart_backoff_seconds: float = 10
    restart_backoff_max_seconds: float = 300
    max_restarts: int = 5

    def __post_init__(self) -> None:
        if self.spark_log_level not in SPARK_LOG_LEVELS:
            raise ConfigError(f"job.spark_log_level = {self.spark_log_level!r} is not accepted; accepted values: "
                              f"{list(SPARK_LOG_LEVELS)}")
        for name in ("restart_backoff_seconds", "restart_backoff_max_seconds"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
                raise ConfigError(f"job.{name} must be a number of seconds >= 0, got {value!r}")
        if isinstance(self.max_restarts, bool) or not isinstance(self.max_restarts, int) or self.max_restarts < 0:
            raise ConfigError(f"job.max_restarts must be an integer >= 0 (0: a failed table stays stopped), got "
                              f"{self.max_restarts!r}")

    @property
    def backoff(self) -> Backoff:
        return Backoff(self.restart_backoff_seconds, self.restart_backoff_max_seconds, self.max_restarts)


@dataclass
class JobConfig:
    sinks: list[SinkConfig]  # one query each
    # Each sink's source: `[source]` with its table's `[sink.source]` keys over it (a topic and
    # schema of its own, say).
    sources: list[SourceConfig]
    job: JobSettings
    # A table per topic `[source]`'s subscribe_pattern matches, but those `sinks` read.
    mirror: MirrorConfig | None = None

    def __post_init__(self) -> None:
        if self.mirror is not None:
            shared = [src.name for src in self.sources if not src.topics]
            if shared:
                raise ConfigError(f"with [mirror], each [[sink]] names its topics in [sink.source] (topics = [...]): "
                                  f"{shared} would read the topics the mirror makes tables of")
        for name in ("table_uri", "checkpoint_dir"):
            values = [getattr(s, name) for s in self.sinks]
            repeated = sorted({v for v in values if v is not None and values.count(v) > 1})
            if repeated:
                raise ConfigError(f"[[sink]] tables share {name} {repeated}: each table needs its own table_uri "
                                  "and its own checkpoint_dir (its query's checkpoint, and so its writer id)")
        columns = {s.corrupt_record_column for s in self.tables}
        if len(columns) > 1:
            raise ConfigError(f"[[sink]] tables name different corrupt_record_column values {sorted(columns)}: the "
                              "one source is read with one corrupt-record column; name the same in every table")

    @property
    def tables(self) -> list[SinkConfig]:
        """The `[[sink]]` tables, and the mirror's as a topic's table would be."""
        return [*self.sinks, *([self.mirror.table(SAMPLE_TOPIC)[0]] if self.mirror else [])]

    @property
    def source(self) -> SourceConfig:
        """The first table's source: every table's where none has a `[sink.source]` (the
        mirror's `[source]` where it has no [[sink]])."""
        return self.sources[0] if self.sources else self.mirror.source

    @property
    def corrupt_record_column(self) -> str:
        """The source's corrupt-record column, the one every sink quarantines on."""
        return self.tables[0].corrupt_record_column


# The key of a table whose config leaves it to the messages (a Debezium table read with its
# Connect schemas): the message key's fields, which the job reads once Spark runs.
KEY_FROM_MESSAGES = "<the message key's fields>"


def load_job_config(path: str | Path) -> JobConfig:
    path = Path(path)
    base = path.resolve().parent
    doc = read_toml(path)
    sinks = sink_tables(doc, path) if "sink" in doc or "mirror" not in doc else []
    if "source" not in doc:
        raise ConfigError(f"{path}: no [source] table")
    source = dict(doc["source"])
    overrides = [s.get(SINK_SOURCE, {}) for s in sinks]
    sources = [_source(_over(source, o), base, f"source (with [sink.source] of table {i})" if o else "source")
               for i, o in enumerate(overrides)]
    keyed = [s if "key" in s or not src.keys_from_messages else {**s, "key": [KEY_FROM_MESSAGES]}
             for s, src in zip(sinks, sources)]
    return JobConfig(
        sinks=[SinkConfig.from_dict(without_source(s), base_dir=base) for s in keyed],
        sources=sources,
        job=_build(JobSettings, doc.get("job", {}), "job"),
        mirror=_mirror(doc["mirror"], _source(source, base, "source"), base) if "mirror" in doc else None,
    )


def _over(source: dict[str, Any], table: dict[str, Any]) -> dict[str, Any]:
    """`[source]` with a table's `[sink.source]` over it: the table's topics replace the
    source's subscribe_pattern, and the other way round."""
    dropped = {"subscribe_pattern"} if "topics" in table else {"topics"} if "subscribe_pattern" in table else set()
    return {**{k: v for k, v in source.items() if k not in dropped}, **table}


def _mirror(values: Any, source: SourceConfig, base: Path) -> MirrorConfig:
    if not isinstance(values, dict):
        raise ConfigError("[mirror] must be a table of sink keys (table_uri a location template) and discover_seconds")
    values = dict(values)
    seconds = values.pop("discover_seconds", MirrorConfig.discover_seconds)
    return MirrorConfig(values, source, base, KEY_FROM_MESSAGES, discover_seconds=seconds)


def _source(values: dict[str, Any], base: Path, table: str) -> SourceConfig:
    if values.get("path"):
        values = {**values, "path": _resolve(values["path"], base)}
    try:
        return _build(SourceConfig, values, "source")
    except ConfigError as e:
        raise ConfigError(f"{table}: {e}" if table != "source" else str(e)) from None


def _build(cls, values: dict[str, Any], table: str):
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(f"unknown {table} key(s) {unknown}; accepted keys: {sorted(known)}")
    return cls(**values)


def _default(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def _resolve(value: str, base: Path) -> str:
    return value if "://" in value or Path(value).is_absolute() else str((base / value).resolve())
