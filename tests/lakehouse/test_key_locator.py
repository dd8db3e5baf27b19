import random

import pyarrow as pa
import pyarrow.compute as pc
import pytest

from sink.lakehouse.key_locator import KeyLocator


@pytest.mark.parametrize("kind", [pa.string(), pa.binary(), pa.int64()])
@pytest.mark.parametrize("seed", range(60))
@pytest.mark.parametrize("file_repeats", [True, False])
def test_finds_what_index_in_finds(kind, seed, file_repeats):
    """Repeated (or each key once) and null keys in the file, repeated keys looked up, keys it
    lacks, empty sides."""
    rng = random.Random(seed)
    pool = [rng.randrange(40) for _ in range(rng.randrange(1, 30))]
    value = (lambda v: v) if kind == pa.int64() else (lambda v: f"k{v}".encode() if kind == pa.binary() else f"k{v}")
    stored = ([rng.choice(pool) for _ in range(rng.randrange(40))] if file_repeats
              else rng.sample(range(40), rng.randrange(40)))
    keys = pa.array([None if rng.random() < 0.1 else value(v) for v in stored], kind)
    incoming = pa.array([value(rng.randrange(40)) for _ in range(rng.randrange(20))], kind)
    locator = KeyLocator.of(keys)
    assert locator.unique == (len(set(keys.to_pylist())) == len(keys))
    rows, positions = locator.find(incoming)
    at = pc.index_in(keys, value_set=incoming).to_pylist()
    assert rows.tolist() == [i for i, p in enumerate(at) if p is not None]
    assert positions.tolist() == [p for p in at if p is not None]


def test_counts_its_buffers():
    locator = KeyLocator.of(pa.array(["b", "a", "c"]))
    assert locator.num_rows == 3
    assert locator.get_total_buffer_size() == locator.sorted_keys.get_total_buffer_size() + 3 * 8
