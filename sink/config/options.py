"""The sink's options as a user writes them: `SinkOptions`' fields are the keys of the TOML
`[sink]` table, each with its docstring (the configuration reference is generated from them:
sink.config.docs), and the columns they name. `SinkConfig` (sink.config.sink_config) checks
them and reads them from a file; the sections (sink.config.sections) check them by what they
are about."""

from __future__ import annotations

from dataclasses import dataclass, field

from sink.ordering import columns_of

# An ordering column named in except_columns is kept in the table under this prefix: the
# index, partition loads and the commit paths read it from there.
HIDDEN_ORDERING_PREFIX = "__ordering_"


@dataclass
class SinkOptions:
    """What the sink writes where. Field names are the keys of the TOML `[sink]` table."""

    table_uri: str
    """Delta table (path or URI); created on the first batch from the stream's schema."""
    key: list[str]
    """Key columns (string, integer, date, boolean). May include partition columns, as a natural
    key often does (`["store_id", "sku"]` with `partition_by = ["store_id"]`), but not only those."""
    ordering: str | list[str]
    """Ordering column (timestamp, date, integer); the highest value wins. A list (`["ts", "seq"]`)
    compares its columns in order, the next one only on a tie, like AUTO CDC's
    `SEQUENCE BY STRUCT(ts, seq)`; the table records the list, so changing it is a contract change."""
    partition_by: list[str] = field(default_factory=list)
    """Partition columns (string, integer, date, boolean); may be empty."""
    except_columns: list[str] = field(default_factory=list)
    """Stream columns that route and classify records (an op code, say) but are not stored, like
    AUTO CDC's `except_column_list`; never a key or partition column. An ordering column named
    here is kept in the reserved column `__ordering_<name>` instead (Delta has no hidden
    columns); moving one in or out on an existing table is refused (the contract records it)."""
    delete_when: str | None = None
    """Spark SQL boolean expression marking a delete, e.g. `"op = 'd'"`."""
    quarantine_when: str | None = None
    """Spark SQL boolean expression for records that must not be written (value rules the user
    knows, e.g. `"total_cents < 0"`): they go to quarantine with the reason
    `quarantine_when: <expression>` (a null result passes)."""
    check_constraints: str = "quarantine"
    """What happens to a record that would break one of the table's CHECK constraints (Delta's
    `ALTER TABLE ... ADD CONSTRAINT`), column invariants or generated columns (a value other
    than its expression's): `"quarantine"` sends it to quarantine with the reason
    `CHECK constraint <name> (<expression>) violated` (`invariant on column <c>`, `generated
    column <c>`) before anything is written; `"fail"` refuses the batch with a
    `ConstraintViolationError` naming the check and a key, nothing written (Spark replays it);
    on a table whose updates go through MERGE (and under `ignore_null_updates` or `scd_type =
    2`, which MERGE), `"fail"` leaves the check to the engine, whose commit fails with Delta's
    error."""
    corrupt_record_column: str = "_corrupt_record"
    """Spark's corrupt-record column (the reader's `columnNameOfCorruptRecord`): when the stream has
    it, records where it is set (a value that did not parse as its type, which PERMISSIVE reading
    turns into a null; a malformed line) go to quarantine with their raw text. Never stored."""
    ignore_null_updates: bool = False
    """Partial updates, like AUTO CDC's `ignore_null_updates`: an update's null columns keep the
    stored value. A key's records in one batch fold in order; a delete still removes the row,
    and an upsert after it starts from nulls; in a history table nulls fill in sequence order."""
    unchanged_value: str | None = None
    """A string value that stands for a value the source did not send (Debezium's
    `__debezium_unavailable_value`, for a PostgreSQL TOAST column an update left unchanged
    under the default replica identity): in an update, a string column holding it keeps the
    stored value, and the rest of the update is applied. A record holding it for a key the table
    does not store (new to the table, or deleted earlier in the batch) has nothing to keep:
    `unsent_values` says what becomes of it. The placeholder is never written. Not with
    `scd_type = 2`. The ready job sets it on Debezium tables. Default: none."""
    unsent_values: str = "quarantine"
    """What becomes of a record holding `unchanged_value` for a key the table does not store:
    `"quarantine"` sets aside the key's records in the batch that hold it, with a reason naming
    the key and the column, and applies the rest; `"fail"` fails the batch with an
    UnchangedValueError, nothing written (Spark replays it: the query stops until the input
    changes)."""
    append_only_changes: str = "quarantine"
    """On a table whose `delta.appendOnly` is true, which takes inserts only: what becomes of a
    record that would update or delete a stored row. `"quarantine"` sets aside the key's
    records in the batch, with a reason naming the key, and writes the rest; `"fail"` fails the
    batch with an AppendOnlyError, nothing written."""
    freshness_column: str | None = None
    """A column holding when the source made each change: epoch milliseconds as a BIGINT
    (Debezium's `ts_ms`) or a TIMESTAMP. Each batch then reports its records' end-to-end
    freshness (its commit time minus theirs: median, 99th percentile, oldest) in its log line and
    as `upsert_sink_freshness_seconds`. Default: none."""
    scope: str = "partitioned"
    """`"partitioned"`: a key is unique within its partition; `"global"`: unique across the table."""
    checkpoint_dir: str | None = None
    """The query's checkpoint location; the writer id is derived from it."""
    writer_id: str | None = None
    """Stable Delta app id of this writer (the app transaction of every commit).
    Default: derived from the table and the checkpoint."""
    index_dir: str | None = None
    """Where shard replicas live. Default: `<Spark local dir>/upsert-sink-index`."""
    num_shards: int | None = None
    """Index shards = tagging tasks per batch. Default: Spark's default parallelism."""
    bootstrap_days: int = 7
    """A new or unusable replica loads the partitions of the last N days."""
    partition_ttl_hours: int = 168
    """Partitions not accessed for this long are evicted from a replica."""
    partition_date: str | list[str] | None = None
    """How a partition's date is read: a date column, a string column parsed with
    `partition_date_format`, or `[year, month, day]` columns.
    Default: detected from the partition columns (a date column, year/month/day, or one
    `%Y-%m-%d` string column)."""
    partition_date_format: str = "%Y-%m-%d"
    """`strptime` format of string partition dates (`"%Y-%m"` for month partitions); a bootstrap
    that finds no value parsing under it, and no `tiering_column` value, logs a warning."""
    tiering_column: str | None = None
    """For partitions without a date: the column whose max value (Delta file statistics) dates
    the partition."""
    index_max_bytes: int | None = None
    """Disk budget of one shard replica; least recently used partitions go first (partitioned
    scope only)."""
    hot_cache_entries: int = 200_000
    """Entries kept in memory per shard replica (and Python worker) in front of RocksDB; 0 = off."""
    resident_keys: int | None = None
    """Entries per shard replica of the keyspaces held whole in memory: those a batch looks up
    most answer without RocksDB; 0 = off. Spark's Python workers hold none unless set: a
    shard's tasks move between workers, and each move would build them again inside a task.

    Default: 1,000,000 where the driver tags, 0 in Spark's Python workers."""
    cross_partition_check: int = 1000
    """Partitioned scope: new keys per shard and batch looked up in the replica's other held
    partitions, to signal keys that get a second row in another partition; 0 = off."""
    peek_max_keys: int = 4
    """Partitioned scope: a partition the replica does not hold, of which a shard's records in a
    batch name at most this many keys, is read for those keys alone instead of loaded (named
    again within `partition_ttl_hours`, it loads); 0 = always load. More keys than a handful in
    one batch: the partition is being written to, and loads at once."""
    verify_fraction: float = 0.01
    """Partitioned scope: before a batch is tagged, this share of its keys (at least one per
    partition checked, in one partition per shard, another each batch) is read from the table and the
    tombstone table and compared with the replica; a partition where they differ is logged at
    ERROR, counted (`upsert_sink_index_verify_mismatches_total`) and reloaded before the batch is
    tagged against it; 0 = off. On an unpartitioned table, whose one partition is the whole
    table, the shards check in turn, one a batch."""
    verify_every_batches: int = 1
    """Run the sampled verification (`verify_fraction`) on every N-th batch."""
    replica_snapshot_every_versions: int = 0
    """Publish each shard's replica to `replica_snapshot_uri` once this many table versions have
    passed since its last snapshot (and right after its first load); a process without a
    replica (a new executor, a driver on a new disk) then starts from the newest snapshot and
    catches up from the log, instead of reading the key columns of the whole table. At most
    `changelog_retention_versions`, whose changelog the catch-up replays. 0 = off:
    each snapshot is a copy of the replica in storage (12 bytes a key for the mirror bench's
    12-byte keys), and with driver tagging it turns on the index changelog the catch-up reads
    this writer's batches from."""
    index_block_cache_bytes: int = 64 << 20
    """RocksDB block cache shared by the replicas of one process (bloom filters and a data-block
    hash index are always on)."""
    file_cache_bytes: int = 256 << 20
    """Data files the driver wrote (driver tagging), held in memory so the next batch's rewrite of
    them skips reading them back; 0 = off. Spark's writing tasks hold none: which Python worker
    gets a partition's writes changes from batch to batch, and executors' memory is tighter."""
    probe_cache_bytes: int = 512 << 20
    """The key and ordering columns of data files the driver probed for a batch's updated and
    deleted keys (driver tagging), held in memory so that probing a file again reads none of it:
    merge-on-read leaves every file it marks in place, and a rewrite the files it did not change;
    0 = off. About 25 bytes a row with a short string key and one ordering column (a 10M-row
    table's files: ~250 MB)."""
    tag_on: str = "auto"
    """Where tagging runs: `"executors"` (Spark tasks next to executor-local replicas), `"driver"`
    (the driver process: no shuffle, replicas on the driver's disk), or `"auto"`: the driver
    under a local master (`local`, `local[N]`), else the executors."""
    engine: str = "auto"
    """The Delta engine: `"deltalake"` (delta-rs alone); `"delta-spark"`: Delta's Spark engine
    commits where neither delta-rs nor the sink's own commit can (row tracking; identity
    columns of history tables; column mapping over a nested column; `commit_mode = "merge"`:
    its MERGE), delta-rs and the sink's commit the rest (needs Delta's extension in the
    session); `"auto"`: the same, but delta-rs' MERGE where a MERGE is needed and the table
    allows it (the faster one: docs, Delta's Spark engine)."""
    metrics_port: int = 9466
    """Prometheus endpoint on the driver; 0 = off."""
    ties: str = "incoming"
    """Which record wins when the incoming ordering value equals the stored one: `"incoming"` or
    `"existing"`."""
    quarantine_table_uri: str | None = None
    """Where bad records go, with their reason. Default: `<table_uri>_quarantine`."""
    tombstone_table_uri: str | None = None
    """Deleted keys and their ordering, so a late older update stays deleted after a reload.
    Default: `<table_uri>_tombstones`."""
    tombstone_ttl_hours: float | None = None
    """Deletes older than this stop shielding their key from late older updates, and
    `python -m sink compact-tombstones` drops their rows; unset: kept forever. Fractions of an
    hour count, down to one second (`0.5` = 30 minutes; DLT sets its tombstone GC threshold in
    seconds)."""
    changelog_uri: str | None = None
    """Index entries of each batch by shard, so a replica that did not tag a batch (the shard's
    task ran on another executor) catches up without reloading.
    Default: `<table_uri>_index_changelog`."""
    changelog_retention_versions: int = 1000
    """Changelog entries of batches that read a version this much older than the latest are
    deleted."""
    replica_snapshot_uri: str | None = None
    """Where replica snapshots are published (`replica_snapshot_every_versions`).
    Default: `<table_uri>_index_snapshots`."""
    max_commit_retries: int = 10
    """After another writer's commit got in first: commit again (or tag again, when it touched
    the batch's partitions) this many times, then fail naming the other writer. Each retry
    waits first, 0.2 s doubling up to 10 s, times a random factor from 0.5 to 1.5 (about 50 s
    in all at the default), so two writers that keep meeting take turns."""
    commit_mode: str = "auto"
    """A batch with updated or deleted keys: `"auto"` rewrites the files holding them and commits
    the new files, or on a table with deletion vectors marks their rows deleted in them and
    writes only the new row versions (merge-on-read), either writing the change data feed's
    files where the table has one, falling back to MERGE, logged, on tables with features
    neither honours (column mapping; constraints and generated columns where rows are not
    records as they arrived: `ignore_null_updates`, `scd_type = 2`); `"merge-on-read"`: as
    `"auto"`, on a table with deletion vectors: the sink creates its table with them, and
    turns them on in an existing one only with `allow_protocol_upgrade`; `"merge"`: always
    delta-rs' MERGE."""
    allow_protocol_upgrade: bool = False
    """With `commit_mode = "merge-on-read"` on an existing table without deletion vectors: turn
    them on (`delta.enableDeletionVectors`), which upgrades its protocol to reader version 3
    and writer version 7: readers without deletion-vector support (Delta Lake before 2.3,
    for instance) can no longer read it; and a TIMESTAMP_NTZ column a batch adds to a table
    without the `timestampNtz` feature: add the feature. Off: such a table is refused, with the
    statement that turns them on (a TIMESTAMP_NTZ column naming the column). No other commit
    of the sink changes the table's protocol."""
    rewrite_marked_share: float = 0.5
    """Merge-on-read: a file in which at least this share of the rows would be marked deleted
    (by its deletion vector and the batch together) is rewritten instead: its other rows are
    copied into the batch's new file and its deletion vector dropped. At 0.5 the copy costs no
    more rows than are dead, and readers never read a file more than half dead that a batch
    touched. `1`: mark always (a file whose every row goes is removed); `0`: rewrite every file
    a batch changes, as copy-on-write. The batch line counts both (`files_marked`,
    `files_rewritten`). Files no batch touches keep their marks: `OPTIMIZE` rewrites those more
    than 5% marked, `REORG TABLE ... APPLY (PURGE)` all."""
    schema_evolution: str = "add_columns"
    """A stream column the table lacks: `"add_columns"` adds it (nullable) with the batch's commit,
    `"fail"` refuses the batch."""
    scd_type: int = 1
    """`1`: one row per key, its latest state. `2`: a history table (AUTO CDC's STORED AS SCD TYPE
    2), one row per version of a key, valid from `__START_AT` until `__END_AT` (null: current)."""
    track_history_columns: list[str] | None = None
    """`scd_type = 2`: the stored columns whose change opens a version; a change of the others
    only updates the current one (AUTO CDC's `TRACK HISTORY ON (...)`).
    Default: every stored column but the key and partition ones, the ordering column included
    when it is stored, as in AUTO CDC (global scope: the partition columns are tracked too)."""
    track_history_except_columns: list[str] | None = None
    """`scd_type = 2`: the stored columns whose change does not open a version
    (`TRACK HISTORY ON * EXCEPT (...)`); not with `track_history_columns`."""

    # --- the columns the options name ------------------------------------------------------------

    def tracked_columns(self, stored: list[str]) -> list[str]:
        """scd_type = 2: of the table's `stored` columns, those whose change opens a version. By
        default all but the key and partition columns: a stored ordering column is tracked, as
        AUTO CDC tracks it (every event then opens a version); one except_columns leaves out
        of the table (kept under a hidden name) is not."""
        hidden = set(self.hidden_ordering.values()) | {c for c in self.ordering_columns
                                                       if c.startswith(HIDDEN_ORDERING_PREFIX)}
        values = [c for c in stored if c not in self.identity_columns and c not in hidden]
        if self.track_history_columns is not None:
            return [c for c in values if c in self.track_history_columns]
        return [c for c in values if c not in (self.track_history_except_columns or ())]

    @property
    def ordering_columns(self) -> list[str]:
        """The ordering columns, compared in this order."""
        return columns_of(self.ordering)

    @property
    def unstored_columns(self) -> list[str]:
        """Stream columns the table never stores: except_columns and the corrupt-record column."""
        return [*self.except_columns, self.corrupt_record_column]

    @property
    def hidden_ordering(self) -> dict[str, str]:
        """Ordering columns named in except_columns -> the column the table keeps each in."""
        return {c: HIDDEN_ORDERING_PREFIX + c for c in self.ordering_columns if c in self.except_columns}

    @property
    def identity_columns(self) -> list[str]:
        """The columns naming one key of the table: the key, in partitioned scope with its
        partition (a key in another partition is another key)."""
        if self.scope == "global":
            return [*self.key]
        return [*self.partition_by, *(c for c in self.key if c not in self.partition_by)]

    @property
    def tombstone_key(self) -> list[str]:
        """What one tombstone row stands for: a key (`identity_columns`); in a history table
        every delete of it, so its ordering too."""
        key = self.identity_columns
        return [*key, *self.ordering_columns] if self.scd_type == 2 else key
