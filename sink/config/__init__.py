"""The sink's configuration: its options as the user writes them (`options.SinkOptions`, the
documented keys of the TOML `[sink]` table), the sections that check them by what they are
about (`sections`), `SinkConfig` that checks them when made and reads them from a file
(`sink_config`), and the configuration reference generated from the options' docstrings
(`docs`: `python -m sink.config.docs`).

It may import only the sink's leaf modules (errors, ordering, columns). The sections read the
options, not `SinkConfig`: nothing here imports in a circle."""

from sink.config.sink_config import SinkConfig

__all__ = ["SinkConfig"]
