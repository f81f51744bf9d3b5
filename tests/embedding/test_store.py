import numpy as np
import pytest

from terarec.config import SparseOptimizerConfig, StoreConfig
from terarec.embedding.optimizers import SparseOptimizer
from terarec.embedding.store import MemoryStore, init_rows
from terarec.embedding.types import RowBlock


def store(**cfg) -> MemoryStore:
    return MemoryStore(4, SparseOptimizer(SparseOptimizerConfig()), StoreConfig(**cfg), seed=3)


def ones(n):
    return np.ones(n, np.float32)


def test_pull_creates_rows_deterministically_by_key():
    s = store()
    keys = np.array([5, -7, 2**62], np.int64)
    block, admitted = s.pull(keys, ones(3), np.zeros(3, np.float32), pass_id=0)
    assert admitted.all() and len(s) == 3
    np.testing.assert_array_equal(block.values, init_rows(keys, 4, 0.01, 3))
    # the same key gets the same row whatever else is pulled with it, in any store
    other = store()
    block2, _ = other.pull(np.array([99, 5], np.int64), ones(2), ones(2), pass_id=0)
    np.testing.assert_array_equal(block2.values[1], block.values[0])
    assert 0.005 < init_rows(np.arange(10000), 4, 0.01, 0).std() < 0.015


def test_push_then_pull_returns_written_rows_and_counts():
    s = store()
    keys = np.array([1, 2, 3], np.int64)
    s.pull(keys, np.array([2, 1, 1], np.float32), np.array([1, 0, 0], np.float32), 0)
    vals = np.arange(12, dtype=np.float32).reshape(3, 4)
    s.push(keys, RowBlock(vals, np.full((3, 1), 0.5, np.float32)))
    block, _ = s.pull(keys[::-1], ones(3), ones(3), 1)
    np.testing.assert_array_equal(block.values, vals[::-1])
    np.testing.assert_array_equal(block.state[:, 0], 0.5)
    arrays = s.to_arrays()
    assert arrays["keys"].tolist() == [1, 2, 3]
    assert arrays["show"].tolist() == [3, 2, 2] and arrays["click"].tolist() == [2, 1, 1]
    assert arrays["last_seen"].tolist() == [1, 1, 1]


def test_admission_by_count_across_passes():
    s = store(admit_min_count=3)
    k = np.array([10, 20], np.int64)
    _, admitted = s.pull(k, np.array([2, 1], np.float32), np.array([1, 0], np.float32), 0)
    assert not admitted.any() and len(s) == 0
    block, admitted = s.pull(k, np.array([1, 1], np.float32), np.zeros(2, np.float32), 1)
    assert admitted.tolist() == [True, False] and len(block) == 1
    arrays = s.to_arrays()
    assert arrays["keys"].tolist() == [10]
    assert arrays["show"].tolist() == [3] and arrays["click"].tolist() == [1]
    _, admitted = s.pull(k, ones(2), np.zeros(2, np.float32), 2)
    assert admitted.all() and s.stats().admitted == 2


def test_ttl_eviction_drops_unseen_keys_and_frees_slots():
    s = store(evict_after_passes=2)
    s.pull(np.array([1, 2, 3], np.int64), ones(3), ones(3), 0)
    s.pull(np.array([1], np.int64), ones(1), ones(1), 1)
    assert s.end_pass(1) == 0
    assert s.end_pass(2) == 2  # keys 2, 3 last seen in pass 0
    assert s.to_arrays()["keys"].tolist() == [1]
    s.pull(np.array([7, 8], np.int64), ones(2), ones(2), 3)
    assert s.index.slot_bound == 3  # freed slots reused
    values, found = s.lookup(np.array([2, 7], np.int64))
    assert found.tolist() == [False, True] and not values[0].any()


def test_arrays_roundtrip_into_a_fresh_store():
    s = store()
    keys = np.random.default_rng(0).integers(-(2**60), 2**60, 500, dtype=np.int64)
    s.pull(np.unique(keys), ones(len(np.unique(keys))), ones(len(np.unique(keys))), 4)
    restored = store()
    restored.load_arrays(s.to_arrays())
    for name, arr in s.to_arrays().items():
        np.testing.assert_array_equal(restored.to_arrays()[name], arr)


def test_push_of_unknown_keys_is_an_error():
    with pytest.raises(KeyError, match="not in the store"):
        store().push(np.array([1], np.int64), RowBlock(np.zeros((1, 4), np.float32),
                                                       np.zeros((1, 1), np.float32)))
