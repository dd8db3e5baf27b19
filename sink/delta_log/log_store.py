"""How the sink claims a table version: the mutual exclusion it shares with the table's other
writers.

By default a log entry `_delta_log/<version>.json` is created with a conditional put that never
overwrites (`obstore`'s `mode="create"`: `If-None-Match: *` on S3, a generation precondition on
GCS, `If-None-Match` on Azure, an exclusive create on local files), which is how delta-rs 1.x
claims versions everywhere, and what Spark's log stores for local files, HDFS, Azure and GCS
amount to (a rename or create that fails when the entry exists).

On S3, Spark jobs may instead claim versions through DynamoDB (`S3DynamoDBLogStore`, Delta's
"external log" protocol): their copy into `<version>.json` overwrites, so a conditional put
alone does not exclude them. With `AWS_S3_LOCKING_PROVIDER=dynamodb` in the environment (the
setting delta-rs read before 1.0 dropped its own implementation) the sink follows that protocol
on s3:// and s3a:// tables: the entry is written to a temporary file under `_delta_log/.tmp/`,
claimed by a conditional PutItem of `(tablePath, fileName)` in the lock table
(`DELTA_DYNAMO_TABLE_NAME`, default `delta_log`), copied to `<version>.json`, then marked
complete with an expiry a day on, the item laid out as Spark's and delta-rs' were. An entry
another writer claimed but did not finish is finished by the sink before it reports the
conflict, as Spark's readers and writers finish it.
"""

from __future__ import annotations

import functools
import os
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import obstore
from obstore.exceptions import AlreadyExistsError, NotFoundError
from obstore.store import LocalStore, from_url

from sink.errors import ConfigError

LOCKING_PROVIDER = "AWS_S3_LOCKING_PROVIDER"
LOCK_TABLE_NAME = "DELTA_DYNAMO_TABLE_NAME"
DEFAULT_LOCK_TABLE = "delta_log"
ENTRY_LIFETIME_S = 86_400  # Spark's and delta-rs' expireTime: a day after the entry is complete
_S3_SCHEMES = ("s3://", "s3a://")
# What reaches the lock table (the DynamoDB ones first; boto3 reads the S3 keys itself).
_DYNAMODB_SETTINGS = ("AWS_ENDPOINT_URL_DYNAMODB", "AWS_ENDPOINT_URL", "AWS_REGION_DYNAMODB", "AWS_REGION",
                      "AWS_DEFAULT_REGION", "AWS_ACCESS_KEY_ID_DYNAMODB", "AWS_SECRET_ACCESS_KEY_DYNAMODB",
                      "AWS_SESSION_TOKEN_DYNAMODB")


def store(uri: str, *, new: bool = False):
    """The object store holding the table at `uri`; `new`: a table not created yet (a local
    directory is made)."""
    if "://" not in uri:
        return LocalStore(os.path.abspath(uri), mkdir=new)
    if uri.startswith("file://"):
        return LocalStore(uri.removeprefix("file://"), mkdir=new)
    return from_url(uri)


def entry_name(version: int) -> str:
    return f"{version:020d}.json"


def claim(uri: str, version: int, data: bytes, *, new: bool = False) -> bool:
    """Write `data` as the table's log entry for `version`, unless another writer holds that
    version: returns False then, having written nothing the table reads."""
    objects = store(uri, new=new)
    log = external_log(uri)
    if log is not None:
        return log.claim(objects, version, data)
    try:
        obstore.put(objects, f"_delta_log/{entry_name(version)}", data, mode="create")
    except AlreadyExistsError:
        return False
    return True


class LockTable(Protocol):
    """The lock table's three requests, as the protocol uses them."""

    def put_if_absent(self, item: Mapping[str, str]) -> bool:
        """Store `item` unless one with its (tablePath, fileName) exists; False then."""

    def get(self, table_path: str, file_name: str) -> dict[str, str] | None:
        """The item, read consistently; None when there is none."""

    def mark_complete(self, table_path: str, file_name: str, expire_time: int) -> None:
        """`complete = "true"` and `expireTime`, where the item is still incomplete."""


@dataclass(frozen=True)
class ExternalLog:
    """Delta's external-log commit protocol (Spark's `BaseExternalLogStore`) for one table."""

    table_path: str
    lock: LockTable

    def claim(self, objects, version: int, data: bytes) -> bool:
        name = entry_name(version)
        if _exists(objects, f"_delta_log/{name}"):
            return False
        temp = f".tmp/{name}.{uuid.uuid4()}"
        obstore.put(objects, f"_delta_log/{temp}", data)
        item = {"tablePath": self.table_path, "fileName": name, "tempPath": temp, "complete": "false"}
        if not self.lock.put_if_absent(item):
            self.finish(objects, name)  # another writer's claim: its entry becomes readable
            return False
        obstore.put(objects, f"_delta_log/{name}", data)
        self.lock.mark_complete(self.table_path, name, int(time.time()) + ENTRY_LIFETIME_S)
        return True

    def finish(self, objects, name: str) -> None:
        """Copy a claimed, unfinished entry's temporary file into place and mark it complete:
        what any of the table's writers does for a writer that stopped half-way."""
        item = self.lock.get(self.table_path, name)
        if item is None or item.get("complete") == "true":
            return
        if not _exists(objects, f"_delta_log/{name}"):
            data = obstore.get(objects, f"_delta_log/{item['tempPath']}").bytes()
            obstore.put(objects, f"_delta_log/{name}", bytes(data))
        self.lock.mark_complete(self.table_path, name, int(time.time()) + ENTRY_LIFETIME_S)


def external_log(uri: str) -> ExternalLog | None:
    """The table's external log, where the environment asks for one (S3 tables only)."""
    provider = os.environ.get(LOCKING_PROVIDER, "").strip().lower()
    if not provider or not uri.startswith(_S3_SCHEMES):
        return None
    if provider != "dynamodb":
        raise ConfigError(f"{LOCKING_PROVIDER} = {os.environ[LOCKING_PROVIDER]!r} is not a locking provider the "
                          "sink knows: accepted values are 'dynamodb' (Delta's S3DynamoDBLogStore protocol) or unset "
                          "(conditional puts)")
    settings = tuple(os.environ.get(name) for name in _DYNAMODB_SETTINGS)
    return ExternalLog(uri.rstrip("/"), _dynamodb_table(os.environ.get(LOCK_TABLE_NAME) or DEFAULT_LOCK_TABLE,
                                                        settings))


def _exists(objects, path: str) -> bool:
    try:
        obstore.head(objects, path)
    except (FileNotFoundError, NotFoundError):
        return False
    return True


@functools.cache
def _dynamodb_table(name: str, settings: tuple[str | None, ...]) -> DynamoDbLockTable:
    """One client per lock table and settings (`_DYNAMODB_SETTINGS`' values)."""
    return DynamoDbLockTable(name, **dict(zip(_DYNAMODB_SETTINGS, settings)))


class DynamoDbLockTable:
    """The lock table in DynamoDB (keys `tablePath` HASH, `fileName` RANGE, both strings),
    reached as delta-rs reached it: `AWS_ENDPOINT_URL_DYNAMODB`, `AWS_REGION_DYNAMODB` and the
    `*_DYNAMODB` keys where set, else the S3 ones (`AWS_ENDPOINT_URL`, `AWS_REGION`)."""

    def __init__(self, name: str, **env: str | None):
        try:
            import boto3
        except ImportError as e:
            raise ConfigError(f"{LOCKING_PROVIDER} = 'dynamodb' needs boto3: pip install 'delta-upsert-sink[dynamodb]'"
                              ) from e
        self.name = name
        self._client = boto3.client(
            "dynamodb", endpoint_url=env["AWS_ENDPOINT_URL_DYNAMODB"] or env["AWS_ENDPOINT_URL"],
            region_name=env["AWS_REGION_DYNAMODB"] or env["AWS_REGION"] or env["AWS_DEFAULT_REGION"],
            aws_access_key_id=env["AWS_ACCESS_KEY_ID_DYNAMODB"],
            aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY_DYNAMODB"],
            aws_session_token=env["AWS_SESSION_TOKEN_DYNAMODB"])

    def put_if_absent(self, item: Mapping[str, str]) -> bool:
        try:
            self._client.put_item(TableName=self.name, Item={k: {"S": v} for k, v in item.items()},
                                  ConditionExpression="attribute_not_exists(tablePath) and "
                                                      "attribute_not_exists(fileName)")
        except self._client.exceptions.ConditionalCheckFailedException:
            return False
        except self._client.exceptions.ResourceNotFoundException as e:
            raise ConfigError(f"{LOCK_TABLE_NAME} = {self.name!r}: no such DynamoDB table; create it with keys "
                              "tablePath (HASH, string) and fileName (RANGE, string), as Spark's "
                              "S3DynamoDBLogStore uses, or name the one Spark's jobs use") from e
        return True

    def get(self, table_path: str, file_name: str) -> dict[str, str] | None:
        found = self._client.get_item(TableName=self.name, ConsistentRead=True, Key=_key(table_path, file_name))
        item: dict[str, Any] | None = found.get("Item")
        return None if item is None else {k: next(iter(v.values())) for k, v in item.items()}

    def mark_complete(self, table_path: str, file_name: str, expire_time: int) -> None:
        try:
            self._client.update_item(
                TableName=self.name, Key=_key(table_path, file_name),
                UpdateExpression="SET complete = :c, expireTime = :e", ConditionExpression="complete = :f",
                ExpressionAttributeValues={":c": {"S": "true"}, ":e": {"N": str(expire_time)}, ":f": {"S": "false"}})
        except self._client.exceptions.ConditionalCheckFailedException:
            pass  # another writer finished it


def _key(table_path: str, file_name: str) -> dict[str, dict[str, str]]:
    return {"tablePath": {"S": table_path}, "fileName": {"S": file_name}}
