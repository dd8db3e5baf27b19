"""A primary key change's create takes its unchanged TOASTed values from its old key: from the
old key's records earlier in the batch, or from the Delta table."""

import pyarrow as pa
import pytest
from deltalake import write_deltalake

from jobs.envelopes import UNAVAILABLE_VALUE as P
from jobs.key_changes import OLD_KEY, resolved

pytestmark = pytest.mark.spark

SCHEMA = f"id INT, big STRING, note STRING, op STRING, lsn BIGINT, {OLD_KEY} STRING"


def test_a_key_changes_create_takes_the_old_keys_values_from_the_batch_or_the_table(spark, tmp_path):
    uri = str(tmp_path / "t")
    write_deltalake(uri, pa.table({"id": pa.array([1, 5], pa.int32()), "big": ["one", "five"],
                                   "note": ["n1", "n5"]}))
    records = spark.createDataFrame([
        # 1 (stored) becomes 2: its big from the table.
        (1, None, None, "d", 10, None), (2, P, "n2", "c", 10, '{"id":1}'),
        # 3 is new in the batch, updated (big not sent), then becomes 4, which becomes 6.
        (3, "three", "n3", "c", 11, None), (3, P, "m3", "u", 12, None), (3, None, None, "d", 13, None),
        (4, P, "m3", "c", 13, '{"id":3}'), (4, None, None, "d", 14, None), (6, P, P, "c", 14, '{"id":4}'),
        # 7 came from a key nobody holds: its placeholder stays (the job's guard quarantines it).
        (7, P, "n7", "c", 15, '{"id":99}'),
        # An update of 5 (stored) keeps its placeholder: the sink keeps the stored value.
        (5, P, "m5", "u", 16, None),
    ], SCHEMA)
    out = resolved(records, key=["id"], ordering="lsn", placeholder=P, table_uri=uri)
    got = {(r["id"], r["lsn"]): (r["big"], r["note"]) for r in out.collect()}
    assert got[(2, 10)] == ("one", "n2")
    assert got[(4, 13)] == ("three", "m3") and got[(6, 14)] == ("three", "m3")
    assert got[(7, 15)] == (P, "n7") and got[(5, 16)] == (P, "m5")
    assert out.count() == records.count() and out.columns == records.columns
