import numpy as np
import pytest

from sink.index.entry import Entry, pack_located_many, pack_many, unpack_located_many, unpack_many


@pytest.mark.parametrize("width", [1, 2])
def test_batch_packing_is_the_entry_format_and_unpacks_to_the_same_values(width):
    rng = np.random.default_rng(width)
    n = 500
    orderings = rng.integers(-(1 << 62), 1 << 62, (n, width))
    deleted = rng.random(n) < 0.3
    deleted_at = rng.integers(1, 1 << 40, n)
    raws = pack_many(orderings, deleted, deleted_at)
    entries = [Entry.of(o, d, at if d else 0) for o, d, at in zip(orderings.tolist(), deleted, deleted_at)]
    assert raws == [e.pack() for e in entries]  # a delete-time only where deleted
    found, back, back_deleted, back_at = unpack_many([*raws, None], width)
    assert found.tolist() == [True] * n + [False]
    assert np.array_equal(back[:n], orderings) and np.array_equal(back_deleted[:n], deleted)
    assert np.array_equal(back_at[:n], np.where(deleted, deleted_at, 0))


def test_located_packing_appends_the_partition_id():
    raws = pack_located_many([5, 6], [False, True], ["dt=2025-01-01", "dt=é"], [0, 99])
    assert raws == [Entry(5).pack() + b"dt=2025-01-01", Entry(6, True, 99).pack() + "dt=é".encode()]
    *_, locations = unpack_located_many([raws[1], None, raws[0]])
    assert locations == ["dt=é", None, "dt=2025-01-01"]


def test_packing_nothing_gives_nothing():
    assert pack_many(np.zeros(0, np.int64), np.zeros(0, bool)) == []
    assert pack_located_many([], [], []) == []
