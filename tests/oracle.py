"""An independent model of what the table must hold: per key, the record with the highest
(ordering, batch, position in batch) wins; a winning delete means the key is absent."""

from __future__ import annotations

import random
from pathlib import Path
from typing import NamedTuple

from deltalake import DeltaTable

from sink.batch.driver_tagger import wait_caught_up
from sink.cli import Context, verify
from sink.index.registry import kept_open
from sink.index.replica import ShardReplica


class Event(NamedTuple):
    id: str | None
    dt: str | None
    ts: int | None
    op: str
    v: str


SCHEMA = "id string, dt string, ts long, op string, v string"


def _winners(batches: list[list[Event]]) -> dict[tuple, tuple[tuple, Event]]:
    """Per (partition, key): the winning record and its rank (ordering, batch, position)."""
    best: dict[tuple, tuple[tuple, Event]] = {}
    for b, events in enumerate(batches):
        for pos, e in enumerate(events):
            if e.id is None or e.dt is None or e.ts is None:
                continue
            rank = (e.ts, b, pos)
            key = (e.dt, e.id)
            if key not in best or rank > best[key][0]:
                best[key] = (rank, e)
    return best


def expected_rows(batches: list[list[Event]]) -> list[dict]:
    live = [e for _, e in _winners(batches).values() if e.op != "d"]
    return sorted((e._asdict() for e in live), key=lambda r: (r["dt"], r["id"]))


def expected_global_rows(batches: list[list[Event]]) -> list[dict]:
    """Scope "global": per key (whatever its partition) the record with the highest (ordering,
    batch, position) wins; a delete needs no partition, an upsert without one is bad input."""
    best: dict[str, tuple[tuple, Event]] = {}
    for b, events in enumerate(batches):
        for pos, e in enumerate(events):
            if e.id is None or e.ts is None or (e.dt is None and e.op != "d"):
                continue
            rank = (e.ts, b, pos)
            if e.id not in best or rank > best[e.id][0]:
                best[e.id] = (rank, e)
    live = [e for _, e in best.values() if e.op != "d"]
    return sorted((e._asdict() for e in live), key=lambda r: (r["dt"], r["id"]))


def expected_history(batches: list[list[Event]], scope: str = "partitioned") -> list[tuple]:
    """scd_type = 2, every stored column tracked: (dt, id, ts, op, v, start, end) per version.
    A key (with its partition in partitioned scope) holds, from each of its sequence values
    to the next, the event there (a delete beats an upsert; of two upserts the greater
    (dt, op, v), values in table order; absent after a delete); equal adjacent values are one
    version, showing its last event. Records without key or ordering, and upserts without
    their partition, are bad input; in partitioned scope so are deletes without it."""
    at: dict[tuple, dict[int, Event]] = {}
    values = (lambda e: (e.dt, e.op, e.v)) if scope == "global" else (lambda e: (e.op, e.v))
    for e in (e for events in batches for e in events):
        if e.id is None or e.ts is None or (e.dt is None and (e.op != "d" or scope == "partitioned")):
            continue
        held = at.setdefault(e.id if scope == "global" else (e.dt, e.id), {}).get(e.ts)
        rank = lambda x: (x.op == "d", [(v is not None, v) for v in values(x)])  # noqa: E731
        if held is None or rank(e) > rank(held):
            at[e.id if scope == "global" else (e.dt, e.id)][e.ts] = e
    rows = []
    for events in at.values():
        seqs = sorted(events)
        run: list | None = None  # [start, shown event]
        for s in [*seqs, None]:
            e = events.get(s)
            if run and (e is None or e.op == "d" or values(e) != values(run[1])):
                rows.append((run[1].dt, run[1].id, run[1].ts, run[1].op, run[1].v, run[0], s))
                run = None
            if e is not None and e.op != "d":
                run = [run[0] if run else s, e]
    return sorted(rows)


def random_global_batches(seed: int, batches: int, per_batch: int, keys: int = 120,
                          days: int = 5) -> list[list[Event]]:
    """Events whose key changes partition at random (moves), key-only deletes (no partition),
    re-sends of an earlier record (same ordering: a tie) and late, stale events."""
    rng = random.Random(seed)
    sent: list[Event] = []
    out = []
    for b in range(batches):
        events = []
        for j in range(per_batch):
            roll = rng.random()
            if sent and roll < 0.1:
                events.append(rng.choice(sent))  # an at-least-once source sends it again
                continue
            k = f"k{rng.randrange(keys)}"
            ts = rng.randrange(0, 60)
            if roll < 0.25:
                events.append(Event(k, None if rng.random() < 0.6 else f"2025-01-0{1 + rng.randrange(days)}", ts,
                                    "d", f"b{b}-{j}"))
            else:
                events.append(Event(k, f"2025-01-0{1 + rng.randrange(days)}", ts, "u", f"b{b}-{j}"))
        sent += events
        out.append(events)
    return out


def changed_keys(batches: list[list[Event]], batch: int) -> int:
    """Keys whose winning record (live or delete) after `batch` came from `batch`: the index
    entries that batch changed."""
    return sum(rank[1] == batch for rank, _ in _winners(batches[: batch + 1]).values())


def random_events(seed: int, batches: int, per_batch: int, keys: int, partition_of, ordering_of,
                  delete_share: float, bad_share: float = 0.0, tag: str = "") -> list[list[Event]]:
    """Batches of events over keys k0..k<keys-1>: `partition_of(k)` is a key's partition,
    `ordering_of(rng, batch)` an event's ordering value; a share of deletes and of records
    without a key (bad input)."""
    rng = random.Random(seed)
    out = []
    for b in range(batches):
        events = []
        for j in range(per_batch):
            k = rng.randrange(keys)
            ident = None if rng.random() < bad_share else f"k{k}"
            op = "d" if rng.random() < delete_share else "u"
            events.append(Event(ident, partition_of(k), ordering_of(rng, b), op, f"{tag}b{b}-{j}"))
        out.append(events)
    return out


def random_batches(seed: int, batches: int, per_batch: int, keys: int = 150, days: int = 4,
                   bad_share: float = 0.02) -> list[list[Event]]:
    """Few keys and a narrow ordering range: in-batch duplicates, ties, late and stale
    events, deletes followed by older updates, all happen often."""
    return random_events(seed, batches, per_batch, keys, lambda k: f"2025-01-0{1 + k % days}",
                         lambda rng, b: rng.randrange(0, 60), delete_share=0.15, bad_share=bad_share)


def verify_replicas(cfg) -> list[dict]:
    """`python -m sink verify` on the sink's replicas, as the stopped job left them (`taken_back`):
    asserts no mismatch, returns the results."""
    taken_back(cfg.index_dir)
    results = verify(Context(cfg, DeltaTable(cfg.table_uri), Path(cfg.index_dir)))
    assert results, "no replica found"
    assert [r["examples"] for r in results if r["mismatches"]] == []
    return results


def taken_back(index_dir: str | Path) -> None:
    """Every replica a Spark Python worker keeps open (sink.index.worker_replicas) checkpointed
    and let go, as when the job stops after its last batch: a read-write open asks the worker
    for it and waits until it let go; closing it leaves it clean. Replicas this process keeps
    open (driver tagging) stay, once their catch-up to the last commit has finished."""
    for table_dir in Path(index_dir).iterdir():
        wait_caught_up(table_dir)
    for path in sorted(Path(index_dir).glob("*/shard-*")):
        if kept_open(path) is not None:
            continue
        view = ShardReplica.open_read_only(path)
        spec = view.spec
        view.close()
        if spec is not None:
            ShardReplica.open(path, spec).close()


class TableModel:
    """The table as the documented rules make it, step by step: the stream's records (per
    (dt, id) the highest ordering wins, a later record on a tie, a delete leaves a tombstone);
    another writer's commits (a row it removed is deleted at that row's ordering, a row it
    wrote stands as written); a RESTORE (the model as it was at that version)."""

    def __init__(self):
        self.state: dict[tuple[str, str], Event] = {}  # the winner per key; op "d": a tombstone
        self._at: dict[int, dict[tuple[str, str], Event]] = {}

    def batch(self, events: list[Event]) -> None:
        for e in events:
            if e.id is None or e.dt is None or e.ts is None:
                continue
            held = self.state.get((e.dt, e.id))
            if held is None or e.ts >= held.ts:
                self.state[(e.dt, e.id)] = e

    def written(self, rows: list[Event]) -> None:
        """Another writer wrote these rows (an UPDATE, a MERGE, an INSERT): they stand."""
        for e in rows:
            self.state[(e.dt, e.id)] = e

    def removed(self, keys) -> None:
        """Another writer removed these keys' rows: deleted at the removed row's ordering."""
        for key in keys:
            held = self.state.get(key)
            if held is not None and held.op != "d":
                self.state[key] = held._replace(op="d")

    def live(self) -> dict[tuple[str, str], Event]:
        return {k: e for k, e in self.state.items() if e.op != "d"}

    def rows(self) -> list[dict]:
        return sorted((e._asdict() for e in self.live().values()), key=lambda r: (r["dt"], r["id"]))

    def remember(self, version: int) -> None:
        """The model as the table is at `version` (a RESTORE may bring it back)."""
        self._at[version] = dict(self.state)

    def versions(self) -> list[int]:
        """The versions remembered, oldest first."""
        return sorted(self._at)

    def restore(self, version: int) -> None:
        self.state = dict(self._at[version])
