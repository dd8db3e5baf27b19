"""End-to-end freshness (`freshness_column`): how long after the source made a change the
table holds it, the batch's commit time minus each record's source time.

Each tagging task sends back a sample of its records' source times (evenly spaced order
statistics, `sample`); the driver weighs the tasks' samples by their record counts and reads
quantiles of the batch's freshness off them (`freshness`): exact for a batch of at most
SAMPLE_SIZE records per task, within 1/SAMPLE_SIZE of a rank above that."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

SAMPLE_SIZE = 200
# The quantiles a batch reports, by label: median, 99th percentile, the oldest record.
QUANTILES = {"0.5": 0.5, "0.99": 0.99, "1": 1.0}


def source_ms(values: pa.Array) -> np.ndarray:
    """Source times as epoch milliseconds, nulls left out: a BIGINT of milliseconds (Debezium's
    `ts_ms`) or a TIMESTAMP."""
    values = values.drop_null()
    if pa.types.is_timestamp(values.type):
        values = pc.cast(pc.cast(values, pa.timestamp("ms", values.type.tz)), pa.int64())
    return values.to_numpy(zero_copy_only=False).astype(np.int64)


def sample(values: pa.Array) -> tuple[int, list[int]]:
    """The records' count and at most SAMPLE_SIZE of their source times, evenly spaced by rank."""
    ms = np.sort(source_ms(values))
    if len(ms) <= SAMPLE_SIZE:
        return len(ms), ms.tolist()
    ranks = np.linspace(0, len(ms) - 1, SAMPLE_SIZE).round().astype(np.int64)
    return len(ms), ms[ranks].tolist()


def freshness(samples: Sequence[tuple[int, list[int]]], commit_ms: int) -> dict[str, float] | None:
    """The batch's freshness quantiles in seconds (QUANTILES' labels), from the tasks' samples;
    None when no record had a source time. A high quantile of freshness is a low one of the
    source times: the 0.99 quantile is how late the oldest 1% arrived."""
    points, weights = [], []
    for count, times in samples:
        if times:
            points += times
            weights += [count / len(times)] * len(times)
    if not points:
        return None
    order = np.argsort(points)
    times, cumulative = np.asarray(points)[order], np.cumsum(np.asarray(weights)[order])
    out = {}
    for label, q in QUANTILES.items():
        rank = (1 - q) * cumulative[-1]  # the source time below which a share 1 - q of the records lies
        oldest = times[min(np.searchsorted(cumulative, rank, side="right"), len(times) - 1)] if q < 1 else times[0]
        out[label] = round((commit_ms - int(oldest)) / 1000, 3)
    return out
