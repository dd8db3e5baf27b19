import random

import numpy as np
import pyarrow as pa
import pytest

from sink.index import resident as resident_module
from sink.index.key_filter import hashes
from sink.index.resident import Resident


def keys_of(n: int, prefix: str = "user-") -> list[bytes]:
    return [f"{prefix}{i}".encode() for i in range(n)]


@pytest.mark.parametrize("seed", range(5))
def test_answers_equal_a_dict_through_writes_and_folds(monkeypatch, seed):
    monkeypatch.setattr(resident_module, "MIN_FOLD", 8)  # folds happen within the test
    rng = random.Random(seed)
    universe = keys_of(400)
    oracle = {k: f"v{rng.random()}".encode() for k in rng.sample(universe, 150)}
    resident = Resident.of(list(oracle), list(oracle.values()))
    folds = 0
    for _ in range(60):
        written = {k: f"w{rng.random()}".encode() for k in rng.sample(universe, rng.randint(0, 30))}
        resident.put_many(list(written), list(written.values()))
        folds += bool(written) and not resident.overlay
        oracle.update(written)
        asked = rng.sample(universe, 100)
        assert resident.get_many(asked, hashes(asked)) == [oracle.get(k) for k in asked]
    assert folds  # the overlay was folded into the columns along the way


def test_keys_sharing_a_hash_are_told_apart_by_their_bytes():
    keys = keys_of(50)
    raws = [f"v{i}".encode() for i in range(50)]
    same = np.array([7] * 25 + [9] * 25, np.uint64)  # as if the hash collided for all of them
    resident = Resident(same, pa.array(keys, pa.binary()), pa.array(raws, pa.binary()))
    asked = keys + [b"absent-7", b"absent-9"]
    asked_hashes = np.concatenate([same, np.array([7, 9], np.uint64)])
    assert resident.get_many(asked, asked_hashes) == raws + [None, None]


def test_an_empty_keyspace_answers_absent_and_takes_writes():
    resident = Resident.of([], [])
    assert resident.get_many([b"a"], hashes([b"a"])) == [None]
    resident.put_many([b"a"], [b"1"])
    assert resident.get_many([b"a", b"b"], hashes([b"a", b"b"])) == [b"1", None]
    assert len(resident) == 1


def test_nbytes_counts_columns_and_overlay():
    keys = keys_of(10_000)
    resident = Resident.of(keys, [b"x" * 17] * len(keys))
    columns = resident.nbytes
    assert 8 + 17 + sum(map(len, keys)) / len(keys) <= columns / len(keys) <= 8 + 17 + 8 + 12  # + offsets
    resident.put_many([b"new"], [b"y" * 17])
    assert resident.nbytes > columns
