"""Append commit: a batch of new keys only (or nothing for the table: the app transaction
alone), one delta-rs write."""

from __future__ import annotations

from deltalake import DeltaTable, write_deltalake

from sink.delta_log.checkpoints import NO_HOOKS
from sink.lakehouse.commit.writes import Writes


def commit(table: DeltaTable, writes: Writes) -> None:
    write_deltalake(table, writes.table_rows(), mode="append", commit_properties=writes.props,
                    post_commithook_properties=NO_HOOKS)
