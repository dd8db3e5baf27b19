"""Synthetic tables and input batches for the benchmarks (vectorized, deterministic)."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from deltalake import write_deltalake

DAYS = 60
TODAY = dt.date.today()  # the sink's hot window is relative to now
SCHEMA = pa.schema([
    ("id", pa.string()), ("dt", pa.string()), ("event_time", pa.timestamp("us", tz="UTC")),
    ("op", pa.string()), ("amount", pa.float64()), ("payload", pa.string()),
])
SPARK_SCHEMA = "id STRING, dt STRING, event_time TIMESTAMP, op STRING, amount DOUBLE, payload STRING"
_EPOCH_US = int(dt.datetime.combine(TODAY, dt.time(), dt.UTC).timestamp() * 1e6)
_DAY_US = 86_400 * 1_000_000


@dataclass(frozen=True)
class Mix:
    """Shares of a batch; the rest are inserts of new keys dated today."""

    name: str
    updates: float
    late_share: float  # of updates, those going to partitions older than `recent_days`
    deletes: float
    stale: float
    recent_days: int = 7  # the other updates, deletes and stale records hit keys this recent


WORKLOADS = {
    "events": Mix("events", updates=0.13, late_share=0.10, deletes=0.02, stale=0.05),
    "insert-only": Mix("insert-only", updates=0.0, late_share=0.0, deletes=0.0, stale=0.0),
    "update-heavy": Mix("update-heavy", updates=0.50, late_share=0.10, deletes=0.0, stale=0.0),
    # The events mix with every update, delete and stale record within the last 3 days.
    "recent-updates": Mix("recent-updates", updates=0.13, late_share=0.0, deletes=0.02, stale=0.05, recent_days=3),
}


def _day_of(keys: np.ndarray) -> np.ndarray:
    """Days ago (0..DAYS-1) of the starting table's keys: spread evenly."""
    return keys % DAYS


def _rows(keys: np.ndarray, days_ago: np.ndarray, times_us: np.ndarray, ops: list[str] | np.ndarray,
          rng: np.random.Generator) -> pa.Table:
    ids = pc.binary_join_element_wise("user-", pc.cast(pa.array(keys), pa.string()), "")
    dates = np.array([(TODAY - dt.timedelta(days=int(d))).isoformat() for d in range(DAYS)])
    return pa.table({
        "id": ids,
        "dt": pa.array(dates[days_ago]),
        "event_time": pa.array(times_us, pa.int64()).cast(pa.timestamp("us", tz="UTC")),
        "op": pa.array(ops if not isinstance(ops, list) else ops, pa.string()),
        "amount": pa.array(rng.uniform(1, 500, len(keys))),
        "payload": pc.binary_join_element_wise("payload-", pc.cast(pa.array(keys % 9973), pa.string()), ""),
    }, schema=SCHEMA)


def write_start_table(uri: str, rows: int, seed: int = 0, chunk: int = 2_000_000) -> None:
    """`rows` keys over DAYS daily partitions, event times inside their day, written `chunk`
    rows at a time: one file per partition per chunk."""
    rng = np.random.default_rng(seed)
    for start in range(0, rows, chunk):
        keys = np.arange(start, min(rows, start + chunk))
        days = _day_of(keys)
        times = _EPOCH_US - days * _DAY_US + rng.integers(0, _DAY_US // 2, len(keys))
        write_deltalake(uri, _rows(keys, days, times, np.full(len(keys), "u"), rng),
                        partition_by=["dt"], mode="append")


def write_batches(landing: Path, mix: Mix, table_rows: int, batches: int, batch_rows: int, seed: int = 1) -> None:
    """One Parquet file per batch. Updates and deletes hit keys of the starting table (mostly
    within the last 7 days); stale events are older than the stored row; no event touches a
    key deleted earlier, so a MERGE without tombstones ends equal to the sink."""
    rng = np.random.default_rng(seed)
    landing.mkdir(parents=True, exist_ok=True)
    next_key = table_rows
    deleted: set[int] = set()
    recent = np.flatnonzero(_day_of(np.arange(table_rows)) < mix.recent_days) if table_rows else np.array([], int)
    for b in range(batches):
        n_upd, n_del, n_stale = (int(batch_rows * s) for s in (mix.updates, mix.deletes, mix.stale))
        n_new = batch_rows - n_upd - n_del - n_stale
        now_us = _EPOCH_US + _DAY_US // 2 + (b + 1) * 60_000_000  # later than the starting rows
        n_late = int(n_upd * mix.late_share)
        late = rng.integers(0, table_rows, n_late) if table_rows else np.array([], int)
        near = rng.choice(recent, n_upd - n_late + n_del + n_stale) if table_rows else np.array([], int)
        picks = np.concatenate([late, near])
        picks = np.array([k for k in dict.fromkeys(picks.tolist()) if k not in deleted], dtype=np.int64)
        upd, dele, stale = picks[:n_upd], picks[n_upd:n_upd + n_del], picks[n_upd + n_del:n_upd + n_del + n_stale]
        deleted.update(dele.tolist())
        new = np.arange(next_key, next_key + n_new)
        next_key += n_new
        keys = np.concatenate([new, upd, dele, stale]).astype(np.int64)
        days = np.concatenate([np.zeros(len(new), int), _day_of(upd), _day_of(dele), _day_of(stale)])
        times = np.concatenate([
            np.full(len(new), now_us) + rng.integers(0, 1000, len(new)),
            np.full(len(upd) + len(dele), now_us),
            _EPOCH_US - _day_of(stale) * _DAY_US - 1,  # before the stored row's day: stale
        ])
        ops = np.array(["c"] * len(new) + ["u"] * len(upd) + ["d"] * len(dele) + ["u"] * len(stale))
        order = rng.permutation(len(keys))
        table = _rows(keys[order], days[order], times[order], ops[order], rng)
        pq.write_table(table, landing / f"batch-{b:04d}.parquet")
