"""The sink's contract with its table, kept as table properties.

What the index and the MERGE assume about the table — key columns, partition columns,
ordering column, scope, how keys are encoded, and for a history table (scd_type 2) the
tracked columns — is recorded in the table's properties
when the sink first writes to it. A sink whose config says otherwise refuses to start:
restarting with `key = ["order_id"]` on a table keyed by tenant and order would otherwise
overwrite other tenants' rows. A deliberate change goes through `python -m sink contract
--rewrite`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass

from sink.keys import KEY_ENCODING
from sink.ordering import columns_of

PREFIX = "upsert_sink."
_FIELDS = ("key", "partition_by", "ordering", "scope", "key_encoding", "scd_type", "track_history")


@dataclass(frozen=True)
class Contract:
    key: tuple[str, ...]
    partition_by: tuple[str, ...]
    ordering: str | tuple[str, ...]  # one column alone, several as a tuple
    scope: str
    key_encoding: str = KEY_ENCODING
    scd_type: int = 1
    # scd_type 2: ("columns", names) or ("except", names) as configured; None: the default.
    track_history: tuple[str, tuple[str, ...]] | None = None

    @classmethod
    def of(cls, config) -> Contract:
        """The contract a `SinkConfig` asks for."""
        columns = config.ordering_columns
        tracked = (("columns", tuple(config.track_history_columns)) if config.track_history_columns is not None
                   else ("except", tuple(config.track_history_except_columns))
                   if config.track_history_except_columns is not None else None)
        return cls(tuple(config.key), tuple(config.partition_by), columns[0] if len(columns) == 1 else tuple(columns),
                   config.scope, scd_type=config.scd_type, track_history=tracked)

    @property
    def ordering_columns(self) -> list[str]:
        return columns_of(self.ordering)

    def properties(self) -> dict[str, str]:
        return {PREFIX + name: json.dumps(_plain(v)) for name, v in ((n, getattr(self, n)) for n in _FIELDS)}

    @classmethod
    def from_properties(cls, properties: Mapping[str, str | None]) -> Contract | None:
        """The contract recorded in a table's properties; None when there is none (yet)."""
        if not any(k.startswith(PREFIX) for k in properties):
            return None
        values = {n: json.loads(properties.get(PREFIX + n) or "null") for n in _FIELDS}
        ordering = values["ordering"] or ""
        tracked = values["track_history"]
        # Tables recorded before scd_type existed are type 1.
        return cls(tuple(values["key"] or ()), tuple(values["partition_by"] or ()),
                   tuple(ordering) if isinstance(ordering, list) else ordering, values["scope"] or "",
                   values["key_encoding"] or "", values["scd_type"] or 1,
                   None if tracked is None else (tracked[0], tuple(tracked[1])))

    def differences(self, other: Contract) -> list[str]:
        """`name: this value, other value` for every field that differs."""
        return [f"{n}: {getattr(self, n)!r} vs {getattr(other, n)!r}" for n in _FIELDS
                if getattr(self, n) != getattr(other, n)]


def _plain(value):
    """A field's value as JSON writes it (tuples as lists, nested too)."""
    return [_plain(v) for v in value] if isinstance(value, tuple) else value
