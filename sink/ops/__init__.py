"""What an operator of the sink works with: the CLI (`python -m sink`), the Prometheus
metrics, the batch report each batch logs and publishes, and the tombstone table's upkeep."""
