"""What a batch does when another writer's commit landed first: its commit lands on exactly
the version it was checked against (delta-rs retries nothing)."""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Literal, Protocol

from sink.config.sections import Scope
from sink.errors import CommitConflictError

log = logging.getLogger(__name__)

Retry = Literal["commit_again", "tag_again"]
# The wait before attempt n+1: BACKOFF_S * 2**n, at most BACKOFF_MAX_S, times a random factor
# from 0.5 to 1.5. Two writers that lose to each other would otherwise retry in step and keep
# losing: the one that waits longer lets the other's commit land, then its own.
BACKOFF_S = 0.2
BACKOFF_MAX_S = 10.0


def backoff_seconds(attempt: int, jitter: float) -> float:
    """The wait after losing attempt `attempt` (from 0); `jitter` in [0, 1)."""
    return min(BACKOFF_MAX_S, BACKOFF_S * 2 ** attempt) * (0.5 + jitter)


class LandedCommit(Protocol):
    """A commit another writer made (sink.delta_log.reading.CommitSummary)."""

    partitions: frozenset[str] | None  # the partitions whose data it changed; None: cannot tell

    def author(self) -> str: ...


class CommitRetries:
    """If the commits that got there first changed none of the batch's partitions, its tags
    still hold and it commits on top of them; otherwise it is tagged again against the new
    version. After `max_retries` retries the batch fails, naming the other writers."""

    def __init__(self, *, max_retries: int, table_uri: str, scope: Scope,
                 sleep: Callable[[float], None] = time.sleep, jitter: Callable[[], float] = random.random):
        self.max_retries = max_retries
        self._table_uri = table_uri
        self._scope = scope
        self._sleep, self._jitter = sleep, jitter
        self._others: dict[str, None] = {}  # who committed in between, in order of appearance

    @property
    def attempts(self) -> range:
        return range(self.max_retries + 1)

    def after_conflict(self, *, batch_id: int, attempt: int, landed: Sequence[LandedCommit],
                       batch_partitions: Iterable[str], error: Exception) -> Retry:
        """What attempt `attempt` (from 0) does next, having lost to the `landed` commits;
        CommitConflictError once the retries are spent."""
        authors = [c.author() for c in landed]
        self._others.update(dict.fromkeys(authors))
        if attempt >= self.max_retries:
            raise CommitConflictError(
                f"batch {batch_id}: other writers kept committing to {self._table_uri} "
                f"({', '.join(self._others) or 'unknown'}); gave up after {attempt + 1} attempts, nothing of "
                f"this batch was written to the table. Raise max_commit_retries, or give each writer "
                f"its own table ({error})"
            ) from error
        wait = backoff_seconds(attempt, self._jitter())
        if touches(landed, batch_partitions, self._scope):
            log.warning("batch %s: %s committed to the batch's partitions first; tagging again in %.1f s (attempt %s)",
                        batch_id, ", ".join(authors), wait, attempt + 2)
            retry: Retry = "tag_again"
        else:
            log.info("batch %s: %s committed first, to other partitions; committing again in %.1f s", batch_id,
                     ", ".join(authors), wait)
            retry = "commit_again"
        self._sleep(wait)
        return retry


def touches(commits: Sequence[LandedCommit], batch_partitions: Iterable[str], scope: Scope) -> bool:
    """Whether any of these commits changed data in a partition the batch holds records of
    (in global scope, any data at all: a key may live in any partition)."""
    if scope == "global":
        return any(c.partitions is None or c.partitions for c in commits)
    ours = set(batch_partitions)
    return any(c.partitions is None or c.partitions & ours for c in commits)
