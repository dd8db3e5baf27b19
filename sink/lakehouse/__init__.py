"""The Delta table: snapshot, app transactions, commit log, merge and append."""
