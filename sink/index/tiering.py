"""Which partitions are hot: partition dates from partition values, or a tiering column's
max value from the Delta file statistics."""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc

from sink import keys

YMD = ("year", "month", "day")


@dataclass(frozen=True)
class DateRule:
    """How to read a partition's date from its values."""

    columns: tuple[str, ...]  # one date/string column, or (year, month, day)
    fmt: str = "%Y-%m-%d"

    def date_of(self, values: Mapping[str, str]) -> dt.date | None:
        try:
            if len(self.columns) == 3:
                y, m, d = (int(values[c]) for c in self.columns)
                return dt.date(y, m, d)
            return dt.datetime.strptime(values[self.columns[0]], self.fmt).date()
        except (KeyError, ValueError, TypeError):
            return None


def resolve_date_rule(
    partition_date: str | Sequence[str] | None,
    fmt: str,
    partition_types: Mapping[str, pa.DataType],
) -> DateRule | None:
    """The configured rule, or one detected from the partition columns (None: no dates)."""
    if isinstance(partition_date, str):
        is_date = pa.types.is_date(partition_types.get(partition_date, pa.string()))
        return DateRule((partition_date,), "%Y-%m-%d" if is_date else fmt)
    if partition_date:
        return DateRule(tuple(partition_date))
    date_cols = [c for c, t in partition_types.items() if pa.types.is_date(t)]
    if date_cols:
        return DateRule((date_cols[0],))
    if set(YMD) <= set(partition_types):
        return DateRule(YMD)
    strings = [c for c, t in partition_types.items() if pa.types.is_string(t) or pa.types.is_large_string(t)]
    if len(strings) == 1:
        return DateRule((strings[0],), fmt)
    return None


def partition_stats(add_actions: pa.Table, partition_cols: Sequence[str], tiering_column: str | None):
    """Per partition id: (max of the tiering column or None, rows). One entry per partition."""
    if add_actions.num_rows == 0:
        return {}
    parts = pa.table({c: add_actions.column(f"partition.{c}") for c in partition_cols}) if partition_cols \
        else pa.table({"_": pa.nulls(add_actions.num_rows)})
    pids = keys.partition_ids(parts, partition_cols)
    columns = {"pid": pids, "rows": pc.fill_null(add_actions.column("num_records"), 0)}
    stat = f"max.{tiering_column}" if tiering_column else None
    if stat and stat in add_actions.column_names:
        columns["max"] = add_actions.column(stat)
    grouped = pa.table(columns).group_by("pid").aggregate(
        [("rows", "sum")] + ([("max", "max")] if "max" in columns else [])
    )
    maxes = grouped.column("max_max").to_pylist() if "max" in columns else [None] * grouped.num_rows
    return {
        pid: (mx, rows)
        for pid, rows, mx in zip(grouped.column("pid").to_pylist(), grouped.column("rows_sum").to_pylist(), maxes)
    }


def hot_partitions(
    stats: Mapping[str, tuple[object, int]],
    rule: DateRule | None,
    now: dt.datetime,
    days: int,
) -> list[str]:
    """Partitions inside the hot window, newest first: dated within the last `days`
    calendar days (today included), or whose tiering max is newer than now - days.
    Partitions with neither a date nor a tiering value are left to on-demand loads."""
    first_day = now.date() - dt.timedelta(days=days - 1)
    since = now - dt.timedelta(days=days)
    dated: list[tuple[dt.datetime, str]] = []
    for pid, (tier_max, _) in stats.items():
        day = rule.date_of(keys.partition_values(pid)) if rule else None
        if day is not None:
            if days > 0 and day >= first_day:
                dated.append((dt.datetime.combine(day, dt.time(), dt.UTC), pid))
        elif tier_max is not None:
            moment = _as_datetime(tier_max)
            if days > 0 and moment is not None and moment > since:
                dated.append((moment, pid))
    return [pid for _, pid in sorted(dated, reverse=True)]


def undated_example(stats: Mapping[str, tuple[object, int]], rule: DateRule | None) -> str | None:
    """A partition of `stats` to name when none of them has a date under `rule` nor a tiering
    max (the hot window can then hold nothing: a format that fits no value, most likely);
    None when any partition is dated, or there is no rule or no partition."""
    if rule is None or not stats:
        return None
    if any(tier_max is not None or rule.date_of(keys.partition_values(pid)) is not None
           for pid, (tier_max, _) in stats.items()):
        return None
    return min(stats)


def _as_datetime(value: object) -> dt.datetime | None:
    if isinstance(value, dt.datetime):
        return value if value.tzinfo else value.replace(tzinfo=dt.UTC)
    if isinstance(value, dt.date):
        return dt.datetime.combine(value, dt.time(), dt.UTC)
    return None
