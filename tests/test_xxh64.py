"""sink.xxh64 against the xxhash library's digest, value by value."""

import random

import numpy as np
import pyarrow as pa
import pytest
import xxhash

from sink.xxh64 import xxh64

# Every path of XXH64: empty, bytes only, a 4-byte word, 8-byte lanes, 32-byte stripes and
# what follows them.
LENGTHS = [*range(0, 41), 63, 64, 65, 95, 96, 97, 255, 1000]


def _values(seed: int = 7) -> list[bytes]:
    rng = random.Random(seed)
    return [rng.randbytes(length) for length in LENGTHS for _ in range(5)]


def _expected(values, seed: int) -> np.ndarray:
    return np.array([xxhash.xxh64_intdigest(v, seed) for v in values], np.uint64)


@pytest.mark.parametrize("seed", [0, 42, 2**64 - 1, 0x9E3779B185EBCA87])
def test_every_length_as_the_library_digests_it(seed):
    values = _values()
    random.Random(1).shuffle(values)  # lengths interleaved, as keys come
    np.testing.assert_array_equal(xxh64(pa.array(values, pa.binary()), seed), _expected(values, seed))


def test_strings_hash_as_their_utf8_bytes():
    texts = ["", "a", "12345", "ключ", "键-42", "x" * 33]
    np.testing.assert_array_equal(xxh64(pa.array(texts), 42), _expected([t.encode() for t in texts], 42))


def test_slices_and_chunks_hash_their_own_values():
    values = _values(3)
    array = pa.array(values, pa.binary())
    np.testing.assert_array_equal(xxh64(array.slice(17, 40)), _expected(values[17:57], 0))
    chunked = pa.chunked_array([array.slice(0, 10), array.slice(10)])
    np.testing.assert_array_equal(xxh64(chunked), _expected(values, 0))
    assert len(xxh64(pa.chunked_array([], pa.binary()))) == 0


def test_large_types_and_nulls():
    np.testing.assert_array_equal(xxh64(pa.array([b"abc", b"defgh"], pa.large_binary())),
                                  _expected([b"abc", b"defgh"], 0))
    # A null gives the seed, as Spark's xxhash64(NULL) does (sink.keys.shards_of routes as Spark).
    np.testing.assert_array_equal(xxh64(pa.array([b"abcd", None, b""]), 42),
                                  [*_expected([b"abcd"], 42), 42, *_expected([b""], 42)])
    assert xxh64(pa.nulls(3, pa.string()), 7).tolist() == [7, 7, 7]


def test_groups_larger_than_one_pass(monkeypatch):
    monkeypatch.setattr("sink.xxh64.GROUP_VALUES", 3)
    values = [str(i).encode() for i in range(50)]
    np.testing.assert_array_equal(xxh64(pa.array(values)), _expected(values, 0))
