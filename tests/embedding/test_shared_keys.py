"""Views of one shared key index hold exactly the rows stores of their own would hold,
through admission, TTL eviction, slot reuse, reordered pulls, save and load; the key
side is paid once."""

from __future__ import annotations

import numpy as np
import pytest

from terarec.config import SparseOptimizerConfig, StoreConfig
from terarec.embedding.optimizers import SparseOptimizer
from terarec.embedding.protocol import EmbeddingStore
from terarec.embedding.shared import SharedKeys, SharedRowsStore, sharing_refusal
from terarec.embedding.store import MemoryStore
from terarec.embedding.types import RowBlock

# Two models: different widths and sparse optimizers (adagrad: 1 state column; adam: 2d+1).
MODELS = [(4, SparseOptimizerConfig(name="adagrad", initial_accumulator=0.1)),
          (8, SparseOptimizerConfig(name="adam"))]


def _pair(cfg: StoreConfig):
    shared = SharedKeys(cfg, seed=3)
    views = [SharedRowsStore(shared, d, SparseOptimizer(o), cfg, seed=3) for d, o in MODELS]
    alone = [MemoryStore(d, SparseOptimizer(o), cfg, seed=3) for d, o in MODELS]
    return shared, views, alone


def _passes(rng, n_passes: int):
    """Key sets with repeats across passes and keys that vanish (TTL) and come back."""
    for p in range(n_passes):
        keys = np.unique(rng.integers(0, 400 if p % 3 else 60, 300)).astype(np.int64)
        rng.shuffle(keys)
        show = rng.integers(1, 3, len(keys)).astype(np.float32)
        click = (rng.random(len(keys)) < 0.3).astype(np.float32)
        yield p, keys, show, click


def _same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


@pytest.mark.parametrize("cfg", [StoreConfig(),
                                 StoreConfig(admit_min_count=2, evict_after_passes=2)])
def test_views_equal_stores_of_their_own(cfg):
    shared, views, alone = _pair(cfg)
    assert all(isinstance(v, EmbeddingStore) for v in views)
    rng = np.random.default_rng(0)
    for p, keys, show, click in _passes(rng, 9):
        for i, (view, own) in enumerate(zip(views, alone, strict=True)):
            # the second model pulls the same keys in another order (another batch size)
            order = np.arange(len(keys)) if i == 0 else rng.permutation(len(keys))
            k, s, c = keys[order], show[order], click[order]
            vb, va = view.pull(k, s, c, p)
            ob, oa = own.pull(k, s, c, p)
            np.testing.assert_array_equal(va, oa)
            np.testing.assert_array_equal(vb.values, ob.values)
            np.testing.assert_array_equal(vb.state, ob.state)
            step = rng.normal(size=vb.values.shape).astype(np.float32)
            trained = RowBlock(vb.values + step, vb.state + 1)
            view.push(k[va], trained)
            own.push(k[oa], RowBlock(trained.values.copy(), trained.state.copy()))
            assert view.end_pass(p) == own.end_pass(p)
            assert len(view) == len(own)
    for view, own in zip(views, alone, strict=True):
        _same(view.to_arrays(), own.to_arrays())
        probe = np.arange(-5, 420, dtype=np.int64)
        for got, want in zip(view.lookup(probe), own.lookup(probe), strict=True):
            np.testing.assert_array_equal(got, want)
    if cfg.evict_after_passes:
        assert views[0].stats().evicted > 0 and views[0].stats().candidates > 0


def test_save_load_restores_every_view_and_the_key_side(tmp_path):
    cfg = StoreConfig(admit_min_count=2)
    shared, views, _ = _pair(cfg)
    rng = np.random.default_rng(1)
    for p, keys, show, click in _passes(rng, 4):
        for view in views:
            block, admitted = view.pull(keys, show, click, p)
            view.push(keys[admitted], RowBlock(block.values * 2 + 1, block.state + p))
            view.end_pass(p)
    saved = [view.to_arrays() for view in views]
    for i, view in enumerate(views):
        view.save(tmp_path / f"m{i}")
    fresh = SharedKeys(cfg, seed=3)
    loaded = [SharedRowsStore(fresh, d, SparseOptimizer(o), cfg, seed=3) for d, o in MODELS]
    for i, view in enumerate(loaded):
        view.load(tmp_path / f"m{i}")
    for view, want in zip(loaded, saved, strict=True):
        _same(view.to_arrays(), want)
    # the loaded models keep training on one key side: the next pass admits once
    keys = np.arange(1000, 1010, dtype=np.int64)
    for view in loaded:
        view.pull(keys, np.full(10, 2, np.float32), np.zeros(10, np.float32), 4)
    assert loaded[0].stats().admitted == saved[0]["counters"][0] + 10


def test_the_key_side_is_paid_once():
    cfg = StoreConfig()
    shared, views, alone = _pair(cfg)
    keys = np.arange(50_000, dtype=np.int64)
    ones = np.ones(len(keys), np.float32)
    for store in [*views, *alone]:
        store.pull(keys, ones, ones, 0)
    index_bytes = alone[0].index.nbytes
    for view, own in zip(views, alone, strict=True):
        assert view.nbytes == own.nbytes - own.index.nbytes - 12 * len(own)  # rows only
        assert view.value_bytes == own.value_bytes
    assert shared.nbytes >= index_bytes
    assert shared.nbytes + sum(v.nbytes for v in views) < \
        sum(s.nbytes for s in alone) - index_bytes  # K stores would hold K indexes


def test_what_cannot_share_is_named():
    lasso = SparseOptimizerConfig(group_lasso=0.1)
    assert "tiered" in sharing_refusal(StoreConfig(memory_budget="1MB"),
                                       SparseOptimizerConfig())
    assert "group lasso" in sharing_refusal(StoreConfig(), lasso)
    assert "row norm" in sharing_refusal(StoreConfig(evict_l2_below=0.01),
                                         SparseOptimizerConfig())
    assert "only count admission" in sharing_refusal(StoreConfig(max_keys=100),
                                                     SparseOptimizerConfig())
    assert "variable-width" in sharing_refusal(
        StoreConfig(variable_dims=(2,), promote_at=(3.0,)), SparseOptimizerConfig())
    with pytest.raises(ValueError, match="cannot share a key index: group lasso"):
        SharedRowsStore(SharedKeys(StoreConfig()), 4, SparseOptimizer(lasso))
    with pytest.raises(ValueError, match="admission and eviction settings"):
        SharedRowsStore(SharedKeys(StoreConfig()), 4, SparseOptimizer(SparseOptimizerConfig()),
                        StoreConfig(admit_min_count=3))
