"""Where the files a Delta log names are: relative, percent-encoded paths under the table's
root, and absolute URIs (a shallow clone's) outside it."""

import pytest

from sink.delta_log.deletion_vectors import Descriptor
from sink.delta_log.paths import file_location, is_absolute


@pytest.mark.parametrize("path, location", [
    ("part-0.parquet", "/t/part-0.parquet"),
    # Spark escapes ':' and '%' in the directory (dt=a%3Ab%25), the log encodes that again.
    ("dt=a%253Ab%2525/part-0.parquet", "/t/dt=a%3Ab%25/part-0.parquet"),
    ("dt=a%20b/part-0.parquet", "/t/dt=a b/part-0.parquet"),
    ("dt=a:b/part-0.parquet", "/t/dt=a:b/part-0.parquet"),  # a colon, not a scheme
    ("file:/src%20dir/dt=a%253Ab/part-0.parquet", "/src dir/dt=a%3Ab/part-0.parquet"),
    ("file:///src/part-0.parquet", "/src/part-0.parquet"),
    ("s3a://bucket/src%20dir/part-0.parquet", "bucket/src dir/part-0.parquet"),
    ("abfss://container@account.dfs.core.windows.net/src/part-0.parquet", "container/src/part-0.parquet"),
])
def test_a_log_path_is_found_on_the_tables_filesystem(path, location):
    assert file_location("/t", path) == location
    assert is_absolute(path) == (not location.startswith("/t/"))


def test_a_deletion_vector_stored_by_path_is_found_where_its_uri_says():
    descriptor = Descriptor("p", "file:/src%20dir/deletion_vector_1.bin", 1, 34, 1)
    assert descriptor.file_location("/t") == "/src dir/deletion_vector_1.bin"
