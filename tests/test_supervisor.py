"""The job's supervision of its tables' queries: the backoff, and what a failure's log says."""

import pytest

from jobs.job_config import JobSettings
from jobs.supervisor import Backoff, Table, TablesFailedError, summary, supervise
from sink.errors import ConfigError


def test_the_wait_doubles_from_the_first_up_to_the_longest():
    backoff = Backoff(first=10, longest=300, max_restarts=5)
    assert [backoff.wait(n) for n in range(1, 8)] == [10, 20, 40, 80, 160, 300, 300]


def test_a_failure_is_summed_up_by_the_sinks_own_error_inside_sparks_wrapper():
    wrapped = ("An exception was raised by the Python Proxy. Return Message: Traceback (most recent call last):\n"
               '  File "x.py", line 1, in call\n    raise UnchangedValueError(...)\n'
               "sink.errors.UnchangedValueError: column 'v' of the record for key 'k' holds unchanged_value\n")
    assert summary(RuntimeError(wrapped)) == "sink.errors.UnchangedValueError: column 'v' of the record for key 'k' " \
                                             "holds unchanged_value"
    assert summary(RuntimeError("the broker went away\nmore")) == "the broker went away"
    assert summary(RuntimeError("")) == "RuntimeError"


@pytest.mark.parametrize(("settings", "error"), [
    ({"restart_backoff_seconds": -1}, "job.restart_backoff_seconds must be a number of seconds >= 0, got -1"),
    ({"restart_backoff_max_seconds": "5m"}, "job.restart_backoff_max_seconds must be a number of seconds"),
    ({"max_restarts": 1.5}, r"job.max_restarts must be an integer >= 0 \(0: a failed table stays stopped\), got 1.5"),
])
def test_restart_settings_errors_name_the_key(settings, error):
    with pytest.raises(ConfigError, match=error):
        JobSettings(**settings)


class EndingQuery:
    """A query that has processed what there was once the supervisor first looks at it."""

    isActive = False
    lastProgress = None

    def exception(self):
        return None


class Streams:
    """The session's query manager, for queries that end by themselves."""

    def awaitAnyTermination(self, timeout):
        return True

    def resetTerminated(self):
        pass


class Looks:
    """A mirror's discovery: nothing at start, two tables at the second look (one whose query
    does not start), then no more looks; one topic it could not make a table of."""

    def __init__(self, started: list[str]):
        self.every, self.refused, self.calls, self.started = 0.01, {"cdc.public.bad": "no key"}, 0, started

    def __call__(self):
        self.calls += 1
        if self.calls == 1:
            return []
        self.every = None
        return [Table("data/late", "w-late", lambda: self.started.append("data/late") or EndingQuery()),
                Table("data/unfit", "w-unfit", unfit)]


def unfit():
    raise ValueError("sink.errors.SchemaError: column 'v' is double in the stream and string in the table")


def test_a_table_discovered_at_a_later_look_is_started_and_refused_ones_fail_the_job():
    started = []
    tables = [Table("data/first", "w-first", lambda: started.append("data/first") or EndingQuery())]
    looks = Looks(started)
    with pytest.raises(TablesFailedError, match=r"^cdc.public.bad got no table: no key; data/unfit got no table: "
                                                r"sink.errors.SchemaError: column 'v' is double in the stream"):
        supervise(Streams(), tables, Backoff(1, 1, 0), poll_seconds=0.01, discovery=looks)
    assert (started, looks.calls, [t.name for t in tables]) == (["data/first", "data/late"], 2,
                                                                 ["data/first", "data/late"])
    assert all(t.ended and t.error is None for t in tables)
