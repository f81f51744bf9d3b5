"""Eviction policies at pass end: L2 norm, show count, capacity by keys and by bytes, in
the memory and the tiered store alike, with evicted keys logged for the next delta."""

from __future__ import annotations

import numpy as np
import pytest

from terarec.config import SparseOptimizerConfig, StoreConfig, TrainConfig, from_dict
from terarec.embedding.eviction import row_norms, store_bytes
from terarec.embedding.optimizers import SparseOptimizer
from terarec.embedding.store import MemoryStore
from terarec.embedding.tiered import TieredStore
from terarec.embedding.types import RowBlock
from terarec.validation import InvalidInput

DIM = 4


def _stores(tmp_path, **cfg) -> list[MemoryStore | TieredStore]:
    opt = SparseOptimizer(SparseOptimizerConfig())
    # A small budget: most rows live only on disk, so eviction reads them there.
    return [MemoryStore(DIM, opt, StoreConfig(**cfg), seed=2),
            TieredStore(DIM, opt, StoreConfig(memory_budget="600KB", **cfg), seed=2,
                        path=tmp_path / "tier")]


def _pass(store, p: int, rng: np.random.Generator, n: int = 3000) -> np.ndarray:
    """One pass over Zipf keys; rows pushed back scaled by a per-key factor so that
    their norms differ. Returns the keys evicted at its end."""
    raw = rng.zipf(1.3, 4 * n).astype(np.int64) % 20_000 + 1
    keys, show = np.unique(raw, return_counts=True)
    block, admitted = store.pull(keys, show.astype(np.float32),
                                 np.zeros(len(keys), np.float32), p)
    scale = ((keys[admitted] * 2654435761) % 97 / 24.0).astype(np.float32)[:, None]
    store.push(keys[admitted], RowBlock(block.values * scale, block.state))
    store.end_pass(p)
    return store.take_evicted()


def _run(tmp_path, passes: int = 4, **cfg):
    stores = _stores(tmp_path, **cfg)
    for s in stores:
        s.track_evictions()
    evicted: list[list[np.ndarray]] = [[], []]
    for i, s in enumerate(stores):
        rng = np.random.default_rng(7)
        for p in range(passes):
            evicted[i].append(_pass(s, p, rng))
    return stores, evicted


def test_capacity_by_keys_holds_after_every_pass_and_keeps_the_most_shown(tmp_path):
    stores = _stores(tmp_path, max_keys=500)
    rng = [np.random.default_rng(7), np.random.default_rng(7)]
    for p in range(4):
        for s, r in zip(stores, rng, strict=True):
            _pass(s, p, r)
            assert len(s) == 500
    mem, tiered = (s.to_arrays() for s in stores)
    np.testing.assert_array_equal(mem["keys"], tiered["keys"])
    # LFU: no evicted key had more shows than a kept one when it went (ties by key), so
    # the kept keys' shows are the top of what the pass saw.
    assert mem["show"].min() >= 2
    keep_all = _stores(tmp_path / "all")[0]
    r = np.random.default_rng(7)
    for p in range(4):
        _pass(keep_all, p, r)
    assert len(keep_all) > 3 * 500


def test_capacity_by_bytes_holds_after_every_pass_in_both_stores(tmp_path):
    stores = _stores(tmp_path, max_store_bytes="40KB", evict_score="lru")
    rng = [np.random.default_rng(7), np.random.default_rng(7)]
    for p in range(4):
        for s, r in zip(stores, rng, strict=True):
            _pass(s, p, r)
            assert 0.9 * (40 << 10) < store_bytes(s) <= 40 << 10
    np.testing.assert_array_equal(*(s.to_arrays()["keys"] for s in stores))
    # LRU: every kept key was seen in the last pass (it alone has more keys than fit).
    assert (stores[0].to_arrays()["last_seen"] == 3).all()


def test_l2_eviction_drops_small_rows_and_logs_them_for_the_delta(tmp_path):
    stores, evicted = _run(tmp_path, evict_l2_below=0.02)
    mem, tiered = (s.to_arrays() for s in stores)
    assert (row_norms(mem["values"]) >= 0.02).all()
    np.testing.assert_array_equal(mem["keys"], tiered["keys"])
    for a, b in zip(*evicted, strict=True):
        assert len(a) > 0
        np.testing.assert_array_equal(a, b)
    gone = np.unique(np.concatenate(evicted[0]))
    assert stores[0].stats().evicted == sum(len(e) for e in evicted[0]) >= len(gone)


def test_show_eviction_spares_keys_of_this_pass(tmp_path):
    stores, evicted = _run(tmp_path, evict_show_below=3)
    mem = stores[0].to_arrays()
    rare = mem["show"] < 3
    assert rare.any() and (mem["last_seen"][rare] == 3).all()  # only this pass's keys
    np.testing.assert_array_equal(mem["keys"], stores[1].to_arrays()["keys"])
    np.testing.assert_array_equal(np.concatenate(evicted[0]), np.concatenate(evicted[1]))


def test_policies_compose_thresholds_first_then_the_capacity_target(tmp_path):
    stores, evicted = _run(tmp_path, evict_after_passes=2, evict_l2_below=0.02,
                           max_keys=400, evict_score="l2")
    for s in stores:
        arrays = s.to_arrays()
        assert len(arrays["keys"]) == 400
        assert (arrays["last_seen"] >= 2).all()
        assert (row_norms(arrays["values"]) >= 0.02).all()
    np.testing.assert_array_equal(*(s.to_arrays()["keys"] for s in stores))


def test_eviction_flags_are_checked_with_the_field():
    with pytest.raises(InvalidInput, match=r"store\.max_keys: 0 must be > 0"):
        from_dict(TrainConfig, {"store": {"max_keys": 0}})
    with pytest.raises(InvalidInput, match=r"store\.evict_score: 'mru' is not one of"):
        from_dict(TrainConfig, {"store": {"evict_score": "mru"}})
    with pytest.raises(InvalidInput, match=r"store\.evict_l2_below: -1"):
        from_dict(TrainConfig, {"store": {"evict_l2_below": -1.0}})


@pytest.mark.parametrize("seed", range(6))
def test_streamed_eviction_selects_what_eviction_over_every_row_selects(seed):
    # Rows split into parts in a shuffled order, as a disk key index streams its key
    # ranges; ties in shows and last-seen passes are common, so the key decides them.
    from terarec.embedding.eviction import (
        TTL,
        Capacity,
        NormBelow,
        RowView,
        ShowBelow,
        apply_eviction,
        apply_eviction_streamed,
    )

    rng = np.random.default_rng(seed)
    n = int(rng.integers(50, 3000))
    keys = rng.permutation(10 * n)[:n].astype(np.int64)
    seen = rng.integers(0, 6, n).astype(np.int32)
    show = rng.integers(0, 5, n).astype(np.float32)
    norm = rng.integers(0, 8, n).astype(np.float32) / 4
    score = ["lfu", "lru", "l2"][seed % 3]
    per_row = [TTL(4), NormBelow(0.3), ShowBelow(1.0)][:seed % 4]
    capacity = Capacity(int(rng.integers(1, n)), int(rng.integers(1, n)) * 40
                        if seed % 2 else None, score)
    policies = [*per_row, capacity]
    bytes_per_row = 40.0

    def view(sel: np.ndarray) -> RowView:
        return RowView(keys[sel], seen[sel], lambda: show[sel], lambda: norm[sel],
                       bytes_per_row)

    live = np.ones(n, np.bool_)
    order = rng.permutation(n)
    bounds = np.sort(rng.choice(np.arange(1, n), 4, replace=False))

    def parts():
        for idx in np.split(order, bounds):
            yield view(idx[live[idx]])

    def evict_from(alive: np.ndarray, out: list):
        def evict(k: np.ndarray) -> int:
            out.append(np.sort(k))
            alive[np.isin(keys, k)] = False
            return len(k)
        return evict

    whole: list[np.ndarray] = []
    alive = np.ones(n, np.bool_)
    total = apply_eviction(policies, lambda: view(np.flatnonzero(alive)),
                           evict_from(alive, whole), pass_id=5)
    streamed: list[np.ndarray] = []
    got = apply_eviction_streamed(
        policies, parts, lambda: (int(live.sum()), int(live.sum() * bytes_per_row)),
        evict_from(live, streamed), pass_id=5)
    assert got == total > 0
    np.testing.assert_array_equal(np.sort(np.concatenate(streamed)),
                                  np.sort(np.concatenate(whole)))
