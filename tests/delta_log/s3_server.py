"""An S3 and DynamoDB server for the tests: moto's, in its own process (delta-rs holds the GIL
through some calls, which a server thread in the tests' process would then never answer)."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import boto3

REGION = "us-east-1"
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test"}


@dataclass(frozen=True)
class S3Server:
    endpoint: str

    def env(self) -> dict[str, str]:
        """What the sink, delta-rs and obstore need to reach it."""
        return {**CREDENTIALS, "AWS_REGION": REGION, "AWS_ENDPOINT_URL": self.endpoint, "AWS_ALLOW_HTTP": "true"}

    def client(self, service: str):
        return boto3.client(service, endpoint_url=self.endpoint, region_name=REGION,
                            aws_access_key_id=CREDENTIALS["AWS_ACCESS_KEY_ID"],
                            aws_secret_access_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"])

    def create_lock_table(self, name: str) -> None:
        """The lock table as Spark's S3DynamoDBLogStore documents it."""
        self.client("dynamodb").create_table(
            TableName=name, BillingMode="PAY_PER_REQUEST",
            AttributeDefinitions=[{"AttributeName": "tablePath", "AttributeType": "S"},
                                  {"AttributeName": "fileName", "AttributeType": "S"}],
            KeySchema=[{"AttributeName": "tablePath", "KeyType": "HASH"},
                       {"AttributeName": "fileName", "KeyType": "RANGE"}])


@contextmanager
def running() -> Iterator[S3Server]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    process = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    try:
        _wait_for(endpoint, process)
        yield S3Server(endpoint)
    finally:
        process.terminate()
        process.wait(timeout=30)


def _wait_for(endpoint: str, process: subprocess.Popen, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=2)
            return
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"moto's server did not start at {endpoint} (exit code {process.poll()})") from None
            time.sleep(0.1)  # polling a starting server: nothing to wait on instead
