"""What a batch does when another writer's commit landed first: its commit lands on exactly
the version it was checked against (delta-rs retries nothing)."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Literal, Protocol

from sink.config_sections import Scope
from sink.errors import CommitConflictError

log = logging.getLogger(__name__)

Retry = Literal["commit_again", "tag_again"]


class LandedCommit(Protocol):
    """A commit another writer made (sink.lakehouse.log.CommitSummary)."""

    partitions: frozenset[str] | None  # the partitions whose data it changed; None: cannot tell

    def author(self) -> str: ...


class CommitRetries:
    """If the commits that got there first changed none of the batch's partitions, its tags
    still hold and it commits on top of them; otherwise it is tagged again against the new
    version. After `max_retries` retries the batch fails, naming the other writers."""

    def __init__(self, *, max_retries: int, table_uri: str, scope: Scope):
        self.max_retries = max_retries
        self._table_uri = table_uri
        self._scope = scope
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
        if touches(landed, batch_partitions, self._scope):
            log.warning("batch %s: %s committed to the batch's partitions first; tagging again (attempt %s)",
                        batch_id, ", ".join(authors), attempt + 2)
            return "tag_again"
        log.info("batch %s: %s committed first, to other partitions; committing again", batch_id, ", ".join(authors))
        return "commit_again"


def touches(commits: Sequence[LandedCommit], batch_partitions: Iterable[str], scope: Scope) -> bool:
    """Whether any of these commits changed data in a partition the batch holds records of
    (in global scope, any data at all: a key may live in any partition)."""
    if scope == "global":
        return any(c.partitions is None or c.partitions for c in commits)
    ours = set(batch_partitions)
    return any(c.partitions is None or c.partitions & ours for c in commits)
