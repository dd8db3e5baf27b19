"""`python -m sink inspect | bootstrap | verify | contract | compact-tombstones | other-writers
--config conf/sink.toml`."""

from __future__ import annotations

import argparse
import datetime as dt
import json
import re
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
from deltalake import DeltaTable

from sink.batch.other_writers import OtherWriters
from sink.columns import distinct
from sink.config import SinkConfig
from sink.delta_log import metadata_commit
from sink.delta_log.column_mapping import log_keys
from sink.delta_log.contract import Contract
from sink.delta_log.reading import READ_VERSION_PROPERTY, read_commit, recorded_num_shards
from sink.delta_log.schema import plain_layouts
from sink.errors import SinkError
from sink.index import changelog, holder
from sink.index.catchup import catch_up
from sink.index.entry import Entry, unpack_many
from sink.index.entry import size as entry_size
from sink.index.lifecycle import ShardSource, bootstrap
from sink.index.loader import read_global, read_partition
from sink.index.replica import ShardReplica
from sink.index.spec import GLOBAL, replica_path, replica_spec
from sink.keys import describe_key
from sink.library_errors import first_line
from sink.ops.tombstones import compact
from sink.tagging.task_context import default_index_root

_SHARD_DIR = re.compile(r"^shard-(\d+)-of-(\d+)$")


@dataclass(frozen=True)
class Context:
    cfg: SinkConfig
    table: DeltaTable
    index_root: Path

    @property
    def table_dir(self) -> Path:
        return self.index_root / self.table.metadata().id

    def replicas(self) -> list[tuple[int, int, Path]]:
        """(shard, shard count, path) of every replica of this table on this machine."""
        found = []
        if self.table_dir.is_dir():
            for child in self.table_dir.iterdir():
                m = _SHARD_DIR.match(child.name)
                if m:
                    found.append((int(m[1]), int(m[2]), child))
        return sorted(found, key=lambda r: (r[1], r[0]))


def _context(args) -> Context:
    cfg = SinkConfig.from_file(args.config, args.sink).as_stored()
    if not DeltaTable.is_deltatable(cfg.table_uri):
        raise SinkError(f"no Delta table at {cfg.table_uri} (table_uri in {args.config})")
    root = Path(args.index_dir or cfg.index_dir or default_index_root())
    return Context(cfg, DeltaTable(cfg.table_uri), root)


def _iso(ts: float) -> str:
    return dt.datetime.fromtimestamp(ts, dt.UTC).isoformat(timespec="seconds")


# --- inspect ----------------------------------------------------------------------------------


# How long `inspect` and `verify` wait for a process holding a replica open to checkpoint it.
HOLDER_WAIT_S = 10.0


def holder_state(path: Path, wait_s: float) -> dict:
    """Who holds the replica at `path`, after asking a live holder to checkpoint it so that a
    read-only open sees what it holds now: `state` is "closed", "held" (`live`: whether it
    checkpointed for this read) or "left dirty" (its holder exited without closing it)."""
    held = holder.read(path)
    if held is None:
        return {"state": "closed"}
    by = {"pid": held.pid, "host": held.host, "since": _iso(held.since)}
    alive = held.alive()
    if alive is False:
        return {"state": "left dirty", "held_by": by}
    return {"state": "held", "held_by": by, "live": holder.request_checkpoint(path, wait_s)}


def holder_states(replicas: list[tuple[int, int, Path]], wait_s: float) -> list[dict]:
    """`holder_state` of every replica, asked all at once: a busy holder makes the whole
    command wait `wait_s` once, not once per shard."""
    if not replicas:
        return []
    with ThreadPoolExecutor(max_workers=len(replicas)) as pool:
        return list(pool.map(lambda r: holder_state(r[2], wait_s), replicas))


def inspect(ctx: Context, wait_s: float = HOLDER_WAIT_S) -> dict:
    shards = []
    replicas = ctx.replicas()
    for (shard, of, path), state in zip(replicas, holder_states(replicas, wait_s)):
        try:
            replica = ShardReplica.open_read_only(path)
        except Exception as e:  # damaged: the sink wipes and rebuilds it on its next open
            shards.append({"shard": shard, "of": of, "path": str(path), **state,
                           "error": first_line(e), "partitions": []})
            continue
        with replica:
            sizes = replica.keyspaces.partition_sizes()
            partitions = [
                {"partition": pid, "entries": sizes[pid][0], "bytes": sizes[pid][1], "reason": info.reason,
                 "loaded_at": _iso(info.loaded_at), "last_access": _iso(info.last_access)}
                for pid, info in sorted(replica.partitions().items())
            ]
            shards.append({"shard": shard, "of": of, "path": str(path), **state, "version": replica.version,
                           "staged_batch": replica.staged_batch, "clean": replica.clean,
                           "partitions": partitions})
    return {"table_uri": ctx.cfg.table_uri, "table_id": ctx.table.metadata().id,
            "table_version": ctx.table.version(), "index_dir": str(ctx.index_root), "shards": shards}


def describe_state(s: dict) -> str:
    """How a shard's holder reads in a line (`holder_state`)."""
    if s["state"] == "closed":
        if s.get("clean", True):
            return "closed"
        return "left dirty (no holder recorded): the sink rebuilds it on its next open"
    by = s["held_by"]
    who = f"pid {by['pid']} on {by['host']} since {by['since']}"
    if s["state"] == "left dirty":
        return f"left dirty by {who}, which has exited: the sink rebuilds it on its next open"
    if s["live"]:
        return f"held open by {who}; checkpointed for this read"
    return (f"held open by {who}, which did not checkpoint it for this read in time (busy with a batch): "
            "shown as of its last checkpoint or flush")


def print_inspect(report: dict) -> None:
    print(f"table {report['table_uri']} (id {report['table_id']}) at version {report['table_version']}")
    print(f"index {report['index_dir']}")
    if not report["shards"]:
        print("no replicas on this machine")
    for s in report["shards"]:
        if "error" in s:
            print(f"\nshard {s['shard']} of {s['of']}: cannot be read: {s['error']}")
            continue
        entries = sum(p["entries"] for p in s["partitions"])
        size = sum(p["bytes"] for p in s["partitions"])
        print(f"\nshard {s['shard']} of {s['of']}: version {s['version']}, {len(s['partitions'])} partitions, "
              f"{entries} entries, {size / 1e6:.1f} MB"
              + (f", staged batch {s['staged_batch']}" if s["staged_batch"] is not None else "")
              + f"; {describe_state(s)}")
        if s["partitions"]:
            print(f"  {'partition':<32} {'entries':>10} {'bytes':>12}  {'reason':<10} last access")
            for p in s["partitions"]:
                print(f"  {p['partition']:<32} {p['entries']:>10} {p['bytes']:>12}  {p['reason']:<10} "
                      f"{p['last_access']}")


# --- bootstrap --------------------------------------------------------------------------------


def _bar(shard: int):
    started = time.perf_counter()

    def show(done: int, total: int, keys: int) -> None:
        width = 30
        filled = int(width * done / total) if total else width
        rate = keys / max(time.perf_counter() - started, 1e-9)
        sys.stderr.write(f"\rshard {shard} [{'#' * filled}{'.' * (width - filled)}] "
                         f"{done}/{total} partitions, {keys} keys, {rate:,.0f} keys/s")
        if done == total:
            sys.stderr.write("\n")
        sys.stderr.flush()
    return show


def prewarm(ctx: Context, num_shards: int, now: float) -> list[dict]:
    cfg = ctx.cfg
    # What other writers deleted is recorded before a replica loads at this version.
    version = OtherWriters(cfg, cfg.resolved_writer_id).follow(ctx.table)
    spec = replica_spec(cfg.key, cfg.partition_by, cfg.ordering, cfg.scope)
    results = []
    named = log_keys(ctx.table, cfg.partition_by)  # the log's names of the partition columns
    for shard in range(num_shards):
        path = replica_path(ctx.index_root, ctx.table.metadata().id, shard, num_shards)
        with ShardReplica.open(path, spec) as replica:
            if replica.repaired:
                print(f"shard {shard}: was damaged ({replica.repaired}); wiped, bootstrapping", file=sys.stderr)

            def own_changes(v: int, batch: int, shard=shard):
                header = changelog.Header(ctx.table.metadata().id, cfg.resolved_writer_id, batch, num_shards, spec)
                return changelog.read(cfg.resolved_changelog_uri, v, header, shard)

            report = catch_up(replica, version, lambda v: read_commit(cfg.table_uri, v, cfg.partition_by, named),
                              cfg.resolved_writer_id, shard, read_changelog=own_changes, num_shards=num_shards)
            if report.rebuilt is None:
                print(f"shard {shard}: warm at version {version}, {len(replica.partitions())} partitions held",
                      file=sys.stderr)
                results.append({"shard": shard, "loaded": 0, "keys": 0, "seconds": 0.0})
                continue
            source = ShardSource.open(cfg.table_uri, cfg.resolved_tombstone_uri, version, cfg.key, cfg.ordering_columns,
                                      shard, num_shards, cfg.partition_by, cfg.scd_type == 2)
            loaded = bootstrap(replica, source, cfg.partition_by, (cfg.partition_date, cfg.partition_date_format),
                               cfg.tiering_column, cfg.bootstrap_days, now, progress=_bar(shard))
            results.append({"shard": shard, "loaded": loaded.partitions, "keys": loaded.keys,
                            "seconds": round(loaded.seconds, 3)})
    return results


# --- verify -----------------------------------------------------------------------------------


def verify(ctx: Context, wait_s: float = HOLDER_WAIT_S) -> list[dict]:
    """Every replica against the table at the replica's version: one result per shard (with
    `error` where the replica cannot be read, e.g. damaged files, or its holder is busy)."""
    results = []
    replicas = ctx.replicas()
    for (shard, of, path), state in zip(replicas, holder_states(replicas, wait_s)):
        if state["state"] == "held" and not state["live"]:
            results.append({"shard": shard, "of": of, "version": None, "entries_checked": 0, "mismatches": 0,
                            "examples": [], "error": describe_state(state) + "; run verify again"})
            continue
        try:
            results.append(_verify_shard(ctx.cfg, shard, of, path))
        except Exception as e:  # reported per shard; the sink wipes and rebuilds such a replica
            results.append({"shard": shard, "of": of, "version": None, "entries_checked": 0, "mismatches": 0,
                            "examples": [], "error": first_line(e)})
    return results


def _verify_shard(cfg: SinkConfig, shard: int, of: int, path: Path) -> dict:
    with ShardReplica.open_read_only(path) as replica:
        version, staged = _caught_up(cfg, replica)
        problems: list[str] = []
        checked = 0
        if version is not None:
            table = DeltaTable(cfg.table_uri, version=version)
            entry_bytes = entry_size(replica.width)
            for pid in sorted(replica.partitions()):
                held = dict(replica.keyspaces.entries(pid))
                if pid == GLOBAL:
                    read = read_global(table, None, cfg.key, cfg.partition_by, cfg.ordering_columns, shard, of)
                    keys, located = [], []
                    for chunk_keys, chunk_raws in read.chunks():
                        keys += chunk_keys
                        located += chunk_raws
                    raws = [raw[:entry_bytes] for raw in located]
                    places = replica.keyspaces.locations()
                    for where, entries in staged.items():
                        held.update(entries)
                        places.update(dict.fromkeys(entries, where))
                    if cfg.scd_type == 1:  # a history table's key lives in several partitions
                        problems += _misplaced(dict(zip(keys, (raw[entry_bytes:].decode() for raw in located))),
                                               places, cfg.key)
                else:
                    keys, raws = read_partition(table, None, pid, cfg.key, cfg.ordering_columns, shard, of)
                    held.update(staged.get(pid, {}))
                live = {k: Entry.of(v).ordering for k, v in zip(keys, unpack_many(raws, replica.width)[1].tolist())}
                checked += len(held)
                problems += _compare(pid, live, held, cfg.key, history=cfg.scd_type == 2)
    return {"shard": shard, "of": of, "version": version, "entries_checked": checked,
            "mismatches": len(problems), "examples": problems[:10]}


def _caught_up(cfg: SinkConfig, replica: ShardReplica) -> tuple[int | None, dict[str, dict[bytes, Entry]]]:
    """The version to check a read-only replica at, and the entries to see on top of it: when
    the table's next commit carries the batch the replica staged (the sink's last batch, whose
    entries its next tagging would promote first), that version and the staged entries; else
    the replica's own version and none."""
    version, batch = replica.version, replica.staged_batch
    if version is None or batch is None:
        return version, {}
    commit = read_commit(cfg.table_uri, version + 1, cfg.partition_by)
    if commit is None or commit.app_versions.get(cfg.resolved_writer_id) != batch:
        return version, {}
    read_version = commit.sink_int(READ_VERSION_PROPERTY)
    if read_version is not None and read_version != replica.meta.staged_read_version:
        return version, {}
    return version + 1, replica.staging.staged()


def _compare(pid: str, live: dict[bytes, int], held: dict, key_cols: Sequence[str], history: bool = False
             ) -> list[str]:
    """Mismatches of the table's keys (`live`: key -> ordering) and the replica's entries, keys
    shown as the key columns' values. A history table (scd_type = 2) keeps a deleted key's
    versions, and its index answers only whether a key is there: entries are checked for
    presence."""
    out = []
    for key, ordering in live.items():
        entry = held.get(key)
        shown = describe_key(key, key_cols)
        if entry is None:
            out.append(f"{pid}: key {shown} is in the table, not in the replica")
        elif history:
            continue
        elif entry.deleted:
            out.append(f"{pid}: key {shown} is in the table, deleted in the replica")
        elif entry.ordering != ordering:
            out.append(f"{pid}: key {shown} ordering {entry.ordering} in the replica, {ordering} in the table")
    for key, entry in held.items():
        if not entry.deleted and key not in live:
            out.append(f"{pid}: key {describe_key(key, key_cols)} is in the replica, not in the table")
    return out


def _misplaced(live: dict[bytes, str], held: dict[bytes, str], key_cols: Sequence[str]) -> list[str]:
    """Global scope: keys the replica places in another partition than the table's row."""
    return [f"key {describe_key(key, key_cols)} is in partition {pid} of the table, {held[key]} in the replica"
            for key, pid in live.items() if key in held and held[key] != pid]


# --- contract ---------------------------------------------------------------------------------


def contract(ctx: Context, rewrite: bool) -> tuple[int, list[str]]:
    """Compare the table's recorded contract with the config's; with `rewrite`, record the
    config's after checking that the table's rows satisfy it. (exit code, lines to print)"""
    cfg, table = ctx.cfg, ctx.table
    wanted, recorded = Contract.of(cfg), Contract.from_properties(table.metadata().configuration)
    shown = f"key {list(wanted.key)}, partition_by {list(wanted.partition_by)}, ordering {wanted.ordering!r}, " \
            f"scope {wanted.scope!r}"
    if not rewrite:
        if recorded is None:
            return 0, [f"{cfg.table_uri} records no contract yet; the sink records the config's on its first batch: "
                       f"{shown}"]
        if recorded == wanted:
            return 0, [f"table and config agree: {shown}"]
        return 1, ["the table records another contract than the config (table vs config):",
                   *(f"  {d}" for d in recorded.differences(wanted)),
                   "change it deliberately with --rewrite (checks the table's rows against the config's)"]
    if recorded is not None and (recorded.scd_type, recorded.track_history) != (wanted.scd_type, wanted.track_history):
        return 1, ["not recorded: a rewrite cannot change scd_type or the tracked columns (table vs config): "
                   f"scd_type {recorded.scd_type} vs {wanted.scd_type}, track_history {recorded.track_history} vs "
                   f"{wanted.track_history}; write the history into a new table"]
    problems = _unmet(table, wanted)
    if problems:
        return 1, [f"not recorded: the table does not satisfy the config's contract ({shown}):",
                   *(f"  {p}" for p in problems)]
    metadata_commit.set_properties(table, cfg.table_uri, wanted.properties())
    return 0, [f"recorded: {shown}", "replicas built under the old contract are rebuilt when a task next opens them"]


def _unmet(table: DeltaTable, wanted: Contract) -> list[str]:
    """Why the table's rows do not satisfy `wanted` (no problem: empty)."""
    columns = set(pa.schema(table.schema().to_arrow()).names)
    missing = [c for c in (*wanted.key, *wanted.partition_by, *wanted.ordering_columns) if c not in columns]
    if missing:
        return [f"column(s) {missing} are not in the table"]
    if list(table.metadata().partition_columns) != list(wanted.partition_by):
        return [f"the table is partitioned by {list(table.metadata().partition_columns)}, not "
                f"{list(wanted.partition_by)} (a rewrite cannot repartition it)"]
    if wanted.scd_type == 2:  # a history table has a row per version of a key
        return []
    unique_by = distinct(wanted.key, wanted.partition_by if wanted.scope == "partitioned" else ())
    # A scan: it reads through deletion vectors, which to_pyarrow_table refuses.
    counts = plain_layouts(pa.table(table.scan(columns=unique_by))).group_by(unique_by).aggregate([([], "count_all")])
    repeated = counts.filter(pc.greater(counts.column("count_all"), 1))
    if repeated.num_rows:
        example = repeated.slice(0, 1).drop_columns(["count_all"]).to_pylist()[0]
        return [f"{repeated.num_rows} key(s) have several rows under {unique_by}, e.g. {example}"]
    return []


# --- compact-tombstones -----------------------------------------------------------------------


def _compact_tombstones(cfg: SinkConfig, as_json: bool) -> int:
    done = compact(cfg, time.time())
    if as_json:
        print(json.dumps(None if done is None else done.__dict__, indent=2))
    elif done is None:
        print(f"no tombstone table at {cfg.resolved_tombstone_uri}: nothing to compact")
    else:
        ttl = "no tombstone_ttl_hours set" if cfg.tombstone_ttl_hours is None else \
            f"tombstone_ttl_hours = {cfg.tombstone_ttl_hours}"
        # A history table keeps every delete of a key: what goes is a delete recorded twice.
        dropped = "repeated deletes of a key at one ordering value, kept once" if cfg.scd_type == 2 else \
            "superseded by a newer delete of their key"
        print(f"{cfg.resolved_tombstone_uri}: {done.rows_before} rows -> {done.rows_after} "
              f"({done.superseded} {dropped}, {done.expired} expired under {ttl}; "
              f"{done.pending} of batches not committed yet kept)"
              + ("" if done.version is not None else "; nothing to rewrite"))
    return 0


# --- other-writers ----------------------------------------------------------------------------


def _other_writers(ctx: Context, accept_unread: bool) -> int:
    cfg = ctx.cfg
    followed = OtherWriters(cfg, cfg.resolved_writer_id)
    if accept_unread:
        version = followed.accept_unread(ctx.table)
        print(f"{cfg.table_uri}: recorded as followed up to version {version}; other writers' deletes before it that "
              "the log no longer held are not remembered")
        return 0
    try:
        version = followed.follow(ctx.table)
    except SinkError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"{cfg.table_uri}: other writers' commits followed up to version {version} (recorded in "
          f"{cfg.resolved_tombstone_uri})")
    return 0


# --- entry point ------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sink", description="Inspect, pre-warm and verify index replicas.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, text in [("inspect", "what each shard replica holds"),
                       ("bootstrap", "pre-warm replicas with the hot window"),
                       ("verify", "compare replicas with the table; exit 1 on a mismatch, 2 on an unreadable replica"),
                       ("contract", "compare the table's recorded contract with the config; exit 1 when they differ"),
                       ("compact-tombstones", "shrink the tombstone table to one row per key, dropping deletes "
                                              "older than tombstone_ttl_hours"),
                       ("other-writers", "record what other writers' commits deleted (and RESTOREs undid), as the "
                                         "next batch would; exit 1 when the sink cannot follow a commit")]:
        p = sub.add_parser(name, help=text)
        p.add_argument("--config", required=True, help="TOML file with a [sink] table")
        p.add_argument("--sink", metavar="TABLE", help="with several [[sink]] tables: which, by its table_uri as "
                                                       "written or its position from 0")
        p.add_argument("--index-dir", help="replicas' root (default: the config's, else Spark's local dir)")
        p.add_argument("--json", action="store_true", help="print JSON instead of a table")
        if name in ("inspect", "verify"):
            p.add_argument("--wait", type=float, default=HOLDER_WAIT_S, metavar="SECONDS",
                           help="how long a process holding a replica open may take to checkpoint it for "
                                f"this read (default {HOLDER_WAIT_S:.0f})")
        if name == "bootstrap":
            p.add_argument("--num-shards", type=int,
                           help="default: the config's num_shards, else the count the writer's latest batch used")
        if name == "contract":
            p.add_argument("--rewrite", action="store_true",
                           help="record the config's contract (after checking the table's rows against it)")
        if name == "other-writers":
            p.add_argument("--accept-unread", action="store_true",
                           help="record the table as it is now, without the commits the log no longer holds (their "
                                "deletes are then not remembered)")
    args = parser.parse_args(argv)
    try:
        ctx = _context(args)
    except SinkError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.command == "inspect":
        report = inspect(ctx, args.wait)
        if args.json:
            print(json.dumps(report, indent=2))
        else:
            print_inspect(report)
        return 0
    if args.command == "contract":
        code, lines = contract(ctx, args.rewrite)
        print("\n".join(lines))
        return code
    if args.command == "compact-tombstones":
        return _compact_tombstones(ctx.cfg, args.json)
    if args.command == "other-writers":
        return _other_writers(ctx, args.accept_unread)
    if args.command == "bootstrap":
        shards = args.num_shards or ctx.cfg.num_shards or recorded_num_shards(
            ctx.cfg.table_uri, ctx.table.version(), ctx.cfg.resolved_writer_id, ctx.cfg.partition_by)
        if shards is None:
            print(f"error: how many shards? {args.config} sets no num_shards and writer "
                  f"{ctx.cfg.resolved_writer_id!r} has no batch in {ctx.cfg.table_uri} yet; pass --num-shards N "
                  "(the job uses num_shards, else Spark's default parallelism)", file=sys.stderr)
            return 2
        try:
            results = prewarm(ctx, shards, time.time())
        except SinkError as e:  # another writer's commit the sink cannot follow
            print(f"error: {e}", file=sys.stderr)
            return 1
        if args.json:
            print(json.dumps(results, indent=2))
        return 0
    results = verify(ctx, args.wait)
    bad = sum(r["mismatches"] for r in results)
    errors = [r for r in results if "error" in r]
    if args.json:
        print(json.dumps({"ok": bad == 0 and not errors, "shards": results}, indent=2))
    else:
        for r in results:
            if "error" in r:
                print(f"shard {r['shard']} of {r['of']}: cannot be read: {r['error']}")
                continue
            print(f"shard {r['shard']} of {r['of']} at version {r['version']}: {r['entries_checked']} entries, "
                  f"{r['mismatches']} mismatches")
            for example in r["examples"]:
                print(f"  {example}")
        if errors:
            print(f"ERROR: {len(errors)} replica(s) cannot be read (the sink wipes and rebuilds a damaged replica "
                  "when a task next opens it; `python -m sink bootstrap` does it now)")
        if bad:
            print(f"MISMATCH: {bad} entries differ")
        elif not results:
            print(f"no replicas of {ctx.cfg.table_uri} under {ctx.table_dir}: nothing to verify")
        elif not errors:
            print(f"OK: every replica matches the table ({len(results)} checked)")
    return 2 if errors else 1 if bad else 0
