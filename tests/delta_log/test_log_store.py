"""How the sink claims a table version: a conditional put (local files, S3) and, where the
environment asks for it, Delta's DynamoDB external-log protocol, laid out as Spark's
S3DynamoDBLogStore lays it out. The protocol is tested on its own with an in-memory lock table
and local files, then end to end against moto's S3 and DynamoDB server (a mock: it shows the
requests and their layout are right, not that a real store is atomic)."""

from __future__ import annotations

import json
import threading
import time

import obstore
import pyarrow as pa
import pytest
from deltalake import DeltaTable
from deltalake.exceptions import CommitFailedError
from obstore.store import LocalStore

from sink.delta_log import log_store
from sink.errors import ConfigError, UnsupportedTableError
from sink.lakehouse.engines.delta_rs import DeltaTarget
from tests.delta_log import s3_server
from tests.lakehouse.engines.test_delta_rs import CONTRACT, SCHEMA, commit, contents, rows

LOCK_TABLE = "delta_log"


def race(claim, writers: int = 4) -> list[int]:
    """`writers` threads released together, each calling `claim(i)`: those it returned True for."""
    start, won = threading.Barrier(writers), []

    def run(i):
        start.wait()
        if claim(i):
            won.append(i)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(writers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return won


def test_racing_writers_on_local_files_claim_a_version_once(tmp_path):
    for version in range(20):
        won = race(lambda i, v=version: log_store.claim(str(tmp_path), v, f"writer {i}".encode(), new=True))
        assert len(won) == 1
        assert (tmp_path / "_delta_log" / f"{version:020d}.json").read_bytes() == f"writer {won[0]}".encode()


class MemoryLockTable:
    """A lock table with DynamoDB's conditional semantics, one item at a time."""

    def __init__(self):
        self.items: dict[tuple[str, str], dict[str, str]] = {}
        self._lock = threading.Lock()

    def put_if_absent(self, item):
        with self._lock:
            key = (item["tablePath"], item["fileName"])
            if key in self.items:
                return False
            self.items[key] = dict(item)
            return True

    def get(self, table_path, file_name):
        with self._lock:
            item = self.items.get((table_path, file_name))
            return None if item is None else dict(item)

    def mark_complete(self, table_path, file_name, expire_time):
        with self._lock:
            item = self.items[(table_path, file_name)]
            if item["complete"] == "false":
                item.update(complete="true", expireTime=str(expire_time))


@pytest.fixture
def external(tmp_path):
    return log_store.ExternalLog("s3a://lake/t", MemoryLockTable()), LocalStore(str(tmp_path), mkdir=True)


def entry(tmp_path, version: int) -> bytes:
    return (tmp_path / "_delta_log" / f"{version:020d}.json").read_bytes()


def test_the_protocol_writes_a_temporary_file_claims_it_copies_it_and_completes_it(tmp_path, external):
    log, objects = external
    before = int(time.time())
    assert log.claim(objects, 0, b"commit 0")
    item = log.lock.get("s3a://lake/t", "00000000000000000000.json")
    assert item["complete"] == "true"
    assert before + log_store.ENTRY_LIFETIME_S <= int(item["expireTime"]) <= time.time() + log_store.ENTRY_LIFETIME_S
    temp = item["tempPath"]
    assert temp.startswith(".tmp/00000000000000000000.json.") and len(temp) == len(".tmp/") + 25 + 1 + 36
    assert (tmp_path / "_delta_log" / temp).read_bytes() == entry(tmp_path, 0) == b"commit 0"


def test_racing_writers_under_the_protocol_claim_a_version_once(tmp_path, external):
    log, objects = external
    for version in range(20):
        won = race(lambda i, v=version: log.claim(objects, v, f"writer {i}".encode()))
        assert len(won) == 1
        assert entry(tmp_path, version) == f"writer {won[0]}".encode()
        assert log.lock.get("s3a://lake/t", f"{version:020d}.json")["complete"] == "true"


def test_a_claim_left_half_way_is_finished_by_the_next_writer_which_loses(tmp_path, external):
    log, objects = external
    # Another writer stopped after its claim: its temporary file and incomplete item, no entry.
    obstore.put(objects, "_delta_log/.tmp/00000000000000000003.json.x", b"their commit 3")
    log.lock.put_if_absent({"tablePath": "s3a://lake/t", "fileName": "00000000000000000003.json",
                            "tempPath": ".tmp/00000000000000000003.json.x", "complete": "false"})
    assert not log.claim(objects, 3, b"our commit 3")
    assert entry(tmp_path, 3) == b"their commit 3"
    assert log.lock.get("s3a://lake/t", "00000000000000000003.json")["complete"] == "true"


def test_an_entry_written_outside_the_protocol_is_never_overwritten(tmp_path, external):
    log, objects = external
    obstore.put(objects, "_delta_log/00000000000000000005.json", b"a conditional put's commit 5")
    assert not log.claim(objects, 5, b"our commit 5")
    assert entry(tmp_path, 5) == b"a conditional put's commit 5"
    assert log.lock.get("s3a://lake/t", "00000000000000000005.json") is None


def test_an_unknown_locking_provider_is_refused_naming_the_accepted_ones(monkeypatch):
    monkeypatch.setenv(log_store.LOCKING_PROVIDER, "zookeeper")
    with pytest.raises(ConfigError, match=r"AWS_S3_LOCKING_PROVIDER = 'zookeeper'.*'dynamodb'.*unset"):
        log_store.external_log("s3://lake/t")
    assert log_store.external_log("/local/table") is None  # local tables claim by conditional put alone


@pytest.fixture(scope="module")
def s3():
    with s3_server.running() as server:
        server.client("s3").create_bucket(Bucket="lake")
        server.create_lock_table(LOCK_TABLE)
        yield server


@pytest.fixture
def dynamodb_env(s3, monkeypatch):
    for name, value in {**s3.env(), log_store.LOCKING_PROVIDER: "dynamodb"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv(log_store.LOCK_TABLE_NAME, raising=False)
    return s3


def lock_items(s3, table_path: str) -> dict[str, dict[str, str]]:
    scanned = s3.client("dynamodb").scan(TableName=LOCK_TABLE)["Items"]
    return {i["fileName"]["S"]: {k: next(iter(v.values())) for k, v in i.items()}
            for i in scanned if i["tablePath"]["S"] == table_path}


def s3_object(s3, key: str) -> bytes:
    return s3.client("s3").get_object(Bucket="lake", Key=key)["Body"].read()


@pytest.mark.parametrize("commit_mode", ["auto", "merge-on-read"])
def test_every_commit_of_the_sink_on_s3_is_claimed_in_dynamodb(dynamodb_env, commit_mode):
    s3, uri = dynamodb_env, f"s3://lake/claimed-{commit_mode}"
    target = DeltaTarget(uri, ["dt"], commit_mode)
    target.open_or_create(SCHEMA, CONTRACT)
    assert commit(target, rows(("a", "d1", 1, "x", "insert"), ("b", "d1", 1, "x", "insert")), 0).mode == "append"
    out = commit(target, rows(("a", "d1", 2, "y", "update"), ("b", "d1", 2, "", "delete"),
                              ("c", "d2", 2, "z", "insert")), 1)
    assert out.mode == {"auto": "rewrite", "merge-on-read": "merge-on-read"}[commit_mode] and out.version == 2
    assert contents(uri) == [{"id": "a", "dt": "d1", "ts": 2, "v": "y"}, {"id": "c", "dt": "d2", "ts": 2, "v": "z"}]

    items = lock_items(s3, uri)
    assert sorted(items) == [f"{v:020d}.json" for v in range(3)]  # creation, append and update: all claimed
    for name, item in items.items():
        assert item["complete"] == "true" and int(item["expireTime"]) > time.time() + 86_000
        assert item["tempPath"].startswith(f".tmp/{name}.")
        key = f"claimed-{commit_mode}/_delta_log/"
        assert s3_object(s3, key + item["tempPath"]) == s3_object(s3, key + name)
    assert json.loads(s3_object(s3, f"claimed-{commit_mode}/_delta_log/{2:020d}.json").splitlines()[0]
                      )["commitInfo"]["operation"] == "MERGE"


def test_a_claim_another_writer_left_unfinished_is_finished_then_the_batch_retries(dynamodb_env):
    s3, uri = dynamodb_env, "s3://lake/unfinished"
    target = DeltaTarget(uri, ["dt"])
    target.open_or_create(SCHEMA, CONTRACT)
    commit(target, rows(("a", "d1", 1, "x", "insert")), 0)
    theirs = json.dumps({"commitInfo": {"operation": "WRITE", "engineInfo": "Apache-Spark"}}) + "\n" + \
        json.dumps({"txn": {"appId": "their-job", "version": 7}}) + "\n"
    s3.client("s3").put_object(Bucket="lake", Key="unfinished/_delta_log/.tmp/00000000000000000002.json.spark",
                               Body=theirs.encode())
    s3.client("dynamodb").put_item(TableName=LOCK_TABLE, Item={
        "tablePath": {"S": uri}, "fileName": {"S": "00000000000000000002.json"},
        "tempPath": {"S": ".tmp/00000000000000000002.json.spark"}, "complete": {"S": "false"}})

    batch = rows(("a", "d1", 2, "y", "update"))
    with pytest.raises(CommitFailedError, match="version 2 was committed by another writer first"):
        commit(target, batch, 1)
    assert s3_object(s3, "unfinished/_delta_log/00000000000000000002.json") == theirs.encode()
    assert lock_items(s3, uri)["00000000000000000002.json"]["complete"] == "true"
    target.refresh()
    assert target.transaction_version("their-job") == 7
    assert commit(target, batch, 1).version == 3
    assert DeltaTable(uri).version() == 3 and contents(uri) == [{"id": "a", "dt": "d1", "ts": 2, "v": "y"}]


def test_a_merge_by_delta_rs_is_refused_where_versions_are_claimed_in_dynamodb(dynamodb_env):
    uri = "s3://lake/merged"
    target = DeltaTarget(uri, ["dt"], "merge")
    target.open_or_create(SCHEMA, CONTRACT)
    commit(target, rows(("a", "d1", 1, "x", "insert")), 0)
    with pytest.raises(UnsupportedTableError, match=r"AWS_S3_LOCKING_PROVIDER = dynamodb.*MERGE.*nothing was written"):
        commit(target, rows(("a", "d1", 2, "y", "update")), 1)
    assert DeltaTable(uri).version() == 1


def test_without_a_locking_provider_s3_versions_are_claimed_by_conditional_put(s3, monkeypatch):
    for name, value in s3.env().items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv(log_store.LOCKING_PROVIDER, raising=False)
    assert log_store.claim("s3://lake/plain", 0, b"first", new=True)
    assert not log_store.claim("s3://lake/plain", 0, b"second")
    assert s3_object(s3, "plain/_delta_log/00000000000000000000.json") == b"first"
    assert lock_items(s3, "s3://lake/plain") == {}


def test_a_missing_lock_table_is_refused_naming_the_setting(dynamodb_env, monkeypatch):
    monkeypatch.setenv(log_store.LOCK_TABLE_NAME, "no_such_table")
    with pytest.raises(ConfigError, match=r"DELTA_DYNAMO_TABLE_NAME = 'no_such_table': no such DynamoDB table"):
        log_store.claim("s3://lake/unlocked", 0, pa.schema([]).to_string().encode(), new=True)
