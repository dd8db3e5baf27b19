"""`[mirror]`: a table per topic that `source.subscribe_pattern` matches, where its location
template puts it; its templates and config errors, and the job on a real broker."""

import base64
import datetime as dt
from decimal import Decimal
from pathlib import Path

import pytest
from deltalake import DeltaTable

from jobs.job_config import KEY_FROM_MESSAGES, SourceConfig, load_job_config
from jobs.mirror import MirrorConfig, MirrorDiscovery, NoMessageError, filled, placeholders
from jobs.supervisor import Table, TablesFailedError
from jobs.upsert_stream import run
from sink.errors import ConfigError
from tests.kafka.test_kafka_source import connect_event, connect_key, create_topic, produce

SOURCE = SourceConfig(format="kafka", bootstrap_servers="b:9092", subscribe_pattern=r"cdc\.public\..*",
                      envelope="debezium", value_format="json-with-schema")
SINK = {"table_uri": "data/{schema}/{table}", "ordering": "lsn", "delete_when": "op = 'd'"}


def mirror(sink=SINK, source=SOURCE, **options) -> MirrorConfig:
    return MirrorConfig(dict(sink), source, Path("/base"), KEY_FROM_MESSAGES, **options)


def test_a_topics_name_fills_the_templates():
    assert placeholders("cdc.public.orders") == {"topic": "cdc.public.orders", "prefix": "cdc", "schema": "public",
                                                 "table": "orders"}
    assert placeholders("a.b.c.d") == {"topic": "a.b.c.d", "prefix": "a.b", "schema": "c", "table": "d"}
    assert placeholders("orders") == {"topic": "orders", "table": "orders"}
    with pytest.raises(ConfigError, match=r"mirror.table_uri = 'data/\{schema\}/\{table\}' names \{schema\}, which "
                                          r"topic 'orders' does not give"):
        filled("data/{schema}/{table}", "orders", "table_uri")
    with pytest.raises(ConfigError, match=r"mirror.index_dir = 'data/\{table' is not a location template"):
        filled("data/{table", "cdc.public.orders", "index_dir")


def test_a_topics_table_is_the_mirrors_sink_keys_at_its_location_reading_that_topic():
    sink, src = mirror({**SINK, "index_dir": "idx/{topic}"}).table("cdc.public.orders")
    assert (sink.table_uri, sink.checkpoint_dir, sink.index_dir, sink.key, sink.delete_when) == (
        "/base/data/public/orders", "/base/data/public/orders_checkpoint", "/base/idx/cdc.public.orders",
        [KEY_FROM_MESSAGES], "op = 'd'")
    assert (src.topics, src.subscribe_pattern, src.envelope) == (["cdc.public.orders"], None, "debezium")


@pytest.mark.parametrize(("sink", "source", "options", "error"), [
    (SINK, SourceConfig(format="kafka", bootstrap_servers="b:9092", topics=["t"], schema="id INT"), {},
     r"\[mirror\] makes a table of each topic source.subscribe_pattern matches"),
    ({"ordering": "lsn"}, SOURCE, {}, r"mirror.table_uri is required: a location template"),
    ({**SINK, "table_uri": "data/one"}, SOURCE, {}, r"mirror.table_uri = 'data/one' names neither \{table\} nor"),
    ({**SINK, "checkpoint_dir": "data/{schema}"}, SOURCE, {}, r"mirror.checkpoint_dir = 'data/\{schema\}' names "
                                                              r"neither"),
    (SINK, SOURCE, {"discover_seconds": 0}, r"mirror.discover_seconds must be a number of seconds > 0, got 0"),
    ({**SINK, "engine": "spark"}, SOURCE, {}, r"\[mirror\]: .*engine"),
])
def test_mirror_config_errors_name_the_key(sink, source, options, error):
    with pytest.raises(ConfigError, match=error):
        mirror(sink, source, **options)


def write_conf(tmp_path: Path, text: str) -> Path:
    conf = tmp_path / "sink.toml"
    conf.write_text(text + '\n[source]\nformat = "kafka"\nbootstrap_servers = "b:9092"\nenvelope = "debezium"\n'
                           'value_format = "json-with-schema"\nsubscribe_pattern = "cdc\\\\.public\\\\..*"\n')
    return conf


def test_a_job_config_with_a_mirror_and_a_sink_of_its_own_topic(tmp_path):
    conf = write_conf(tmp_path, '[mirror]\ntable_uri = "data/{table}"\nordering = "lsn"\ndiscover_seconds = 5\n'
                                '[[sink]]\ntable_uri = "data/own"\nordering = "lsn"\ncheckpoint_dir = "c"\n'
                                '[sink.source]\ntopics = ["cdc.public.own"]\n')
    cfg = load_job_config(conf)
    assert (cfg.mirror.discover_seconds, cfg.mirror.source.subscribe_pattern) == (5, r"cdc\.public\..*")
    assert (cfg.sources[0].topics, cfg.sources[0].subscribe_pattern) == (["cdc.public.own"], None)
    assert load_job_config(write_conf(tmp_path, '[mirror]\ntable_uri = "data/{table}"\nordering = "lsn"\n')).sinks == []
    with pytest.raises(ConfigError, match=r"with \[mirror\], each \[\[sink\]\] names its topics in \[sink.source\]"):
        load_job_config(write_conf(tmp_path, '[mirror]\ntable_uri = "data/{table}"\nordering = "lsn"\n[[sink]]\n'
                                             'table_uri = "data/own"\nordering = "lsn"\ncheckpoint_dir = "c"\n'))


def test_discovery_skips_taken_topics_waits_for_a_first_message_and_isolates_a_refused_topic():
    built, empty = [], {"cdc.public.later"}

    def build(sink, src):
        if src.topics[0] in empty:
            raise NoMessageError("no message yet")
        if src.topics[0] == "cdc.public.broken":
            raise ConfigError("key: the message keys carry no Connect schema\nmore")
        built.append(sink.table_uri)
        return Table(sink.table_uri, "w", lambda: None)

    topics = ["cdc.public.own", "cdc.public.later", "cdc.public.broken", "cdc.public.orders", "cdc.other.orders"]
    discovery = MirrorDiscovery(mirror(), lambda: topics, build, taken={"cdc.public.own"},
                                locations={"/base/data/other/orders"}, every=60)
    assert [t.name for t in discovery()] == ["/base/data/public/orders"]
    assert discovery.refused == {"cdc.public.broken": "key: the message keys carry no Connect schema",
                                 "cdc.other.orders": "its table's location /base/data/other/orders is another "
                                                     "table's (a [[sink]]'s, or another topic's by the mirror's "
                                                     "templates): name it by {topic}, or give it a [[sink]]"}
    empty.clear()
    assert [t.name for t in discovery()] == ["/base/data/public/later"]  # its first message came
    assert built == ["/base/data/public/orders", "/base/data/public/later"]


def test_a_checkpoint_two_topics_would_share_is_refused_for_the_second():
    shared = mirror({**SINK, "table_uri": "data/{schema}/{table}", "checkpoint_dir": "chk/{table}"})
    discovery = MirrorDiscovery(shared, lambda: ["cdc.a.orders", "cdc.b.orders"],
                                lambda sink, src: Table(sink.table_uri, "w", lambda: None), taken=set(),
                                locations=set(), every=None)
    assert [t.name for t in discovery()] == ["/base/data/a/orders"]
    assert discovery.refused == {"cdc.b.orders": "its table's location /base/chk/orders is another table's (a "
                                                 "[[sink]]'s, or another topic's by the mirror's templates): name it "
                                                 "by {topic}, or give it a [[sink]]"}


def test_topics_that_cannot_be_listed_in_a_run_of_one_look_fail_the_job():
    def unlisted():
        raise RuntimeError("the broker is away")

    discovery = MirrorDiscovery(mirror(), unlisted, lambda sink, src: None, taken=set(), locations=set(), every=None)
    assert discovery() == []
    assert discovery.refused == {"the topics of kafka cdc\\.public\\..* at b:9092": "not listed: the broker is away"}


FIELDS = [{"type": "int32", "field": "id"},
          {"type": "bytes", "name": "org.apache.kafka.connect.data.Decimal",
           "parameters": {"scale": "2", "connect.decimal.precision": "9"}, "field": "amount"},
          {"type": "int32", "name": "io.debezium.time.Date", "field": "day"}]


def send(broker, topic: str, ids: range) -> list[dict]:
    """Debezium creates of `ids` into `topic`; the rows as the table must hold them."""
    produce(broker, topic, [(connect_key(topic, i), connect_event(
        topic, {"id": i, "amount": base64.b64encode((i * 7 - 20).to_bytes(4, "big", signed=True)).decode(),
                "day": i}, 100 + i, FIELDS)) for i in ids])
    return [{"id": i, "amount": Decimal(i * 7 - 20).scaleb(-2), "day": dt.date(1970, 1, 1) + dt.timedelta(days=i)}
            for i in ids]


def rows(uri: Path) -> list[dict]:
    got = DeltaTable(str(uri)).to_pyarrow_table(columns=["id", "amount", "day"]).to_pylist()
    return sorted(got, key=lambda r: r["id"])


def test_the_job_mirrors_each_topic_into_its_table_as_its_first_messages_arrive(spark, kafka_broker, tmp_path):
    """Topics of two schemas (one a [[sink]] of its own, which takes precedence), one without a
    message yet, one whose keys carry no schema: the job writes every table it can, says which
    topic got none, and the next start makes the tables of the topics that came since."""
    orders, items, own, waiting, keyless, late = (f"mirror.{n}" for n in (
        "sales.orders", "stock.items", "sales.own", "sales.waiting", "sales.keyless", "stock.late"))
    for topic in (orders, items, own, waiting, keyless):
        create_topic(kafka_broker, topic, partitions=2)
    expected = {orders: send(kafka_broker, orders, range(0, 6)), items: send(kafka_broker, items, range(10, 13)),
                own: send(kafka_broker, own, range(20, 22))}
    produce(kafka_broker, keyless, [(b'{"id": 1}', connect_event(keyless, {"id": 1}, 1, FIELDS[:1]))])
    conf = tmp_path / "sink.toml"
    conf.write_text(f"""
[mirror]
table_uri = "data/{{schema}}/{{table}}"
ordering = "lsn"
delete_when = "op = 'd'"
index_dir = "data/index"
metrics_port = 0

[[sink]]
table_uri = "data/own"
ordering = "lsn"
checkpoint_dir = "data/own_checkpoint"
index_dir = "data/index"
metrics_port = 0

[sink.source]
topics = ["{own}"]

[source]
format = "kafka"
bootstrap_servers = "{kafka_broker.bootstrap_servers}"
subscribe_pattern = "mirror\\\\..*"
envelope = "debezium"
value_format = "json-with-schema"
""")
    with pytest.raises(TablesFailedError, match=rf"^{keyless} got no table: key: the message keys of kafka {keyless} "
                                                r"at \S+ carry no Connect schema"):
        run(str(conf), once=True)
    data = tmp_path / "data"
    assert (rows(data / "sales" / "orders"), rows(data / "stock" / "items"), rows(data / "own")) == (
        expected[orders], expected[items], expected[own])
    assert not (data / "sales" / "waiting").exists()
    assert (data / "sales" / "orders_checkpoint").is_dir()

    more = send(kafka_broker, orders, range(6, 8))
    expected |= {waiting: send(kafka_broker, waiting, range(30, 32)), late: send(kafka_broker, late, range(40, 41))}
    with pytest.raises(TablesFailedError, match=rf"^{keyless} got no table"):  # still none, the others go on
        run(str(conf), once=True)
    assert rows(data / "sales" / "orders") == expected[orders] + more
    assert (rows(data / "sales" / "waiting"), rows(data / "stock" / "late")) == (expected[waiting], expected[late])
    assert sorted(str(log.parent.relative_to(data)) for log in data.rglob("_delta_log")) == [
        "own", "sales/orders", "sales/waiting", "stock/items", "stock/late"]  # no table of its own for `own`
