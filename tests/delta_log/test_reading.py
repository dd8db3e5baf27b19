"""Reading a commit's touched partitions, under the names the log gives them."""

import json

from sink.delta_log.reading import parse_commit, read_app_versions, read_commit

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


def _logged(tmp_path, version: int, actions: list[dict], separators=(",", ":")) -> str:
    log = tmp_path / "_delta_log"
    log.mkdir(exist_ok=True)
    (log / f"{version:020d}.json").write_text("\n".join(json.dumps(a, separators=separators) for a in actions) + "\n")
    return str(tmp_path)


def test_app_versions_are_read_as_the_whole_commit_reads_them(tmp_path):
    actions = [{"commitInfo": {"operation": "MERGE", "txn": "not an action"}},
               {"add": {"path": "txn=1/a.parquet", "partitionValues": {"dt": "x"}, "dataChange": True,
                        "stats": json.dumps({"txn": {"appId": "not", "version": 9}})}},
               {"txn": {"appId": "sink", "version": 7, "lastUpdated": 1}},
               {"remove": {"path": "b.parquet", "partitionValues": {"dt": "x"}, "dataChange": True}},
               {"txn": {"appId": "other", "version": 2}}]
    uri = _logged(tmp_path, 4, actions)
    assert read_app_versions(uri, 4) == read_commit(uri, 4, ["dt"]).app_versions == {"sink": 7, "other": 2}
    # A writer that spaces its JSON is read the same.
    spaced = _logged(tmp_path, 5, actions, separators=(", ", ": "))
    assert read_app_versions(spaced, 5) == {"sink": 7, "other": 2}


def test_app_versions_of_a_gone_log_entry_are_unknown(tmp_path):
    assert read_app_versions(str(tmp_path), 3) is None
