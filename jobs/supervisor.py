"""The job's tables run side by side: a query that fails is logged with its table, counted
(`upsert_sink_query_failures_total`) and started again after a backoff that doubles up to a
bound, while the other tables' queries go on. A table whose query failed `max_restarts` times
in a row (a run that committed a batch starts the count again) stays stopped; the job ends
with `TablesFailedError` naming it once the others have ended. A `Discovery` (the mirror's)
adds tables as they come: at start, then every `every` seconds."""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from sink.errors import SinkError
from sink.ops import metrics

log = logging.getLogger(__name__)
_RAISED = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception): ")


class TablesFailedError(SinkError):
    """One or more of the job's tables stopped for good: their queries failed every restart."""


@dataclass(frozen=True)
class Backoff:
    """How long a failed query waits before it starts again: `first` seconds, doubling, at most
    `longest`; `max_restarts` failures in a row end its table."""

    first: float
    longest: float
    max_restarts: int

    def wait(self, failures: int) -> float:
        return min(self.first * 2 ** (failures - 1), self.longest)


@dataclass
class Table:
    """One [[sink]] table's query: `start()` starts (or restarts) it."""

    name: str
    writer_id: str
    start: Callable[[], object]
    query: object = None  # its latest run's, kept once it ended (its last progress)
    failures: int = 0
    restart_at: float | None = None
    error: str | None = None
    ended: bool = False
    batches_seen: int = field(default=-1)

    def ran_a_batch(self) -> bool:
        progress = self.query.lastProgress if self.query is not None else None
        return progress is not None and progress.batchId > self.batches_seen


class Discovery(Protocol):
    """Tables that come while the job runs (jobs.mirror.MirrorDiscovery): each call returns the
    new ones; `refused` names what could not be made a table, and why; `every`: seconds
    between calls (None: once, at start; no more calls once it is None)."""

    every: float | None
    refused: dict[str, str]

    def __call__(self) -> list[Table]: ...


def supervise(streams, tables: list[Table], backoff: Backoff, *, poll_seconds: float,
              polled: Callable[[list[Table]], None] | None = None, discovery: Discovery | None = None) -> None:
    """Start `tables`' queries (with those `discovery` adds, appended to `tables`) and keep
    them running until each has ended (or failed for good); `streams`: the session's
    StreamingQueryManager. `polled(tables)`: called at least every `poll_seconds` while they
    run. TablesFailedError when a table failed for good, or a discovered one was refused."""
    for table in tables:
        table.query = table.start()
    look_at = time.monotonic() if discovery is not None else None
    while True:
        if look_at is not None and look_at <= time.monotonic():
            tables.extend(_started(discovery))
            look_at = time.monotonic() + discovery.every if discovery.every else None
        now = time.monotonic()
        for table in tables:
            if table.restart_at is not None and table.restart_at <= now:
                log.info("%s: restarting its query (failure %d in a row)", table.name, table.failures)
                table.restart_at, table.query = None, table.start()
        running = [t for t in tables if not t.ended and t.restart_at is None]
        waiting = [t.restart_at for t in tables if t.restart_at is not None]
        if not running and not waiting and look_at is None:
            break
        timeout = max(0.01, min([poll_seconds, *(at - now for at in [*waiting, *filter(None, [look_at])])]))
        try:
            streams.awaitAnyTermination(timeout)
        except Exception:  # noqa: BLE001 - a query failed: which one, and why, comes from the query itself
            pass
        streams.resetTerminated()
        for table in running:
            if not table.query.isActive:
                _ended(table, backoff)
        if polled is not None:
            polled(tables)
    failed = [f"{t.name} stopped after {t.failures} failures in a row: {t.error}" for t in tables if t.error]
    failed += [f"{name} got no table: {error}" for name, error in (discovery.refused if discovery else {}).items()]
    if failed:
        raise TablesFailedError("; ".join(failed))


def _started(discovery: Discovery) -> list[Table]:
    """The tables `discovery` found, started; one whose start fails (its stream does not fit
    its config, say) is refused, the others going on."""
    started = []
    for table in discovery():
        try:
            table.query = table.start()
        except Exception as e:  # noqa: BLE001 - one table's start stops no other table
            discovery.refused[table.name] = summary(e)
            log.error("%s: its query did not start (the other tables go on): %s", table.name, summary(e))
            continue
        started.append(table)
    return started


def summary(error: BaseException) -> str:
    """The line of a query's error that says what failed: a foreachBatch function's error comes
    wrapped in Spark's ("An exception was raised by the Python Proxy", its traceback after),
    whose last `<module>.<Name>Error: ...` line is the sink's own."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    raised = [line for line in lines if _RAISED.match(line)]
    return raised[-1] if raised else lines[0] if lines else type(error).__name__


def _ended(table: Table, backoff: Backoff) -> None:
    error = table.query.exception()
    if error is None:
        table.ended = True
        return
    table.failures = 1 if table.ran_a_batch() else table.failures + 1
    progress = table.query.lastProgress
    table.batches_seen = progress.batchId if progress is not None else table.batches_seen
    metrics.QUERY_FAILURES.labels(table.writer_id).inc()
    text = summary(error)
    if table.failures > backoff.max_restarts:
        log.error("%s: its query failed %d times in a row; the table stays stopped (the other tables go on): %s",
                  table.name, table.failures, text)
        table.ended, table.error = True, text
        return
    wait = backoff.wait(table.failures)
    log.error("%s: its query failed (the other tables go on); restarting it in %.0f s: %s", table.name, wait, text)
    table.restart_at = time.monotonic() + wait
