import numpy as np
import pytest

from sink.index.key_filter import BITS_PER_KEY, MIN_WORDS, KeyFilter, hashes, read_saved, saved_bytes

TOKEN = b"\x01" * 8


def keys(prefix: str, n: int) -> list[bytes]:
    return [f"{prefix}-{i}".encode() for i in range(n)]


def test_every_added_key_is_reported_present():
    held = keys("held", 50_000)
    f = KeyFilter.build(hashes(held[:30_000]))
    f.add(hashes(held[30_000:]))
    assert f.may_contain(hashes(held)).all()


def test_new_keys_are_mostly_answered_absent_within_two_bytes_per_key():
    f = KeyFilter.build(hashes(keys("held", 100_000)))
    assert f.nbytes <= 2 * 100_000
    false_positives = f.may_contain(hashes(keys("new", 100_000))).mean()
    assert false_positives < 0.01  # 5 bits in one 64-bit word at 16 bits per key: about 0.5%


def test_it_asks_for_a_rebuild_once_its_keys_have_doubled():
    n = MIN_WORDS * 64 // BITS_PER_KEY * 4
    f = KeyFilter.build(hashes(keys("held", n)))
    f.add(hashes(keys("held", n)))  # keys it holds do not count again
    assert (f.keys, f.full) == (n, False)
    f.add(hashes(keys("more", n + 10)))
    assert f.full
    assert f.nbytes / f.keys < 1  # why it is rebuilt: it fell under a byte per key


def test_it_round_trips_under_its_token_only():
    f = KeyFilter.build(hashes(keys("held", 1000)))
    raw = f.to_bytes(TOKEN)
    back = KeyFilter.from_bytes(raw, TOKEN)
    assert (back.keys, back.built_for) == (f.keys, f.built_for)
    assert np.array_equal(back.words, f.words)
    assert KeyFilter.from_bytes(raw, b"\x02" * 8) is None  # the keyspace changed since it was saved


@pytest.mark.parametrize("damage", [
    lambda raw: raw[:-8],  # truncated by whole words: must not read as a smaller filter
    lambda raw: raw[:20],
    lambda raw: raw[:-1] + bytes([raw[-1] ^ 1]),  # one flipped bit
    lambda raw: b"",
])
def test_a_damaged_file_is_not_a_filter(damage):
    raw = KeyFilter.build(hashes(keys("held", 1000))).to_bytes(TOKEN)
    assert KeyFilter.from_bytes(damage(raw), TOKEN) is None


def test_a_replicas_filters_round_trip_in_one_file_and_a_cut_one_keeps_the_whole_ones():
    saved = {"*global": b"", "dt=2025-01-01": KeyFilter.build(hashes(keys("a", 100))).to_bytes(TOKEN),
             "dt=a b:é": KeyFilter.build(hashes(keys("b", 3000))).to_bytes(TOKEN)}
    raw = saved_bytes(saved)
    assert read_saved(raw) == saved
    assert read_saved(raw[:-1]) == {"*global": b"", "dt=2025-01-01": saved["dt=2025-01-01"]}
    assert read_saved(saved["dt=2025-01-01"]) == {}  # a file of another format (one bare filter)
    assert read_saved(b"") == {}
