"""BatchReport: what one micro-batch did, phase by phase; the job logs it, tests and the demo
read it."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from sink.lakehouse.commit.versions import VERSION_CHANGES
from sink.lakehouse.engines.delta_rs import CommitOutcome
from sink.tagging.classify import UPDATE
from sink.tagging.outcomes import OUTCOMES, QUARANTINED, UNCHANGED
from sink.tagging.placement import PLACEMENTS, WITHOUT_PARTITION
from sink.tagging.task_stats import LOAD_REASONS, TAG_STEPS, TaskStats

# Where a batch's time goes, in order. checks: schema, contract and replay checks;
# other_writers: other writers' commits since the last batch recorded (sink.batch.other_writers); prepare:
# planning the routed records; collect: the records into the driver (tag_on = "driver"), while
# the replicas kept open catch up;
# tag: the tagging job (executors: route, shuffle, tagging tasks, writing tasks and collect in
# one Spark job) or threads; split: tags, counts and signals read from the output; changelog:
# the index changelog's retention (its entries are written by the tagging tasks).
PHASES = ("checks", "other_writers", "prepare", "collect", "tag", "split", "quarantine", "tombstones", "commit",
          "changelog", "metrics")



@dataclass
class BatchReport:
    """What one call did; the job logs it, tests and the demo read it."""

    batch_id: int
    records_in: int = 0
    ops: dict[str, int] = field(default_factory=lambda: dict.fromkeys(OUTCOMES, 0))
    hits: int = 0
    misses: int = 0
    memory_hits: int = 0  # of the hits, answered by the in-memory tier
    filter_misses: int = 0  # of the misses, answered by the keyspaces' key filters
    partition_loads: dict[str, int] = field(default_factory=lambda: dict.fromkeys(LOAD_REASONS, 0))
    # Partitions not held read for the batch's few keys of them instead of loaded
    # (peek_max_keys), and the lookups they answered: keys found, keys not found.
    partition_peeks: int = 0
    table_hits: int = 0
    table_misses: int = 0
    load_seconds: float = 0.0
    loaded_keys: int = 0
    commits_read: int = 0
    invalidated: int = 0
    replicas_rebuilt: int = 0  # replicas found new or unusable, bootstrapped
    replicas_repaired: int = 0  # of those, found damaged (files truncated or corrupt) and wiped
    # Keys with records in several partitions of this batch: each partition gets its own row
    # (partitioned scope), which may not be what the user meant.
    keys_in_several_partitions: int = 0
    # New keys (of those checked, see cross_partition_check) that the index already holds as
    # rows of another partition: partitioned scope gives them a second row.
    keys_in_other_partition: int = 0
    keys_checked_in_other_partitions: int = 0
    other_partition_example: list[str] | None = None  # [key, arriving partition, stored partition]
    # Records with a null partition column (partitioned scope): deletes located in the one
    # partition holding their key, deletes of keys no partition holds, deletes quarantined as
    # ambiguous (their key is in several partitions), upserts quarantined (they need one).
    without_partition: dict[str, int] = field(default_factory=lambda: dict.fromkeys(WITHOUT_PARTITION, 0))
    # Shard replicas behind on batches this writer tagged on other executors, and the
    # changelog entries they applied to catch up.
    shard_moves: int = 0
    changelog_applied: int = 0
    # Replicas that started from a published snapshot, and snapshots published (sink.index.snapshots).
    snapshots_restored: int = 0
    snapshots_published: int = 0
    # The sampled verification (verify_fraction): keys checked, those the replica and the tables
    # disagreed on (their partitions reloaded before tagging), and examples.
    verified_keys: int = 0
    verify_mismatches: int = 0
    verify_examples: list[str] = field(default_factory=list)
    evicted: int = 0
    partitions_held: int = 0
    cached_records: int = 0
    cached_bytes: int = 0
    mode: str = "none"  # COMMIT_KINDS (append | rewrite | merge-on-read | merge), skipped (a replay) or none
    table_version: int | None = None
    merge_partitions: int = 0
    files_marked: int = 0  # stored files whose rows the commit marked deleted (merge-on-read)
    files_rewritten: int = 0  # stored files it replaced with new ones
    retries: int = 0
    phases: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    # Summed over shards: time inside the tagging tasks (the rest of tag_seconds is Spark),
    # and its steps (sink.tagging.task_stats.TAG_STEPS).
    shard_seconds: float = 0.0
    jobs_rerun: int = 0  # tagging jobs Spark aborted after losing an executor, run again
    write_seconds: float = 0.0  # summed over the Spark tasks that wrote the batch's files (0: none did)
    write_tasks: int = 0  # those of them that had writes
    write_busiest_share: float = 0.0  # the busiest one's share of write_seconds (1.0: one task wrote it all)
    tag_steps: dict[str, float] = field(default_factory=lambda: dict.fromkeys(TAG_STEPS, 0.0))
    # scd_type = 2: rows of the batch's keys' rebuilt histories, the stored rows they replaced,
    # and versions opened, closed and split (sink.lakehouse.commit.versions.HistoryRewrite).
    versions_written: int = 0
    versions_replaced: int = 0
    version_changes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(VERSION_CHANGES, 0))
    total_seconds: float = 0.0
    # freshness_column: the tasks' samples of source times, and the batch's freshness quantiles
    # in seconds once committed (sink.freshness; None: no source time).
    source_times: list[tuple[int, list[int]]] = field(default_factory=list)
    freshness: dict[str, float] | None = None

    @contextmanager
    def timed(self, phase: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self.phases[phase] += time.perf_counter() - started

    def record(self, outcome: CommitOutcome) -> None:
        """What the commit did; updates it found the table already held count as unchanged."""
        self.mode = outcome.mode
        self.table_version = outcome.version
        self.merge_partitions = outcome.merge_partitions
        self.files_marked, self.files_rewritten = outcome.files_marked, outcome.files_rewritten
        self.ops[UPDATE] -= outcome.unchanged
        self.ops[UNCHANGED] += outcome.unchanged

    @property
    def tag_seconds(self) -> float:
        return self.phases["collect"] + self.phases["tag"]

    @property
    def commit_seconds(self) -> float:
        return self.phases["commit"]

    def add_task_stats(self, stats_rows: list[TaskStats]) -> None:
        """The tagging tasks' counts (their stats rows), summed: the records may not be here."""
        self.ops = {o: sum(s.ops[o] for s in stats_rows if s.ops is not None) for o in OUTCOMES}
        self.hits = sum(s.hits for s in stats_rows)
        self.misses = sum(s.misses for s in stats_rows)
        for reason in self.partition_loads:
            self.partition_loads[reason] = sum(s.loads[reason] for s in stats_rows)
        self.shard_seconds = sum(s.tag_seconds for s in stats_rows)
        self.tag_steps = {step: sum(s.tag_steps[step] for s in stats_rows) for step in TAG_STEPS}
        self.memory_hits = sum(s.lookups["memory"] for s in stats_rows)
        self.filter_misses = sum(s.lookups["filter"] for s in stats_rows)
        self.partition_peeks = sum(s.peeks for s in stats_rows)
        self.table_hits = sum(s.lookups["table"] for s in stats_rows)
        self.table_misses = sum(s.lookups["table_miss"] for s in stats_rows)
        for name in ("load_seconds", "loaded_keys", "commits_read", "invalidated", "evicted",
                     "partitions_held", "cached_records", "cached_bytes", "shard_moves", "changelog_applied",
                     "snapshots_restored", "snapshots_published"):
            setattr(self, name, sum(getattr(s, name) for s in stats_rows))
        self.replicas_rebuilt = sum(s.rebuilt for s in stats_rows)
        self.keys_in_other_partition = sum(s.cross_partition_keys for s in stats_rows)
        self.keys_checked_in_other_partitions = sum(s.cross_partition_checked for s in stats_rows)
        self.other_partition_example = next(
            (s.cross_partition_example for s in stats_rows if s.cross_partition_example), None)
        self.replicas_repaired = sum(s.replicas_repaired for s in stats_rows)
        for outcome in PLACEMENTS:
            self.without_partition[outcome] = sum(s.without_partition[outcome] for s in stats_rows)
        self.without_partition["upsert"] = sum(s.upserts_without_partition for s in stats_rows)
        self.keys_in_several_partitions = sum(s.keys_in_several_partitions for s in stats_rows)
        self.verified_keys = sum(s.verified_keys for s in stats_rows)
        self.verify_mismatches = sum(s.verify_mismatches for s in stats_rows)
        self.verify_examples = [e for s in stats_rows for e in s.verify_examples]
        self.source_times = [sample for s in stats_rows for sample in s.source_times]

    def record_history(self, ops: dict[str, int], written: int, replaced: int, changes: dict[str, int]) -> None:
        """A history batch's counts: its events (insert, update, delete; the tagging tasks'
        other outcomes do not apply) and its versions."""
        self.ops = {**dict.fromkeys(OUTCOMES, 0), QUARANTINED: self.ops[QUARANTINED], **ops}
        self.versions_written, self.versions_replaced, self.version_changes = written, replaced, changes

    def summary(self) -> str:
        o = self.ops
        return (
            f"batch={self.batch_id} in={self.records_in} inserted={o['insert']} updated={o['update']} "
            f"deleted={o['delete']} delete_missing={o['delete_missing']} unchanged={o['unchanged']} "
            f"stale={o['stale']} "
            f"superseded={o['superseded']} quarantined={o['quarantined']} "
            f"hits={self.hits} misses={self.misses} loads={sum(self.partition_loads.values())} "
            f"peeks={self.partition_peeks} "
            f"moves={self.shard_moves} verified={self.verified_keys} "
            + (f"snapshots_restored={self.snapshots_restored} snapshots_published={self.snapshots_published} "
               if self.snapshots_restored or self.snapshots_published else "")
            + (f"verify_mismatches={self.verify_mismatches} " if self.verify_mismatches else "")
            + f"mode={self.mode} "
            + (f"files_marked={self.files_marked} files_rewritten={self.files_rewritten} "
               if self.files_marked or self.files_rewritten else "")
            + f"version={self.table_version} tag_s={self.tag_seconds:.2f} "
            f"commit_s={self.commit_seconds:.2f} write_s={self.write_seconds:.2f} "
            + (f"write_tasks={self.write_tasks} busiest={self.write_busiest_share:.2f} " if self.write_tasks else "")
            + f"total_s={self.total_seconds:.2f} "
            f"phases_s={','.join(f'{p}:{s:.3f}' for p, s in self.phases.items() if s)} "
            f"tag_steps_s={','.join(f'{p}:{s:.3f}' for p, s in self.tag_steps.items() if s >= 0.0005)}"
            + (f" freshness_s=p50:{self.freshness['0.5']},p99:{self.freshness['0.99']},max:{self.freshness['1']}"
               if self.freshness else "")
            + (f" versions_written={self.versions_written} versions_replaced={self.versions_replaced} "
               + " ".join(f"versions_{c}={n}" for c, n in self.version_changes.items())
               if self.versions_written or self.versions_replaced else "")
        )
