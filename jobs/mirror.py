"""One config mirrors a database: `[mirror]` makes a Delta table of each topic that
`source.subscribe_pattern` matches, where its location templates say (`data/{schema}/{table}`),
each table with its own query, checkpoint and index, as an explicit `[[sink]]` would have.
The broker's topics are listed at start and every `discover_seconds`; a topic becomes a table
once it holds a message (its Connect schemas give the key and the columns). A topic an
explicit `[[sink]]` reads is that table's."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jobs.supervisor import Table
from sink import SinkConfig
from sink.errors import ConfigError

log = logging.getLogger(__name__)

# The sink keys whose strings are location templates.
TEMPLATED = ("table_uri", "checkpoint_dir", "index_dir", "quarantine_table_uri", "tombstone_table_uri",
             "changelog_uri", "writer_id")
PLACEHOLDERS = ("topic", "prefix", "schema", "table")
# A topic as Debezium names one (`<topic.prefix>.<schema>.<table>`; MySQL's: `<prefix>.<database>.<table>`),
# by which a config's templates are checked when it is read.
SAMPLE_TOPIC = "prefix.schema.table"


class NoMessageError(ConfigError):
    """A topic holds no message yet, and its table's key or columns come from the messages."""


def placeholders(topic: str) -> dict[str, str]:
    """What a topic's name fills a template with: `{topic}`, and by its dot-separated parts
    `{table}` (the last), `{schema}` (the one before) and `{prefix}` (the rest)."""
    parts = topic.split(".")
    names = {"topic": topic, "table": parts[-1]}
    if len(parts) >= 2:
        names["schema"] = parts[-2]
    if len(parts) >= 3:
        names["prefix"] = ".".join(parts[:-2])
    return names


def filled(template: str, topic: str, key: str) -> str:
    """`template` (the value of `mirror.<key>`) for `topic`."""
    try:
        return template.format_map(placeholders(topic))
    except KeyError as e:
        raise ConfigError(
            f"mirror.{key} = {template!r} names {{{e.args[0]}}}, which topic {topic!r} does not give: a topic "
            f"named <prefix>.<schema>.<table> (Debezium's) gives {{prefix}}, {{schema}} and {{table}}, any topic "
            "{topic}") from None
    except (ValueError, IndexError) as e:
        raise ConfigError(f"mirror.{key} = {template!r} is not a location template ({e}); its placeholders: "
                          f"{['{' + p + '}' for p in PLACEHOLDERS]}") from None


@dataclass
class MirrorConfig:
    """`[mirror]`: the sink keys of every mirrored table (`table_uri` and the other locations
    as templates) and how often the broker's topics are listed. `source`: `[source]`, whose
    `subscribe_pattern` says which topics; `key_placeholder`: the key of a table whose key
    comes from its messages (jobs.job_config.KEY_FROM_MESSAGES)."""

    sink: dict[str, Any]
    source: Any  # jobs.job_config.SourceConfig (which imports this module)
    base_dir: Path
    key_placeholder: str
    discover_seconds: float = 60

    def __post_init__(self) -> None:
        if self.source.format != "kafka" or not self.source.subscribe_pattern:
            raise ConfigError("[mirror] makes a table of each topic source.subscribe_pattern matches: set "
                              "source.format = 'kafka' and source.subscribe_pattern (a Java regex of topic names, "
                              "e.g. 'cdc\\\\.public\\\\..*'), not source.topics")
        for key in ("table_uri", "checkpoint_dir"):
            value = self.sink.get(key)
            if key == "table_uri" and not isinstance(value, str):
                raise ConfigError("mirror.table_uri is required: a location template, e.g. 'data/{schema}/{table}' "
                                  f"(placeholders: {['{' + p + '}' for p in PLACEHOLDERS]})")
            if isinstance(value, str) and not any("{" + p + "}" in value for p in ("topic", "table")):
                raise ConfigError(f"mirror.{key} = {value!r} names neither {{table}} nor {{topic}}: every topic's "
                                  "table would share it")
        seconds = self.discover_seconds
        if isinstance(seconds, bool) or not isinstance(seconds, int | float) or seconds <= 0:
            raise ConfigError(f"mirror.discover_seconds must be a number of seconds > 0, got {seconds!r}")
        self.table(SAMPLE_TOPIC)  # every other key checked as the sink checks it

    def table(self, topic: str) -> tuple[SinkConfig, Any]:
        """The config of `topic`'s table, and its source: `[source]` reading that topic alone.
        Its checkpoint defaults to `<table_uri>_checkpoint`."""
        values = {k: filled(v, topic, k) if k in TEMPLATED and isinstance(v, str) else v
                  for k, v in self.sink.items()}
        values.setdefault("checkpoint_dir", f"{values['table_uri']}_checkpoint")
        if "key" not in values and self.source.keys_from_messages:
            values["key"] = [self.key_placeholder]
        try:
            sink = SinkConfig.from_dict(values, base_dir=self.base_dir)
        except ConfigError as e:
            raise ConfigError(f"[mirror]: {e}") from None
        return sink, dataclasses.replace(self.source, topics=[topic], subscribe_pattern=None)


def kafka_topics(spark, src) -> list[str]:
    """The topics `src.subscribe_pattern` matches (a Java regex matching the whole name, as
    Spark's `subscribePattern`), listed by Kafka's admin client in the driver's JVM with the
    source's `kafka.*` options (SASL/SSL). A classic session's: a Spark Connect client has no JVM."""
    jvm = spark.sparkContext._jvm
    props = jvm.java.util.Properties()
    for name, value in src.reader_options().items():
        if name.startswith("kafka."):
            props.setProperty(name.removeprefix("kafka."), value)
    admin = jvm.org.apache.kafka.clients.admin.AdminClient.create(props)
    try:
        names = admin.listTopics().names().get(60, jvm.java.util.concurrent.TimeUnit.SECONDS)
    finally:
        admin.close()
    pattern = jvm.java.util.regex.Pattern.compile(src.subscribe_pattern)
    return sorted(str(t) for t in names if pattern.matcher(t).matches())


class MirrorDiscovery:
    """Each call: the tables of the topics that have come (`topics()`, the broker's matching
    ones) and hold a message, built by `build(sink, source)`. A topic an explicit table reads
    (`taken`), or whose table or checkpoint another table has (`locations`), is not mirrored; one whose
    table cannot be built is logged and in `refused` (tried again at the next look), the other
    topics going on. `every`: seconds between looks (None: once, at start)."""

    def __init__(self, mirror: MirrorConfig, topics: Callable[[], list[str]], build: Callable[..., Table], *,
                 taken: set[str], locations: set[str], every: float | None):
        self.mirror, self.topics, self.build, self.every = mirror, topics, build, every
        self.taken, self.locations = set(taken), set(locations)
        self.refused: dict[str, str] = {}
        self._waiting: set[str] = set()

    def __call__(self) -> list[Table]:
        try:
            topics = self.topics()
        except Exception as e:  # noqa: BLE001 - the broker away: the running tables go on, the next look retries
            if self.every is None:  # the one look: the job says no topic was mirrored
                self.refused[f"the topics of {self.mirror.source.name}"] = f"not listed: {e}"
            log.warning("[mirror]: the broker's topics could not be listed (tried again in %s s): %s",
                        self.every or "no", e)
            return []
        tables = []
        for topic in topics:
            if topic in self.taken:
                continue
            table = self._table(topic)
            if table is not None:
                self.taken.add(topic)
                tables.append(table)
        return tables

    def _table(self, topic: str) -> Table | None:
        try:
            sink, src = self.mirror.table(topic)
            shared = [p for p in (sink.table_uri, sink.checkpoint_dir) if p in self.locations]
            if shared:
                raise ConfigError(f"its table's location {shared[0]} is another table's (a [[sink]]'s, or another "
                                  "topic's by the mirror's templates): name it by {topic}, or give it a [[sink]]")
            table = self.build(sink, src)
        except NoMessageError:
            if topic not in self._waiting:
                log.info("[mirror]: topic %s holds no message yet; its table is made once it does", topic)
                self._waiting.add(topic)
            return None
        except Exception as e:  # noqa: BLE001 - one topic's table that cannot be made stops no other table
            text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            if self.refused.get(topic) != text:
                log.error("[mirror]: topic %s gets no table (the other tables go on): %s", topic, text)
            self.refused[topic] = text
            return None
        self.refused.pop(topic, None)
        self._waiting.discard(topic)
        self.locations.update((sink.table_uri, sink.checkpoint_dir))
        log.info("[mirror]: topic %s -> %s", topic, sink.table_uri)
        return table
