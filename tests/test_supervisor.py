"""The job's supervision of its tables' queries: the backoff, and what a failure's log says."""

import pytest

from jobs.job_config import JobSettings
from jobs.supervisor import Backoff, summary
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
