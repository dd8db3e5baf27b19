"""The retry policy after a lost commit race, without Spark or a table."""

from dataclasses import dataclass

import pytest

from sink.batch.retry import BACKOFF_MAX_S, CommitRetries, backoff_seconds, touches
from sink.errors import CommitConflictError


@dataclass(frozen=True)
class Landed:
    who: str
    partitions: frozenset[str] | None

    def author(self) -> str:
        return self.who


def policy(max_retries=2, scope="partitioned", slept=None):
    return CommitRetries(max_retries=max_retries, table_uri="/t", scope=scope,
                         sleep=(slept.append if slept is not None else lambda s: None), jitter=lambda: 0.5)


def test_each_retry_waits_longer_with_jitter_up_to_a_cap():
    assert [backoff_seconds(n, 0.5) for n in range(3)] == [0.2, 0.4, 0.8]
    assert backoff_seconds(20, 0.5) == BACKOFF_MAX_S
    assert (backoff_seconds(2, 0.0), backoff_seconds(2, 0.999)) == (0.4, pytest.approx(1.1992))
    slept = []
    retries = policy(max_retries=3, slept=slept)
    for attempt in range(3):
        retries.after_conflict(batch_id=7, attempt=attempt, landed=[Landed("writer 'b'", frozenset({"dt=1"}))],
                               batch_partitions=["dt=1"], error=RuntimeError("lost"))
    assert slept == [0.2, 0.4, 0.8]
    with pytest.raises(CommitConflictError):  # out of retries: fails at once, no wait
        retries.after_conflict(batch_id=7, attempt=3, landed=[], batch_partitions=["dt=1"],
                               error=RuntimeError("lost"))
    assert len(slept) == 3


def test_a_commit_to_other_partitions_keeps_the_tags_and_commits_again():
    retries = policy()
    landed = [Landed("writer 'b'", frozenset({"dt=2"}))]
    assert retries.after_conflict(batch_id=7, attempt=0, landed=landed, batch_partitions=["dt=1"],
                                  error=RuntimeError("lost")) == "commit_again"


def test_a_commit_to_the_batchs_partitions_has_it_tagged_again():
    retries = policy()
    landed = [Landed("writer 'b'", frozenset({"dt=2"})), Landed("writer 'c'", frozenset({"dt=1"}))]
    assert retries.after_conflict(batch_id=7, attempt=0, landed=landed, batch_partitions=["dt=1"],
                                  error=RuntimeError("lost")) == "tag_again"


def test_a_commit_whose_partitions_cannot_be_told_counts_as_touching_them():
    assert touches([Landed("an OPTIMIZE (version 3)", None)], ["dt=1"], "partitioned")
    assert not touches([Landed("writer 'b'", frozenset())], ["dt=1"], "partitioned")


def test_in_global_scope_any_data_change_has_the_batch_tagged_again():
    """A key may live in any partition: a change anywhere may be to one of the batch's keys."""
    assert touches([Landed("writer 'b'", frozenset({"dt=9"}))], ["dt=1"], "global")
    assert not touches([Landed("writer 'b'", frozenset())], ["dt=1"], "global")  # metadata only


def test_the_last_attempt_fails_naming_every_other_writer_once_in_order():
    retries = policy(max_retries=2)
    assert list(retries.attempts) == [0, 1, 2]
    error = RuntimeError("version 5 already exists")
    for attempt, who in enumerate(["writer 'b'", "writer 'c'"]):
        retries.after_conflict(batch_id=7, attempt=attempt, landed=[Landed(who, frozenset({"dt=1"}))],
                               batch_partitions=["dt=1"], error=error)
    with pytest.raises(CommitConflictError) as failed:
        retries.after_conflict(batch_id=7, attempt=2, landed=[Landed("writer 'b'", frozenset())],
                               batch_partitions=["dt=1"], error=error)
    assert str(failed.value) == (
        "batch 7: other writers kept committing to /t (writer 'b', writer 'c'); gave up after 3 attempts, nothing "
        "of this batch was written to the table. Raise max_commit_retries, or give each writer its own table "
        "(version 5 already exists)")
    assert failed.value.__cause__ is error


def test_no_retries_fails_at_the_first_conflict():
    with pytest.raises(CommitConflictError, match="gave up after 1 attempts"):
        policy(max_retries=0).after_conflict(batch_id=1, attempt=0, landed=[], batch_partitions=[],
                                             error=RuntimeError("lost"))
