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
    runs = [(f"f{i}", KeyLocator.of(keys)) for i, keys in enumerate(files)]
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
@pytest.mark.parametrize("seed", range(20))
def test_merged_keys_added_file_by_file_keep_few_tiers_and_find_what_index_in_finds(kind, seed):
    """A partition's files joining its merged keys a few at a time, as merge-on-read adds them
    batch after batch, some leaving: a large tier is not sorted again for a small addition, the
    tiers stay few (log2 of the keys added), and each file's keys are still found."""
    rng = random.Random(seed)
    value = (lambda v: v) if kind == pa.int64() else (lambda v: f"k{v}")
    files = {f"f{i}": pa.array([value(rng.randrange(500)) for _ in range(rng.randrange(1, 40))], kind)
             for i in range(40)}
    names = list(files)
    files[names[0]] = pa.array([value(v) for v in range(2000)], kind)  # the table's first files, large
    merged = MergedKeys.of([(names[0], KeyLocator.of(files[names[0]]))])
    largest = merged.tiers[0]
    at = 1
    while at < len(names):
        step = rng.randrange(1, 4)
        merged = merged.adding([(f, KeyLocator.of(files[f])) for f in names[at:at + step]])
        at += step
        assert merged.tiers[0] is largest  # the other tiers together stay under half its rows
        assert len(merged.tiers) <= 1 + np.log2(sum(len(files[f]) for f in names[1:at])) + 1
        assert [t.num_rows for t in merged.tiers] == sorted((t.num_rows for t in merged.tiers), reverse=True)
    kept = set(rng.sample(names, 30))
    incoming = pa.array([value(rng.randrange(2100)) for _ in range(60)], kind)
    for found, held in ((merged, names), (merged.keeping(kept), [f for f in names if f in kept])):
        assert found.files == tuple(held)
        for (rows, positions), f in zip(found.find(incoming), held):
            index = pc.index_in(files[f], value_set=incoming, skip_nulls=True).to_pylist()
            assert rows.tolist() == [r for r, p in enumerate(index) if p is not None]
            assert positions.tolist() == [p for p in index if p is not None]


def test_tiers_of_comparable_size_are_sorted_together():
    """A tier at least 1/TIER_RATIO of the one before it joins it: one tier again."""
    first = MergedKeys.of([("a", KeyLocator.of(pa.array(["k3", "k1"])))])
    joined = first.adding([("b", KeyLocator.of(pa.array(["k2"])))])
    assert len(joined.tiers) == 1
    assert joined.tiers[0].sorted_keys.to_pylist() == ["k1", "k2", "k3"] and joined.tiers[0].rows.tolist() == [1, 2, 0]
    apart = MergedKeys.of([("a", KeyLocator.of(pa.array(["k3", "k1", "k4"])))]).adding(
        [("b", KeyLocator.of(pa.array(["k2"])))])
    assert [t.num_rows for t in apart.tiers] == [3, 1]
