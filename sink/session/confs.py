"""Session confs set around one Spark commit, held by one writer at a time.

Delta reads a commit's app transaction and user metadata from session confs, which every user
of the session shares. A classic streaming query runs its batches in a clone of the session,
its own; under Spark Connect every query's foreachBatch worker is a client of the session that
started it, so two sink queries of one job (one per `[[sink]]` table) would each commit with
the other's app transaction. Their workers run on the Connect server's host: a lock file there,
named after the session, lets one set, commit and unset at a time."""

from __future__ import annotations

import fcntl
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

from pyspark.sql import SparkSession

from sink.session import is_connect


@contextmanager
def session_confs(spark: SparkSession, confs: Mapping[str, str]) -> Iterator[None]:
    """`confs` set in `spark` for the body, unset after it, no other holder of this context on
    the same (Connect) session in between."""
    with _exclusive(spark):
        for key, value in confs.items():
            spark.conf.set(key, value)
        try:
            yield
        finally:
            for key in confs:
                spark.conf.unset(key)


@contextmanager
def _exclusive(spark: SparkSession) -> Iterator[None]:
    if not is_connect(spark):
        yield
        return
    with open(Path(tempfile.gettempdir()) / f"upsert-sink-session-{spark.session_id}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
