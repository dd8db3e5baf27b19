"""Which deletion vector and which tags each live data file carries: the pieces of a snapshot
`deltalake` does not expose (its add actions lack the descriptor and the tags;
`deletion_vectors()` gives the rows, not the descriptor a commit's `remove` must name), which
the sink's merge-on-read commit names again when it marks a file.

Replayed from the log for these alone (the latest classic checkpoint, then the JSON commits
after it) and kept per table, moved forward commit by commit: a batch reads only the commits
since the last one.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import unquote

import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from sink.delta_log.deletion_vectors import Descriptor
from sink.delta_log.reading import filesystem
from sink.errors import DeletionVectorError

_CHECKPOINT = re.compile(r"^(\d{20})\.checkpoint(?:\.\d+\.(\d+))?\.parquet$")


class LiveDeletionVectors:
    """One table's data files that carry a deletion vector, by path (decoded), at a version;
    and those that carry tags (`tags`, at the version `at` last moved to)."""

    def __init__(self, uri: str):
        self.uri = uri
        self._fs, self._root = filesystem(uri)
        self._version: int | None = None
        self._live: dict[str, Descriptor] = {}
        self.tags: dict[str, dict[str, str]] = {}

    def at(self, version: int) -> dict[str, Descriptor]:
        """The descriptors live at `version` (files without a deletion vector are absent)."""
        if self._version is None or version < self._version or not self._apply(self._version + 1, version):
            self._rebuild(version)
        self._version = version
        return self._live

    def _rebuild(self, version: int) -> None:
        checkpoint, parts = self._latest_checkpoint(version)
        self._live, self.tags = {}, {}
        if checkpoint is not None:
            self._read_checkpoint(parts)
        if not self._apply((checkpoint if checkpoint is not None else -1) + 1, version):
            raise DeletionVectorError(f"{self.uri}: commits up to version {version} are not all in the log, "
                                      "and no checkpoint covers them: the files' deletion vectors cannot be read")

    def advance(self, version: int, actions: Sequence[Mapping[str, Any]]) -> None:
        """Move forward over `version`, a commit this process made of `actions` (as the log
        spells them), without reading it back; from any other version, `at` reads the log."""
        if self._version == version - 1:
            self._take(actions)
            self._version = version

    def _apply(self, first: int, last: int) -> bool:
        """Move forward over commits `first`..`last`; False when one is gone from the log."""
        for version in range(first, last + 1):
            try:
                with self._fs.open_input_stream(f"{self._root}/_delta_log/{version:020d}.json") as f:
                    self._take([json.loads(line) for line in f.read().decode().splitlines() if line.strip()])
            except FileNotFoundError:
                return False
        return True

    def _take(self, actions: Sequence[Mapping[str, Any]]) -> None:
        """One commit's actions. A commit replacing a file's deletion vector removes (path, old)
        and adds (path, new), in any order: removes first."""
        for action in actions:
            if "remove" in action:
                path = unquote(action["remove"]["path"])
                self._live.pop(path, None)
                self.tags.pop(path, None)
        for action in actions:
            if "add" in action:
                add = action["add"]
                self._keep(unquote(add["path"]), add.get("deletionVector"), add.get("tags"))

    def _keep(self, path: str, vector: Mapping[str, Any] | None, tags: Mapping[str, str] | None) -> None:
        """An added file's deletion vector and tags (None: it has none)."""
        if vector:
            self._live[path] = Descriptor.from_json(vector)
        else:
            self._live.pop(path, None)
        if tags:
            self.tags[path] = dict(tags)
        else:
            self.tags.pop(path, None)

    def _latest_checkpoint(self, version: int) -> tuple[int | None, list[str]]:
        """The latest complete classic checkpoint at or before `version`, and its files."""
        found: dict[int, dict[str, list[str]]] = {}
        for info in self._fs.get_file_info(pafs.FileSelector(f"{self._root}/_delta_log")):
            m = _CHECKPOINT.match(info.base_name)
            if m and int(m[1]) <= version:
                found.setdefault(int(m[1]), {}).setdefault(m[2] or "1", []).append(info.path)
        for v in sorted(found, reverse=True):
            for total, paths in found[v].items():
                if len(paths) == int(total):
                    return v, paths
        return None, []

    def _read_checkpoint(self, paths: list[str]) -> None:
        for path in paths:
            adds = pq.read_table(path, columns=["add"], filesystem=self._fs).column("add").combine_chunks()
            adds = adds.filter(pc.is_valid(adds))
            kept = [f for f in ("deletionVector", "tags") if adds.type.get_field_index(f) >= 0]
            if not kept:
                continue
            carrying = pc.or_(*(pc.is_valid(pc.struct_field(adds, f)) for f in kept)) if len(kept) > 1 else \
                pc.is_valid(pc.struct_field(adds, kept[0]))
            for add in adds.filter(carrying).to_pylist():
                tags = add.get("tags")
                # A checkpoint holds a map as (key, value) pairs.
                self._keep(unquote(add["path"]), add.get("deletionVector"),
                           dict(tags) if isinstance(tags, list) else tags)
