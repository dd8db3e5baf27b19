import datetime as dt

import pyarrow as pa

from sink import keys
from sink.index.tiering import DateRule, hot_partitions, resolve_date_rule

NOW = dt.datetime(2025, 3, 1, 15, 30, tzinfo=dt.UTC)


def test_rule_detection():
    assert resolve_date_rule(None, "%Y-%m-%d", {"day": pa.date32(), "x": pa.string()}) == DateRule(("day",))
    ymd = {"year": pa.int32(), "month": pa.int32(), "day": pa.int32()}
    assert resolve_date_rule(None, "%Y-%m-%d", ymd) == DateRule(("year", "month", "day"))
    assert resolve_date_rule(None, "%Y%m%d", {"dt": pa.string()}) == DateRule(("dt",), "%Y%m%d")
    assert resolve_date_rule(None, "%Y-%m-%d", {"a": pa.string(), "b": pa.string()}) is None
    assert resolve_date_rule(None, "%Y-%m-%d", {}) is None
    assert resolve_date_rule("b", "%d.%m.%Y", {"a": pa.string(), "b": pa.string()}) == DateRule(("b",), "%d.%m.%Y")


def test_dates_from_values():
    assert DateRule(("dt",)).date_of({"dt": "2025-01-15"}) == dt.date(2025, 1, 15)
    assert DateRule(("dt",), "%Y%m%d").date_of({"dt": "20250115"}) == dt.date(2025, 1, 15)
    assert DateRule(("y", "m", "d")).date_of({"y": "2025", "m": "1", "d": "15"}) == dt.date(2025, 1, 15)
    assert DateRule(("dt",)).date_of({"dt": "eu-west"}) is None
    assert DateRule(("y", "m", "d")).date_of({"y": "2025", "m": "13", "d": "1"}) is None


def daily(n_days):
    return {keys.partition_id(["dt"], [(NOW.date() - dt.timedelta(days=i)).isoformat()]): (None, 10)
            for i in range(n_days)}


def test_sixty_daily_partitions_seven_days_gives_the_seven_newest():
    hot = hot_partitions(daily(60), DateRule(("dt",)), NOW, 7)
    expected = [keys.partition_id(["dt"], [(NOW.date() - dt.timedelta(days=i)).isoformat()]) for i in range(7)]
    assert hot == expected


def test_zero_days_loads_nothing():
    assert hot_partitions(daily(10), DateRule(("dt",)), NOW, 0) == []


def test_tiering_column_dates_partitions_without_a_date():
    stats = {
        "region=eu": (NOW - dt.timedelta(days=2), 5),
        "region=us": (NOW - dt.timedelta(days=9), 5),
        "region=ap": (dt.date(2025, 2, 27), 5),
        "region=xx": (None, 5),  # no statistics: left to on-demand loads
    }
    assert hot_partitions(stats, DateRule(("region",)), NOW, 7) == ["region=eu", "region=ap"]
    assert hot_partitions(stats, None, NOW, 7) == ["region=eu", "region=ap"]


def test_neither_date_nor_tiering_loads_nothing():
    stats = {"region=eu": (None, 5), "region=us": (None, 5)}
    assert hot_partitions(stats, None, NOW, 7) == []
