"""What an operator of the sink works with: the Prometheus metrics, the batch report each
batch logs and publishes, and the tombstone table's upkeep (the CLI that runs them on demand,
`python -m sink`, is sink.cli, on the top floor: it runs phases of every floor)."""
