"""Reading a commit's touched partitions, under the names the log gives them."""

import json

from sink.lakehouse.log import parse_commit

# A commit on a column-mapped table: partition values keyed by the physical name of `dt`.
MAPPED = "\n".join(json.dumps(a) for a in [
    {"commitInfo": {"operation": "DELETE"}},
    {"remove": {"path": "a.parquet", "partitionValues": {"col-7f3e": "2025-01-01"}, "dataChange": True}},
    {"add": {"path": "b.parquet", "partitionValues": {"col-7f3e": None}, "dataChange": True}},
])


def test_partition_values_under_physical_names_are_read_by_them():
    commit = parse_commit(3, MAPPED, ["dt"], ["col-7f3e"])
    assert commit.partitions == parse_commit(3, MAPPED.replace("col-7f3e", "dt"), ["dt"]).partitions
    assert len(commit.partitions) == 2 and "dt=2025-01-01" in commit.partitions


def test_partition_values_under_names_not_given_leave_the_partitions_unknown():
    # Read as the table's names, a physical name matches none: never a wrong partition.
    assert parse_commit(3, MAPPED, ["dt"]).partitions is None
