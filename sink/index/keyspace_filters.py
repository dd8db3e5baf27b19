"""The membership filter of every held keyspace of a replica (`sink.index.key_filter`): built
at a keyspace's load and kept in step with every write; saved in one file beside RocksDB at a
clean close, under the close's token; after a reopen, the saved one if the replica still
carries that token, else built by a scan of the keyspace."""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path

from sink.index.key_filter import KeyFilter, read_saved, saved_bytes
from sink.index.metadata import ReplicaMeta
from sink.index.spec import GLOBAL

log = logging.getLogger(__name__)

# The keyspaces' key filters, saved at a clean close (each valid under the token it names).
KEY_FILTER_FILE = "keys.filter"


class KeyspaceFilters:
    """`scan(pid)` builds a keyspace's filter from its keys; `name` says whose they are in logs."""

    def __init__(self, files: Path, meta: ReplicaMeta, read_only: bool, scan: Callable[[str], KeyFilter],
                 name: object):
        self._files = files
        self._meta = meta
        self._read_only = read_only
        self._scan = scan
        self._name = name
        self._kept: dict[str, KeyFilter] = {}  # per keyspace, loaded or built on first use
        self._saved: dict[str, bytes] | None = None  # the saved file's filters, read on first use

    def of(self, pid: str) -> KeyFilter:
        kept = self._kept.get(pid)
        if kept is None:
            kept = self._kept[pid] = self._saved_filter(pid) or self.scanned(pid)
        return kept

    def set(self, pid: str, built: KeyFilter) -> None:
        self._kept[pid] = built

    def rescan_if_full(self, pid: str) -> None:
        """A filter filled past its false-positive budget by writes is built again, larger."""
        if self._kept[pid].full:
            self._kept[pid] = self.scanned(pid)

    def scanned(self, pid: str) -> KeyFilter:
        built = self._scan(pid)
        # A growing partition's filter is rebuilt each time its keys double: worth a line only
        # for the global keyspace, whose scans take seconds.
        log.log(logging.INFO if pid == GLOBAL else logging.DEBUG, "replica %s: key filter of %s built from its %d keys",
                self._name, pid, built.keys)
        return built

    def nbytes(self, pids: Iterable[str]) -> int:
        return sum(self.of(pid).nbytes for pid in pids)

    def save(self, token: bytes, pids: Iterable[str]) -> None:
        """Save the filters of keyspaces `pids` under the token the close is about to write
        (re-stamping the saved ones this open did not use)."""
        path = self._files / KEY_FILTER_FILE
        filters = {pid: self._kept.get(pid) or self._saved_filter(pid) for pid in pids}
        part = path.with_suffix(".part")
        part.write_bytes(saved_bytes({pid: f.to_bytes(token) for pid, f in filters.items() if f is not None}))
        os.replace(part, path)

    def copy_saved(self, dest: Path) -> None:
        """Copy the saved filters (as `save` left them) into another replica's directory."""
        saved = self._files / KEY_FILTER_FILE
        if saved.exists():
            shutil.copyfile(saved, dest / KEY_FILTER_FILE)

    def forget(self, pid: str) -> None:
        """A keyspace dropped: its filter goes (a reload builds a new one)."""
        self._kept.pop(pid, None)
        if self._saved is not None:
            self._saved.pop(pid, None)

    def clear(self) -> None:
        self._kept.clear()
        self._saved = {}

    def _saved_filter(self, pid: str) -> KeyFilter | None:
        if self._read_only and not self._meta.clean:
            return None  # a process has it open: its keys may have changed since the last close
        if self._saved is None:
            try:
                self._saved = read_saved((self._files / KEY_FILTER_FILE).read_bytes())
            except FileNotFoundError:
                self._saved = {}
        token, raw = self._meta.token, self._saved.get(pid)
        return None if token is None or raw is None else KeyFilter.from_bytes(raw, token)
