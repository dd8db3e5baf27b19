"""SinkConfig: the sink's options (sink.config.options), checked by section
(sink.config.sections) when made, from Python or from the `[sink]` table of a TOML file."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sink.config.options import SinkOptions
from sink.config.sections import (
    CommitSection,
    HistorySection,
    IndexSection,
    RuntimeSection,
    SideTablesSection,
    StreamSection,
    TableSection,
)
from sink.errors import ConfigError


@dataclass
class SinkConfig(SinkOptions):
    """What the sink writes where: the options (`SinkOptions`, whose fields are the keys of the
    TOML `[sink]` table), checked by section when made, read from a file or a dict."""

    def __post_init__(self) -> None:
        self.validate()

    @classmethod
    def from_file(cls, path: str | os.PathLike[str], table: str | None = None) -> SinkConfig:
        """Read the `[sink]` table of a TOML file; relative paths resolve against the file. A
        file with several `[[sink]]` tables (the ready job's) names one by `table`: its
        position (from 0) or its `table_uri` as written."""
        doc = read_toml(path)
        tables = sink_tables(doc, path)
        if table is None:
            if len(tables) > 1:
                raise ConfigError(f"{path} has {len(tables)} [[sink]] tables ({[t.get('table_uri') for t in tables]}): "
                                  "name one (--sink <position or table_uri>)")
            chosen = tables[0]
        else:
            chosen = next((t for i, t in enumerate(tables) if table in (str(i), t.get("table_uri"))), None)
            if chosen is None:
                raise ConfigError(f"{path} has no [[sink]] table {table!r}; its tables: "
                                  f"{[t.get('table_uri') for t in tables]} (or their positions from 0)")
        return cls.from_dict(without_source(chosen), base_dir=Path(path).resolve().parent)

    @classmethod
    def from_dict(cls, values: dict[str, Any], base_dir: Path | None = None) -> SinkConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(
                f"unknown sink key(s) {unknown}; accepted keys: {sorted(known)}"
            )
        missing = [k for k in ("table_uri", "key", "ordering") if k not in values]
        if missing:
            raise ConfigError(f"sink key(s) {missing} are required")
        values = dict(values)
        if base_dir is not None:
            for name in _PATH_KEYS:
                if values.get(name):
                    values[name] = _resolve(values[name], base_dir)
        if isinstance(values.get("key"), str):
            values["key"] = [values["key"]]
        for name in ("partition_by", "except_columns", "track_history_columns", "track_history_except_columns"):
            if isinstance(values.get(name), str):
                values[name] = [values[name]]
        return cls(**values)

    def validate(self) -> None:
        """Each section checks its own keys (sink.config.sections); a ConfigError names the key
        and the accepted values."""
        for section in (TableSection, StreamSection, IndexSection, SideTablesSection, RuntimeSection, HistorySection,
                        CommitSection):
            section.of(self)

    # --- the options by section ------------------------------------------------------------------

    @property
    def table(self) -> TableSection:
        return TableSection.of(self)

    @property
    def stream(self) -> StreamSection:
        return StreamSection.of(self)

    @property
    def index(self) -> IndexSection:
        return IndexSection.of(self)

    @property
    def commit(self) -> CommitSection:
        return CommitSection.of(self)

    @property
    def side_tables(self) -> SideTablesSection:
        return SideTablesSection.of(self)

    @property
    def runtime(self) -> RuntimeSection:
        return RuntimeSection.of(self)

    @property
    def history(self) -> HistorySection:
        return HistorySection.of(self)

    def as_stored(self) -> SinkConfig:
        """The config the sink runs on: `hidden_ordering`'s columns in place of the ordering
        columns they keep (each batch gets them as copies: sink.routing.with_hidden_ordering)."""
        hidden = self.hidden_ordering
        if not hidden:
            return self
        ordering = [hidden.get(c, c) for c in self.ordering_columns]
        return dataclasses.replace(self, ordering=ordering if isinstance(self.ordering, list) else ordering[0])

    @property
    def writes_records_as_rows(self) -> bool:
        """Every row a batch writes is one of its records as it arrived, not a partial update
        merged with the stored row nor a history table's rebuilt version: checking the records
        against the table's CHECK constraints, invariants and generated columns checks the rows."""
        return self.scd_type == 1 and not self.keeps_stored_values

    @property
    def keeps_stored_values(self) -> bool:
        """Some updates keep stored values: null columns (ignore_null_updates) or those holding
        unchanged_value (sink.tagging.partial)."""
        return self.ignore_null_updates or self.unchanged_value is not None

    @property
    def tombstone_ttl_seconds(self) -> int | None:
        """`tombstone_ttl_hours` in whole seconds, the unit deletes are stamped in."""
        return self.side_tables.tombstone_ttl_seconds

    @property
    def resolved_writer_id(self) -> str:
        """The Delta app id of this writer: explicit, or derived from table + checkpoint."""
        if self.writer_id:
            return self.writer_id
        seed = f"{_normalize(self.table_uri)}|{_normalize(self.checkpoint_dir or '')}"
        return "upsert-sink-" + hashlib.sha256(seed.encode()).hexdigest()[:16]

    @property
    def resolved_quarantine_uri(self) -> str:
        return self.side_tables.quarantine_uri

    @property
    def resolved_tombstone_uri(self) -> str:
        return self.side_tables.tombstone_uri

    def tags_on_driver(self, master: str) -> bool:
        return self.runtime.tags_on_driver(master)

    @property
    def resolved_changelog_uri(self) -> str:
        return self.side_tables.changelog_uri

    @property
    def incoming_wins_ties(self) -> bool:
        return self.stream.incoming_wins_ties


_PATH_KEYS = ("table_uri", "checkpoint_dir", "index_dir", "quarantine_table_uri", "tombstone_table_uri",
              "changelog_uri", "replica_snapshot_uri")


# A sink table's own `[sink.source]`: the ready job's source keys for that table's query
# (jobs/job_config.py); not the sink's.
SINK_SOURCE = "source"


def without_source(table: dict[str, Any]) -> dict[str, Any]:
    """A sink table's keys but its `[sink.source]`."""
    return {k: v for k, v in table.items() if k != SINK_SOURCE}


def sink_tables(doc: dict[str, Any], path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """A config file's sink tables: one `[sink]`, or several `[[sink]]`."""
    tables = doc.get("sink")
    if isinstance(tables, dict):
        return [tables]
    if not tables or not all(isinstance(t, dict) for t in tables):
        raise ConfigError(f"{path}: no [sink] table (or [[sink]] tables)")
    return tables


def read_toml(path: str | os.PathLike[str]) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError as e:
        raise ConfigError(f"config file not found: {path}") from e
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from e


def _resolve(value: str, base_dir: Path) -> str:
    if "://" in value or os.path.isabs(value):
        return value
    return str((base_dir / value).resolve())


def _normalize(uri: str) -> str:
    return uri if "://" in uri else os.path.abspath(uri).rstrip("/")
