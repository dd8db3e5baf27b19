import pyarrow as pa
import pytest

from sink.lakehouse.commit.file_cache import FileCache


def rows(n: int) -> pa.Table:
    return pa.table({"k": pa.array(range(n), pa.int64())})  # 8 bytes a row


def test_least_recently_used_files_go_first_past_the_budget():
    cache = FileCache(max_bytes=8 * 30)
    cache.put("a", rows(10))
    cache.put("b", rows(10))
    assert cache.get("a").num_rows == 10  # a is now the most recently used
    cache.put("c", rows(10))
    assert (len(cache), cache.nbytes) == (3, 240)
    cache.put("d", rows(10))
    assert cache.get("b") is None
    assert [cache.get(x).num_rows for x in "acd"] == [10, 10, 10]
    assert cache.nbytes == 240


def test_a_table_larger_than_the_budget_is_not_held_and_replaces_nothing_it_would_not():
    cache = FileCache(max_bytes=8 * 10)
    cache.put("a", rows(10))
    cache.put("b", rows(11))
    assert (cache.get("a").num_rows, cache.get("b"), cache.nbytes) == (10, None, 80)
    cache.put("a", rows(11))  # a location written again: the old rows go either way
    assert (cache.get("a"), cache.nbytes, len(cache)) == (None, 0, 0)


def test_a_slice_counts_the_buffers_it_keeps_alive():
    cache = FileCache(max_bytes=1 << 20)
    cache.put("a", rows(1000).slice(0, 10))
    assert cache.nbytes == 8000


@pytest.mark.parametrize("max_bytes", [0, 80])
def test_resize_and_discard_free_what_they_drop(max_bytes):
    cache = FileCache(max_bytes=800)
    for name in "abc":
        cache.put(name, rows(10))
    cache.discard("b")
    cache.discard("missing")
    assert (len(cache), cache.nbytes) == (2, 160)
    assert cache.get("b") is None
    cache.resize(max_bytes)
    assert (len(cache), cache.nbytes) == (max_bytes // 80, max_bytes)
    assert (cache.get("c") is not None) == (max_bytes > 0)  # the most recently written stays


def test_clear_empties_and_keeps_the_budget():
    cache = FileCache(max_bytes=800)
    cache.put("a", rows(10))
    cache.clear()
    assert (len(cache), cache.nbytes, cache.get("a"), cache.max_bytes) == (0, 0, None, 800)
    cache.put("a", rows(10))
    assert cache.nbytes == 80
