"""The prepare phase: the batch's records routed to shards and checked (bad ones marked for
quarantine, sink.routing), the tagging output's shape, and the input files in arrival order."""

from __future__ import annotations

from sink.batch.state import BatchState
from sink.config import SinkConfig
from sink.routing import prepare, tagged_schema
from sink.session import SessionKind


class PreparePhase:
    def __init__(self, config: SinkConfig, session: SessionKind, on_driver: bool):
        self._config = config
        self._session = session
        self._on_driver = on_driver

    def run(self, state: BatchState) -> None:
        cfg, df = self._config, state.batch_df
        with state.report.timed("prepare"):
            state.num_shards = num_shards(cfg, self._session)
            # The driver encodes the keys itself, after the collect.
            state.prepared = prepare(df, cfg, state.num_shards, file_column=self._session.file_column,
                                     with_key=not self._on_driver, constraints=state.constraints)
            state.out_schema = tagged_schema(df.schema, len(cfg.ordering_columns))
            state.files = self._session.batch_file_order(df)


def num_shards(cfg: SinkConfig, session: SessionKind) -> int:
    return cfg.num_shards or session.default_parallelism()
