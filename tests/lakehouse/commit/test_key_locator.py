import random

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from sink.lakehouse.commit.key_locator import KeyLocator, MergedKeys


@pytest.mark.parametrize("kind", [pa.string(), pa.binary(), pa.int64(), pa.int32()])
@pytest.mark.parametrize("seed", range(60))
@pytest.mark.parametrize("file_repeats", [True, False])
def test_finds_what_index_in_finds(kind, seed, file_repeats):
    """Repeated (or each key once) and null keys in the file, repeated and null keys looked up
    (a null matches none), keys it lacks, empty sides; integer keys are searched by numpy."""
    rng = random.Random(seed)
    pool = [rng.randrange(40) for _ in range(rng.randrange(1, 30))]
    value = ((lambda v: v) if pa.types.is_integer(kind)
             else (lambda v: f"k{v}".encode() if kind == pa.binary() else f"k{v}"))
    stored = ([rng.choice(pool) for _ in range(rng.randrange(40))] if file_repeats
              else rng.sample(range(40), rng.randrange(40)))
    keys = pa.array([None if rng.random() < 0.1 else value(v) for v in stored], kind)
    null_share = 0.2 if seed % 3 == 0 else 0
    incoming = pa.array([None if rng.random() < null_share else value(rng.randrange(40))
                         for _ in range(rng.randrange(20))], kind)
    locator = KeyLocator.of(keys)
    assert locator.unique == (len(set(keys.to_pylist())) == len(keys))
    rows, positions = locator.find(incoming)
    at = pc.index_in(keys, value_set=incoming, skip_nulls=True).to_pylist()
    assert rows.tolist() == [i for i, p in enumerate(at) if p is not None]
    assert positions.tolist() == [p for p in at if p is not None]


def test_counts_its_buffers():
    locator = KeyLocator.of(pa.array(["b", "a", "c"]))
    assert locator.num_rows == 3
    assert locator.get_total_buffer_size() == locator.sorted_keys.get_total_buffer_size() + 3 * 8


@pytest.mark.parametrize("kind", [pa.string(), pa.int64()])
@pytest.mark.parametrize("seed", range(40))
def test_merged_keys_find_in_each_file_what_index_in_finds(kind, seed):
    """Files sharing keys (a key's old row in one file, its new one in another), nulls, empty
    files; merged at once or some added later (`adding`), and some left out (`keeping`)."""
    rng = random.Random(seed)
    value = (lambda v: v) if kind == pa.int64() else (lambda v: f"k{v}")
    files = [pa.array([None if rng.random() < 0.05 else value(v) for v in rng.sample(range(60), rng.randrange(30))],
                      kind) for _ in range(rng.randrange(1, 6))]
    incoming = pa.array([value(rng.randrange(70)) for _ in range(rng.randrange(25))], kind)
    runs = [(f"f{i}", keys, np.arange(len(keys))) for i, keys in enumerate(files)]
    merged = MergedKeys.of(runs)
    split = rng.randrange(1, len(files) + 1)
    added = MergedKeys.of(runs[:split]).adding(runs[split:])
    kept = [i for i in range(len(files)) if rng.random() < 0.7]
    assert (merged.keeping({f"f{i}" for i in kept}) is None) == (not kept)
    for found, names in ((merged, range(len(files))), (added, range(len(files))),
                         (merged.keeping({f"f{i}" for i in kept}), kept)):
        if found is None:
            continue
        assert found.files == tuple(f"f{i}" for i in names)
        for (rows, positions), i in zip(found.find(incoming), names):
            at = pc.index_in(files[i], value_set=incoming, skip_nulls=True).to_pylist()
            assert rows.tolist() == [r for r, p in enumerate(at) if p is not None]
            assert positions.tolist() == [p for p in at if p is not None]


def test_a_locator_keeps_the_rows_it_is_given():
    locator = KeyLocator.of(pa.array(["b", "c", "a"]), np.array([10, 11, 12]))
    assert locator.sorted_keys.to_pylist() == ["a", "b", "c"] and locator.rows.tolist() == [12, 10, 11]


@pytest.mark.parametrize("kind", [pa.string(), pa.int64()])
@pytest.mark.parametrize("seed", range(30))
def test_two_locators_merged_are_the_locator_of_their_keys_together(kind, seed):
    """Keys shared by both sides, repeated within one, or each once; empty sides."""
    rng = random.Random(seed)
    value = (lambda v: v) if kind == pa.int64() else (lambda v: f"k{v}")
    if seed % 2:
        shared = rng.sample(range(60), rng.randrange(40))
        cut = rng.randrange(len(shared) + 1)
        left, right = shared[:cut], shared[cut:] + ([shared[0]] if shared and seed % 4 == 1 else [])
    else:
        left, right = ([rng.randrange(30) for _ in range(rng.randrange(25))] for _ in range(2))
    keys = [value(v) for v in left + right]
    merged = KeyLocator.of(pa.array(keys[:len(left)], kind)).merged_with(
        KeyLocator.of(pa.array(keys[len(left):], kind), np.arange(len(left), len(keys))))
    whole = KeyLocator.of(pa.array(keys, kind))
    assert merged.sorted_keys.to_pylist() == whole.sorted_keys.to_pylist()
    assert merged.unique == whole.unique == (len(set(keys)) == len(keys))
    assert [keys[r] for r in merged.rows.tolist()] == merged.sorted_keys.to_pylist()
    assert sorted(merged.rows.tolist()) == list(range(len(keys)))
