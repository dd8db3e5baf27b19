"""What one tagging task counted, sent back to the driver as one row of its output."""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass, field

import pyarrow as pa

from sink import columns as C
from sink.index.keyspaces import REPLICA_LOOKUPS
from sink.tagging.placement import PLACEMENTS

# Where a tagging task's time goes, in order: opening the replica, catching it up, loading
# partitions, placing deletes without a partition, building the inputs, index lookups,
# classifying, the cross-partition check, staging the changes, eviction and size gauges,
# closing (flushing) the replica, building the output; verify: the sampled verification
# (sink.index.verification), reloads of what it found drifted included.
TAG_STEPS = ("open", "catch_up", "load", "place", "verify", "inputs", "lookup", "classify", "cross_check", "stage",
             "upkeep", "close", "output")

# Why partitions load: a new replica's hot window, first use, or a commit that changed them.
LOAD_REASONS = ("bootstrap", "on_demand", "invalidated")

# Where lookups were answered: the replica's tiers, and a read of a partition not held (found
# or not).
LOOKUP_TIERS = (*REPLICA_LOOKUPS, "table", "table_miss")


@dataclass
class TaskStats:
    """One task's counts; the driver sums every task's (sink.ops.report.BatchReport)."""

    shard_ids: list[int] = field(default_factory=list)
    # The index's work.
    loads: dict[str, int] = field(default_factory=lambda: dict.fromkeys(LOAD_REASONS, 0))
    load_seconds: float = 0.0
    loaded_keys: int = 0
    commits_read: int = 0
    invalidated: int = 0
    evicted: int = 0
    rebuilt: int = 0
    replicas_repaired: int = 0
    shard_moves: int = 0
    changelog_applied: int = 0
    snapshots_restored: int = 0  # replicas that started from a snapshot (sink.index.snapshots)
    snapshots_published: int = 0
    lookups: dict[str, int] = field(default_factory=lambda: dict.fromkeys(LOOKUP_TIERS, 0))
    peeks: int = 0
    partitions_held: int = 0
    cached_records: int = 0
    cached_bytes: int = 0
    tag_seconds: float = 0.0
    tag_steps: dict[str, float] = field(default_factory=lambda: dict.fromkeys(TAG_STEPS, 0.0))
    # New keys checked against the other partitions held, those found there, and an example
    # [key, own partition, stored partition].
    cross_partition_checked: int = 0
    cross_partition_keys: int = 0
    cross_partition_example: list | None = None
    without_partition: dict[str, int] = field(default_factory=lambda: dict.fromkeys(PLACEMENTS, 0))
    # The sampled verification: keys checked, those the replica and the tables disagreed on,
    # and examples (sink.index.verification).
    verified_keys: int = 0
    verify_mismatches: int = 0
    verify_examples: list[str] = field(default_factory=list)
    # freshness_column: per shard tagged, its records with a source time and a sample of those
    # times (sink.freshness.sample).
    source_times: list[tuple[int, list[int]]] = field(default_factory=list)
    # The records' outcomes (sink.tagging.outcomes.summary), once the task tagged any.
    ops: dict[str, int] | None = None
    hits: int = 0
    misses: int = 0
    pids: list[str] = field(default_factory=list)
    changed_pids: list[str] = field(default_factory=list)  # partitions of its updates and deletes (merge_source)
    upserts_without_partition: int = 0
    keys_in_several_partitions: int = 0
    several_partitions_example: list | None = None

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, raw: str) -> TaskStats:
        return cls(**json.loads(raw))


class StepClock:
    """Seconds of a tagging task's steps (TAG_STEPS), added into `steps`: `lap(step)` gives
    the time since the last lap to `step`; time inside functions wrapped by `timed(step, fn)`
    goes to that step instead of the lap it falls in."""

    def __init__(self, steps: dict[str, float]):
        self.steps = steps
        self.started = self.last = time.perf_counter()
        self.inside = 0.0  # of the current lap, spent in timed functions

    def lap(self, step: str) -> None:
        now = time.perf_counter()
        self.steps[step] += now - self.last - self.inside
        self.last, self.inside = now, 0.0

    def timed(self, step: str, fn):
        def run(*args):
            started = time.perf_counter()
            try:
                return fn(*args)
            finally:
                spent = time.perf_counter() - started
                self.steps[step] += spent
                self.inside += spent
        return run

    @property
    def total(self) -> float:
        return self.last - self.started


def stats_batch(schema: pa.Schema, stats: TaskStats) -> pa.RecordBatch:
    """`stats` as the one-row batch of `schema` (a tagging task's output) that ends its output."""
    values = {C.OP: C.STATS_OP, C.STATS: stats.to_json()}
    arrays = [pa.array([values[f.name]], f.type) if f.name in values else pa.nulls(1, f.type) for f in schema]
    return pa.RecordBatch.from_arrays(arrays, schema=schema)
