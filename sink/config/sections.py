"""`SinkConfig`'s options grouped by what they are about, each a small typed section that
checks its own values: the table, the stream, the index, the commit, the side tables, the
runtime, and history (scd_type = 2). `SinkConfig` keeps the flat public fields (the TOML
keys, sink.config.options); `cfg.table`, `cfg.index`, ... are these views of them. A section
reads the options (`SinkOptions`), never the whole `SinkConfig` that checks them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, get_args

from sink.columns import distinct
from sink.errors import ConfigError
from sink.ordering import columns_of

if TYPE_CHECKING:
    from sink.config.options import SinkOptions

Scope = Literal["partitioned", "global"]
Engine = Literal["auto", "deltalake", "delta-spark"]
Ties = Literal["incoming", "existing"]
TagOn = Literal["auto", "executors", "driver"]
SchemaEvolution = Literal["add_columns", "fail"]
CheckConstraints = Literal["quarantine", "fail"]
UnsentValues = Literal["quarantine", "fail"]
AppendOnlyChanges = Literal["quarantine", "fail"]
CommitMode = Literal["auto", "merge-on-read", "merge"]
ScdType = Literal[1, 2]

SCOPES, ENGINES, TIES, TAG_ON = get_args(Scope), get_args(Engine), get_args(Ties), get_args(TagOn)
SCHEMA_EVOLUTION, COMMIT_MODES, SCD_TYPES = get_args(SchemaEvolution), get_args(CommitMode), get_args(ScdType)
CHECK_CONSTRAINTS, UNSENT_VALUES = get_args(CheckConstraints), get_args(UnsentValues)
APPEND_ONLY_CHANGES = get_args(AppendOnlyChanges)


@dataclass(frozen=True)
class TableSection:
    """What the table is: its location, key, partitioning, ordering and scope."""

    table_uri: str
    key: tuple[str, ...]
    partition_by: tuple[str, ...]
    ordering: tuple[str, ...]  # the ordering columns, compared in order
    scope: Scope
    except_columns: tuple[str, ...]

    @property
    def tombstone_columns(self) -> list[str]:
        """What a tombstone row keeps of a delete: its key, partition and ordering columns, each
        once (a key may include partition columns)."""
        return distinct(self.key, self.partition_by, self.ordering)

    @classmethod
    def of(cls, cfg: SinkOptions) -> TableSection:
        require_str("table_uri", cfg.table_uri)
        require_columns("key", cfg.key, allow_empty=False)
        require_columns("partition_by", cfg.partition_by, allow_empty=True)
        if isinstance(cfg.ordering, list):
            require_columns("ordering", cfg.ordering, allow_empty=False)
        else:
            require_str("ordering", cfg.ordering)
        require_choice("scope", cfg.scope, SCOPES)
        if set(cfg.key) <= set(cfg.partition_by):
            raise ConfigError(f"key {cfg.key} names partition columns only: a partition would hold one row; add the "
                              "column that tells its rows apart (a key may include partition columns)")
        ordering = columns_of(cfg.ordering)
        for c in ordering:
            if c in cfg.key or c in cfg.partition_by:
                raise ConfigError(f"ordering column {c!r} must not be a key or partition column")
        require_columns("except_columns", cfg.except_columns, allow_empty=True)
        located = set(cfg.key) | set(cfg.partition_by)
        if located & set(cfg.except_columns):
            raise ConfigError(f"except_columns {sorted(located & set(cfg.except_columns))} are key or partition "
                              "columns, which the table must store")
        return cls(cfg.table_uri, tuple(cfg.key), tuple(cfg.partition_by), tuple(ordering), cfg.scope,
                   tuple(cfg.except_columns))


@dataclass(frozen=True)
class StreamSection:
    """How the stream's records are read: deletes, quarantine, nulls, ties, new columns."""

    delete_when: str | None
    quarantine_when: str | None
    corrupt_record_column: str
    ignore_null_updates: bool
    ties: Ties
    schema_evolution: SchemaEvolution
    check_constraints: CheckConstraints
    freshness_column: str | None = None
    unchanged_value: str | None = None
    unsent_values: UnsentValues = "quarantine"
    append_only_changes: AppendOnlyChanges = "quarantine"

    @property
    def incoming_wins_ties(self) -> bool:
        return self.ties == "incoming"

    @classmethod
    def of(cls, cfg: SinkOptions) -> StreamSection:
        require_choice("ties", cfg.ties, TIES)
        require_choice("schema_evolution", cfg.schema_evolution, SCHEMA_EVOLUTION)
        require_choice("check_constraints", cfg.check_constraints, CHECK_CONSTRAINTS)
        require_choice("unsent_values", cfg.unsent_values, UNSENT_VALUES)
        require_choice("append_only_changes", cfg.append_only_changes, APPEND_ONLY_CHANGES)
        if cfg.delete_when is not None:
            require_str("delete_when", cfg.delete_when)
        if cfg.quarantine_when is not None:
            require_str("quarantine_when", cfg.quarantine_when)
        require_str("corrupt_record_column", cfg.corrupt_record_column)
        if cfg.corrupt_record_column in {*cfg.key, *cfg.partition_by, *cfg.ordering_columns}:
            raise ConfigError(f"corrupt_record_column {cfg.corrupt_record_column!r} is a key, partition or ordering "
                              "column; it names Spark's column for the raw text of records that did not parse")
        require_bool("ignore_null_updates", cfg.ignore_null_updates)
        if cfg.freshness_column is not None:
            require_str("freshness_column", cfg.freshness_column)
        if cfg.unchanged_value is not None:
            require_str("unchanged_value", cfg.unchanged_value)
            if cfg.scd_type == 2:
                raise ConfigError("unchanged_value applies to scd_type = 1: a history table rebuilds its versions "
                                  "from the events, which would keep the placeholder")
        return cls(cfg.delete_when, cfg.quarantine_when, cfg.corrupt_record_column, cfg.ignore_null_updates, cfg.ties,
                   cfg.schema_evolution, cfg.check_constraints, cfg.freshness_column, cfg.unchanged_value,
                   cfg.unsent_values, cfg.append_only_changes)


@dataclass(frozen=True)
class IndexSection:
    """The replicas: where, how many, what they load and keep, and their memory."""

    index_dir: str | None
    num_shards: int | None
    bootstrap_days: int
    partition_ttl_hours: int
    partition_date: str | tuple[str, ...] | None
    partition_date_format: str
    tiering_column: str | None
    index_max_bytes: int | None
    hot_cache_entries: int
    resident_keys: int | None  # None: hot_tier.resident_keys decides by where tagging runs
    cross_partition_check: int
    peek_max_keys: int
    block_cache_bytes: int
    verify_fraction: float
    verify_every_batches: int
    replica_snapshot_every_versions: int  # 0: no snapshots

    @classmethod
    def of(cls, cfg: SinkOptions) -> IndexSection:
        if cfg.num_shards is not None:
            require_int("num_shards", cfg.num_shards, 1, 4096)
        require_int("bootstrap_days", cfg.bootstrap_days, 0, 100_000)
        require_int("partition_ttl_hours", cfg.partition_ttl_hours, 1, 1_000_000)
        _check_tiering(cfg)
        require_int("hot_cache_entries", cfg.hot_cache_entries, 0, 100_000_000)
        if cfg.resident_keys is not None:
            require_int("resident_keys", cfg.resident_keys, 0, 1_000_000_000)
        require_int("cross_partition_check", cfg.cross_partition_check, 0, 10_000_000)
        require_int("peek_max_keys", cfg.peek_max_keys, 0, 1_000_000)
        require_int("index_block_cache_bytes", cfg.index_block_cache_bytes, 1 << 20, 1 << 40)
        require_fraction("verify_fraction", cfg.verify_fraction)
        require_int("verify_every_batches", cfg.verify_every_batches, 1, 1_000_000)
        require_int("replica_snapshot_every_versions", cfg.replica_snapshot_every_versions, 0, 100_000_000)
        retention = cfg.changelog_retention_versions
        if isinstance(retention, int) and cfg.replica_snapshot_every_versions > retention:
            raise ConfigError(
                f"replica_snapshot_every_versions ({cfg.replica_snapshot_every_versions}) must be at most "
                f"changelog_retention_versions ({retention}): a replica restored from a snapshot replays this "
                "writer's batches since from the changelog, and reloads what is past it")
        if cfg.index_max_bytes is not None:
            require_int("index_max_bytes", cfg.index_max_bytes, 1, 2**62)
            if cfg.scope == "global":
                # The global keyspace is one unit: evicting it would reload the whole table.
                raise ConfigError("index_max_bytes applies to scope = 'partitioned' only; unset it for "
                                  "scope = 'global', whose replica holds every key on local disk")
        date = tuple(cfg.partition_date) if isinstance(cfg.partition_date, list) else cfg.partition_date
        return cls(cfg.index_dir, cfg.num_shards, cfg.bootstrap_days, cfg.partition_ttl_hours, date,
                   cfg.partition_date_format, cfg.tiering_column, cfg.index_max_bytes, cfg.hot_cache_entries,
                   cfg.resident_keys, cfg.cross_partition_check, cfg.peek_max_keys, cfg.index_block_cache_bytes,
                   float(cfg.verify_fraction), cfg.verify_every_batches, cfg.replica_snapshot_every_versions)

    def verifies(self, batch_id: int, *, shard: int = 0, num_shards: int = 1, whole_table: bool = False) -> float:
        """The share of batch `batch_id`'s keys that shard `shard` of `num_shards` checks in the
        sampled verification (0: none). On an unpartitioned table (`whole_table`) the shards
        take the checked batches in turn: there each shard's check reads the key column of the
        whole table (at 10M rows 0.3-0.9 s a shard, a third of a batch with both at once)."""
        turn, off_turn = divmod(batch_id, self.verify_every_batches)
        if off_turn or (whole_table and turn % num_shards != shard):
            return 0.0
        return self.verify_fraction


@dataclass(frozen=True)
class CommitSection:
    """How a batch lands: the engine, the path, the retries, the writer's app id."""

    engine: Engine
    commit_mode: CommitMode
    allow_protocol_upgrade: bool
    max_commit_retries: int
    writer_id: str | None
    checkpoint_dir: str | None
    rewrite_marked_share: float

    @classmethod
    def of(cls, cfg: SinkOptions) -> CommitSection:
        require_choice("engine", cfg.engine, ENGINES)
        require_choice("commit_mode", cfg.commit_mode, COMMIT_MODES)
        require_bool("allow_protocol_upgrade", cfg.allow_protocol_upgrade)
        require_fraction("rewrite_marked_share", cfg.rewrite_marked_share, at_0="rewrite every file a batch changes",
                         at_1="mark rows in it unless every row goes")
        require_int("max_commit_retries", cfg.max_commit_retries, 0, 100)
        if cfg.writer_id is not None:
            require_str("writer_id", cfg.writer_id)
        if cfg.writer_id is None and cfg.checkpoint_dir is None:
            raise ConfigError(
                "set checkpoint_dir (the query's checkpoint location) or writer_id: "
                "the writer id makes commits exactly-once and must change with the checkpoint"
            )
        return cls(cfg.engine, cfg.commit_mode, cfg.allow_protocol_upgrade, cfg.max_commit_retries, cfg.writer_id,
                   cfg.checkpoint_dir, float(cfg.rewrite_marked_share))


@dataclass(frozen=True)
class SideTablesSection:
    """The tables beside the target: quarantine, tombstones, the index changelog."""

    quarantine_uri: str
    tombstone_uri: str
    tombstone_ttl_seconds: int | None  # stored deletes older than this count as absent
    changelog_uri: str
    changelog_retention_versions: int
    replica_snapshot_uri: str

    @classmethod
    def of(cls, cfg: SinkOptions) -> SideTablesSection:
        if cfg.tombstone_ttl_hours is not None:
            require_hours("tombstone_ttl_hours", cfg.tombstone_ttl_hours, 1_000_000)
        require_int("changelog_retention_versions", cfg.changelog_retention_versions, 1, 10_000_000)
        ttl = None if cfg.tombstone_ttl_hours is None else round(cfg.tombstone_ttl_hours * 3600)
        return cls(cfg.quarantine_table_uri or sibling(cfg.table_uri, "_quarantine"),
                   cfg.tombstone_table_uri or sibling(cfg.table_uri, "_tombstones"), ttl,
                   cfg.changelog_uri or sibling(cfg.table_uri, "_index_changelog"), cfg.changelog_retention_versions,
                   cfg.replica_snapshot_uri or sibling(cfg.table_uri, "_index_snapshots"))


@dataclass(frozen=True)
class RuntimeSection:
    """Where tagging runs and what the process serves and caches."""

    tag_on: TagOn
    metrics_port: int
    file_cache_bytes: int
    probe_cache_bytes: int

    @classmethod
    def of(cls, cfg: SinkOptions) -> RuntimeSection:
        require_choice("tag_on", cfg.tag_on, TAG_ON)
        require_int("file_cache_bytes", cfg.file_cache_bytes, 0, 1 << 40)
        require_int("probe_cache_bytes", cfg.probe_cache_bytes, 0, 1 << 40)
        require_int("metrics_port", cfg.metrics_port, 0, 65535)
        return cls(cfg.tag_on, cfg.metrics_port, cfg.file_cache_bytes, cfg.probe_cache_bytes)

    def tags_on_driver(self, master: str) -> bool:
        """Where tagging runs under this Spark master. "auto": the driver when a local master
        runs the driver and the only executor in one process (local-cluster does not)."""
        if self.tag_on == "auto":
            return master == "local" or master.startswith("local[")
        return self.tag_on == "driver"


@dataclass(frozen=True)
class HistorySection:
    """scd_type = 2: one row per version of a key, and which columns open a version."""

    scd_type: ScdType
    track_history_columns: tuple[str, ...] | None
    track_history_except_columns: tuple[str, ...] | None

    @classmethod
    def of(cls, cfg: SinkOptions) -> HistorySection:
        if isinstance(cfg.scd_type, bool) or cfg.scd_type not in SCD_TYPES:
            raise ConfigError(f"scd_type = {cfg.scd_type!r} is not accepted; accepted values: {list(SCD_TYPES)}")
        named = {n: v for n, v in (("track_history_columns", cfg.track_history_columns),
                                   ("track_history_except_columns", cfg.track_history_except_columns))
                 if v is not None}
        for name, columns in named.items():
            require_columns(name, columns, allow_empty=name == "track_history_except_columns")
            if cfg.scd_type != 2:
                raise ConfigError(f"{name} applies to scd_type = 2 only (scd_type = {cfg.scd_type})")
            fixed = sorted(set(columns) & set(cfg.identity_columns))
            if fixed:
                raise ConfigError(f"{name} names key or partition column(s) {fixed}: history tracks the other "
                                  "stored columns (a key's versions share its key, and in partitioned scope its "
                                  "partition)")
        if len(named) == 2:
            raise ConfigError("set track_history_columns or track_history_except_columns, not both")
        if cfg.scd_type == 2 and cfg.commit_mode == "merge-on-read":
            raise ConfigError("commit_mode = 'merge-on-read' applies to scd_type = 1: a history table's rebuild "
                              "reads its versions from the table's files, which deletion vectors would hide rows of; "
                              "accepted with scd_type = 2: 'auto', 'merge'")
        return cls(cfg.scd_type, *(None if v is None else tuple(v)
                                   for v in (cfg.track_history_columns, cfg.track_history_except_columns)))


def _check_tiering(cfg: SinkOptions) -> None:
    date = cfg.partition_date
    if isinstance(date, str):
        if date not in cfg.partition_by:
            raise ConfigError(f"partition_date = {date!r} must be one of partition_by {cfg.partition_by}")
    elif isinstance(date, list):
        if len(date) != 3 or not set(date) <= set(cfg.partition_by):
            raise ConfigError(f"partition_date = {date!r} must be [year, month, day] columns of partition_by "
                              f"{cfg.partition_by}")
    elif date is not None:
        raise ConfigError(f"partition_date must be a column name or [year, month, day] columns, got {date!r}")
    require_str("partition_date_format", cfg.partition_date_format)
    if cfg.tiering_column is not None:
        require_str("tiering_column", cfg.tiering_column)


def sibling(uri: str, suffix: str) -> str:
    return uri.rstrip("/") + suffix


def require_str(name: str, value: object) -> None:
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"{name} must be a non-empty string, got {value!r}")


def require_columns(name: str, value: object, allow_empty: bool) -> None:
    if not isinstance(value, list) or not all(isinstance(c, str) and c for c in value):
        raise ConfigError(f"{name} must be a list of column names, got {value!r}")
    if not value and not allow_empty:
        raise ConfigError(f"{name} must name at least one column")
    if len(set(value)) != len(value):
        raise ConfigError(f"{name} lists a column twice: {value!r}")


def require_choice(name: str, value: object, accepted: tuple) -> None:
    if value not in accepted:
        raise ConfigError(f"{name} = {value!r} is not accepted; accepted values: {list(accepted)}")


def require_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise ConfigError(f"{name} must be true or false, got {value!r}")


def require_hours(name: str, value: object, high: int) -> None:
    """A number of hours from one second (1/3600) to `high`."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 1 <= value * 3600 <= high * 3600:
        raise ConfigError(f"{name} must be a number of hours from 1/3600 (one second) to {high}, fractions "
                          f"allowed (0.5 = 30 minutes), got {value!r}")


def require_fraction(name: str, value: object, *, at_0: str = "off", at_1: str = "every key") -> None:
    """A number from 0 to 1; the error says what each end means (`at_0`, `at_1`)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise ConfigError(f"{name} must be a number from 0 ({at_0}) to 1 ({at_1}), got {value!r}")


def require_int(name: str, value: object, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ConfigError(f"{name} must be an integer from {low} to {high}, got {value!r}")
