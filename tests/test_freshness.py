import datetime as dt

import pyarrow as pa
import pytest

from sink import freshness
from sink.freshness import SAMPLE_SIZE


def test_a_small_task_sends_every_source_time_sorted_and_a_large_one_evenly_spaced_ranks():
    assert freshness.sample(pa.array([30, None, 10, 20], pa.int64())) == (3, [10, 20, 30])
    count, times = freshness.sample(pa.array(range(10_000), pa.int64()))
    assert count == 10_000 and len(times) == SAMPLE_SIZE
    assert times[0] == 0 and times[-1] == 9_999 and times == sorted(times)


def test_timestamps_count_as_epoch_milliseconds():
    at = dt.datetime(2025, 3, 1, 12, 0, 0, 250_000, tzinfo=dt.UTC)
    assert freshness.sample(pa.array([at], pa.timestamp("us", "UTC"))) == (1, [int(at.timestamp() * 1000)])


def test_quantiles_weigh_each_task_by_its_records():
    # 100 records 1 s old on one task; 1 record 60 s old on another: the oldest is 60 s, and
    # it is under 1% of the records, so the 0.99 quantile stays 1 s.
    commit = 1_000_000
    samples = [(100, [commit - 1000] * 100), (1, [commit - 60_000])]
    assert freshness.freshness(samples, commit) == {"0.5": 1.0, "0.99": 1.0, "1": 60.0}
    # 10 records 5 s old, 90 records 1 s old: median 1 s, 0.99 quantile 5 s.
    samples = [(90, [commit - 1000] * 90), (10, [commit - 5000] * 10)]
    assert freshness.freshness(samples, commit) == {"0.5": 1.0, "0.99": 5.0, "1": 5.0}


def test_a_large_tasks_sample_keeps_quantiles_within_a_rank_step():
    commit = 10_000_000
    count, times = freshness.sample(pa.array([commit - ms for ms in range(100_000)], pa.int64()))
    quantiles = freshness.freshness([(count, times)], commit)
    assert quantiles["1"] == 99.999
    assert quantiles["0.99"] == pytest.approx(99.0, abs=100_000 / SAMPLE_SIZE / 1000)
    assert quantiles["0.5"] == pytest.approx(50.0, abs=100_000 / SAMPLE_SIZE / 1000)


def test_a_batch_without_source_times_has_no_freshness():
    assert freshness.freshness([(0, [])], 1000) is None
