"""A batch's index entries staged apart (one Arrow blob under the batch id) until the commit
carrying the batch is seen in the Delta log, then promoted into the keyspaces; and the
entries of other writers' commits written in."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from sink.index.entry import (
    Entry,
    change_orderings,
    changes_schema,
    entries_of_changes,
    pack_array,
    pack_located_many,
)
from sink.index.keyspaces import Keyspaces
from sink.index.metadata import ReplicaMeta
from sink.index.spec import GLOBAL


def changes_table(changes: Mapping[str, Mapping[bytes, Entry]], width: int = 1) -> pa.Table:
    """Staged changes as the Arrow table `stage` takes, from pid -> key -> entry."""
    schema = changes_schema(width)
    rows = [(pid, key, *e.values(), e.deleted, e.deleted_at) for pid, entries in changes.items()
            for key, e in entries.items()]
    return pa.Table.from_arrays([pa.array(c, t.type) for c, t in zip(zip(*rows), schema)]
                                if rows else [pa.array([], f.type) for f in schema], schema=schema)


class Staging:
    """The staged batch of one open replica, and the writes of committed changes."""

    def __init__(self, meta: ReplicaMeta, keyspaces: Keyspaces):
        self._meta = meta
        self._keyspaces = keyspaces

    def stage(self, batch_id: int, changes: pa.Table | Mapping[str, Mapping[bytes, Entry]],
              read_version: int | None = None) -> None:
        """Record what `batch_id`, tagged against table version `read_version`, changes
        (`changes_schema` rows), replacing what was staged before."""
        schema = changes_schema(self._meta.width)
        if not isinstance(changes, pa.Table):
            changes = changes_table(changes, self._meta.width)
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, schema) as writer:
            writer.write_table(changes.cast(schema))
        self._meta.set_staged(batch_id, sink.getvalue().to_pybytes(), read_version)

    def staged(self) -> dict[str, dict[bytes, Entry]]:
        table = self._staged_table()
        return {} if table is None else entries_of_changes(table)

    def promote(self) -> int:
        """Move staged entries into the committed view. Returns entries promoted."""
        table = self._staged_table()
        promoted = 0 if table is None else self.apply_changes(table)
        self._meta.discard_staged()
        return promoted

    def _staged_table(self) -> pa.Table | None:
        raw = self._meta.staged_data
        return None if raw is None else pa.ipc.open_stream(raw).read_all()

    def apply_changes(self, changes: pa.Table) -> int:
        """Write committed entries (`changes_schema` rows) into the partitions held; others are
        skipped (they load from the table, which already has the commit). Returns entries written."""
        if not changes.num_rows:
            return 0
        keyspaces, meta = self._keyspaces, self._meta
        if meta.located:
            if not meta.has_partition(GLOBAL):
                return 0
            raws = pack_located_many(change_orderings(changes), changes.column("deleted").to_numpy(False),
                                     changes.column("pid").combine_chunks(), _deleted_at(changes))
            keyspaces.put_packed(GLOBAL, changes.column("key").to_pylist(), raws)
            return changes.num_rows
        # One sort by partition, then each held partition's rows are one slice.
        encoded = pc.dictionary_encode(changes.column("pid")).combine_chunks()
        codes = encoded.indices.to_numpy()
        order = np.argsort(codes, kind="stable")
        bounds = [0, *(np.flatnonzero(np.diff(codes[order])) + 1).tolist(), len(order)]
        rows = changes.take(pa.array(order))
        keys = rows.column("key").combine_chunks()
        raws = pack_array(change_orderings(rows), rows.column("deleted").to_numpy(False), _deleted_at(rows))
        applied = 0
        for start, end in zip(bounds[:-1], bounds[1:]):
            pid = encoded.dictionary[codes[order[start]]].as_py()
            if meta.has_partition(pid):
                keyspaces.put_packed(pid, keys.slice(start, end - start).to_pylist(),
                                     raws.slice(start, end - start).to_pylist())
                applied += end - start
        return applied


def _deleted_at(changes: pa.Table):
    return pc.fill_null(changes.column("deleted_at"), 0).to_numpy()
