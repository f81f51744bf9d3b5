"""TieredStore against MemoryStore: same rows after the same passes, whatever spills."""

from __future__ import annotations

import numpy as np
import pytest

from terarec.config import SparseOptimizerConfig, StoreConfig
from terarec.embedding.optimizers import SparseOptimizer
from terarec.embedding.store import MemoryStore
from terarec.embedding.tiered import MemoryBudgetError, TieredStore
from terarec.embedding.types import RowBlock
from terarec.io import sha256_file

ROW_DIM = 32


def _stores(tmp_path, budget="3MB", policy="lfu", opt="adagrad", **store_kw):
    optimizer = SparseOptimizer(SparseOptimizerConfig(name=opt))
    mem = MemoryStore(ROW_DIM, optimizer, StoreConfig(**store_kw), seed=3)
    tiered = TieredStore(ROW_DIM, optimizer,
                         StoreConfig(memory_budget=budget, cache_policy=policy, **store_kw),
                         seed=3, path=tmp_path / "store")
    return mem, tiered


def _run_passes(store, passes, rng_seed=0, prefetch=False):
    """Zipf-keyed passes; rows get a deterministic key-dependent 'training' update."""
    rng = np.random.default_rng(rng_seed)
    plan = [np.unique(np.concatenate([rng.zipf(1.3, 3000) % 50_000,
                                      rng.integers(0, 200_000, 3000)]) * 7919 + 11)
            for _ in range(passes)]
    for pass_id, keys in enumerate(plan):
        rng.shuffle(keys)
        show = (keys % 3 + 1).astype(np.float32)
        click = (keys % 2).astype(np.float32)
        block, admitted = store.pull(keys, show, click, pass_id)
        if prefetch and pass_id + 1 < len(plan) and hasattr(store, "prefetch"):
            store.prefetch(plan[pass_id + 1])
        k = keys[admitted]
        values = block.values * 0.5 + (k % 101)[:, None].astype(np.float32) / 100
        state = block.state + 1.0
        store.push(k, RowBlock(values, state))
        store.end_pass(pass_id)


def _assert_same(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


@pytest.mark.parametrize("policy", ["lfu", "lru"])
def test_tiered_matches_memory_store_under_a_small_budget(tmp_path, policy):
    mem, tiered = _stores(tmp_path, policy=policy)
    _run_passes(mem, 6)
    _run_passes(tiered, 6, prefetch=True)
    stats = tiered.tier_stats()
    # The budget forced rows out to disk and back, so both tiers were exercised.
    assert stats.spilled > 0 and stats.loaded > 0 and stats.prefetched > 0
    assert stats.memory_keys <= stats.memory_capacity < len(tiered)
    assert len(tiered) == len(mem)
    _assert_same(mem.to_arrays(), tiered.to_arrays())


def test_admission_and_ttl_eviction_across_tiers(tmp_path):
    mem, tiered = _stores(tmp_path, admit_min_count=2, evict_after_passes=2, opt="adam")
    _run_passes(mem, 7, rng_seed=1)
    _run_passes(tiered, 7, rng_seed=1, prefetch=True)
    assert tiered.evicted_total == mem.evicted_total > 0
    assert tiered.admitted_total == mem.admitted_total
    assert tiered.stats().candidates == mem.stats().candidates > 0
    _assert_same(mem.to_arrays(), tiered.to_arrays())


def test_evicted_key_leaves_both_tiers(tmp_path):
    _, tiered = _stores(tmp_path)
    keys = np.arange(1, 30_001, dtype=np.int64)
    ones = np.ones(len(keys), np.float32)
    block, _ = tiered.pull(keys, ones, ones * 0, 0)
    tiered.push(keys, block)
    tiered.flush()  # every key now on disk, the hot ones in memory too
    hot = keys[tiered.memory.index.lookup(keys) >= 0]
    cold = keys[tiered.memory.index.lookup(keys) < 0]
    assert len(hot) and len(cold)
    gone = np.concatenate([hot[:10], cold[:10]])
    assert tiered.evict(gone) == 20
    assert not tiered.disk.contains(gone).any()
    assert (tiered.memory.index.lookup(gone) < 0).all()
    assert len(tiered) == len(keys) - 20
    _, found = tiered.lookup(gone)
    assert not found.any()


def test_lookup_reads_cold_rows_without_promoting_them(tmp_path):
    mem, tiered = _stores(tmp_path)
    _run_passes(mem, 3)
    _run_passes(tiered, 3)
    keys = np.concatenate([mem.to_arrays()["keys"], [-5, -6]])
    hot_before = len(tiered.memory)
    v_mem, f_mem = mem.lookup(keys)
    v_tier, f_tier = tiered.lookup(keys)
    np.testing.assert_array_equal(f_mem, f_tier)
    np.testing.assert_array_equal(v_mem, v_tier)
    assert len(tiered.memory) == hot_before


def test_load_arrays_round_trip_and_snapshot(tmp_path):
    mem, tiered = _stores(tmp_path, admit_min_count=2)
    _run_passes(mem, 4, rng_seed=2)
    arrays = mem.to_arrays()
    tiered.load_arrays(arrays)
    _assert_same(arrays, tiered.to_arrays())
    digests = tiered.save_snapshot(tmp_path / "snap")
    tiered.snapshot_committed(tmp_path / "snap", digests)
    other = _stores(tmp_path / "other", admit_min_count=2)[1]  # the same admission state
    other.load_snapshot(tmp_path / "snap", digests)
    _assert_same(arrays, other.to_arrays())


def test_incremental_snapshot_links_unchanged_slabs(tmp_path):
    optimizer = SparseOptimizer(SparseOptimizerConfig())
    store = TieredStore(ROW_DIM, optimizer, StoreConfig(memory_budget="4MB"),
                        path=tmp_path / "s", slab_bytes=64 << 10)  # many small slabs
    keys = np.arange(1, 20_001, dtype=np.int64)
    ones = np.ones(len(keys), np.float32)
    block, _ = store.pull(keys, ones, ones, 0)
    store.push(keys, block)
    first = store.save_snapshot(tmp_path / "c1")
    store.snapshot_committed(tmp_path / "c1", first)
    # Touch only ten keys: only their slabs get new files, the rest are c1's files.
    store.push(keys[:10], RowBlock(block.values[:10] + 1, block.state[:10]))
    second = store.save_snapshot(tmp_path / "c2")
    touched = {f"slab-{s:06d}.bin" for s in store.disk.index.lookup(keys[:10]) >> store.disk.shift}
    slabs = sorted(n for n in second if n.startswith("slab-"))

    def inode(folder: str, name: str) -> int:
        return (tmp_path / folder / name).stat().st_ino

    same = {n for n in slabs if inode("c2", n) == inode("c1", n)}
    assert len(slabs) >= 2 * len(touched)
    assert same == set(slabs) - touched
    assert all(second[n] != first[n] for n in touched)
    assert all(sha256_file(tmp_path / "c1" / n) == first[n] for n in slabs)  # c1 intact
    assert store.disk.slabs_copied == len(touched)
    restored = TieredStore(ROW_DIM, optimizer, StoreConfig(), path=tmp_path / "r")
    restored.load_snapshot(tmp_path / "c2")
    values, found = restored.lookup(keys[:12])
    assert found.all()
    np.testing.assert_array_equal(values[:10], block.values[:10] + 1)
    np.testing.assert_array_equal(values[10:], block.values[10:12])


@pytest.mark.parametrize("key_index", ["ram", "disk"])
def test_snapshots_share_slab_files_until_they_are_written(tmp_path, key_index):
    """A snapshot hard-links the live slabs (no copy, no disk); a write copies the slab it
    lands in first, so the snapshot keeps its bytes; a restore links them again."""
    optimizer = SparseOptimizer(SparseOptimizerConfig())
    store = TieredStore(ROW_DIM, optimizer, StoreConfig(memory_budget="4MB", key_index=key_index),
                        path=tmp_path / "s", slab_bytes=64 << 10)
    keys = np.arange(1, 20_001, dtype=np.int64)
    ones = np.ones(len(keys), np.float32)
    block, _ = store.pull(keys, ones, ones, 0)
    store.push(keys, block)
    store.end_pass(0)
    digests = store.save_snapshot(tmp_path / "c1")
    store.snapshot_committed(tmp_path / "c1", digests)
    slabs = sorted(n for n in digests if n.startswith("slab-"))
    assert len(slabs) > 2
    assert all((tmp_path / "c1" / n).stat().st_ino == (tmp_path / "s" / n).stat().st_ino
               for n in slabs)
    assert store.disk.slabs_copied == 0
    # Rows written to disk after the snapshot: only the slabs they land in are copied.
    before = store.disk.read(keys[:5])[0]
    store.disk.write(keys[:5], before + 1)
    assert 1 <= store.disk.slabs_copied < len(slabs)
    assert all(sha256_file(tmp_path / "c1" / n) == digests[n] for n in slabs)
    np.testing.assert_array_equal(store.disk.read(keys[:5])[0], before + 1)
    restored = TieredStore(ROW_DIM, optimizer, StoreConfig(key_index=key_index),
                           path=tmp_path / "r", slab_bytes=64 << 10)
    restored.load_snapshot(tmp_path / "c1", digests)
    values, found = restored.lookup(keys[:10])
    assert found.all()
    np.testing.assert_array_equal(values, block.values[:10])  # the snapshot's rows
    assert restored.disk.slabs_copied == 0
    restored.disk.write(keys[:5], restored.disk.read(keys[:5])[0] * 2)
    assert all(sha256_file(tmp_path / "c1" / n) == digests[n] for n in slabs)
    np.testing.assert_array_equal(restored.lookup(keys[5:10])[0], block.values[5:10])


def test_budget_too_small_for_the_key_index_is_refused(tmp_path):
    optimizer = SparseOptimizer(SparseOptimizerConfig())
    store = TieredStore(ROW_DIM, optimizer, StoreConfig(memory_budget="64KB"),
                        path=tmp_path / "s")
    keys = np.arange(1, 100_001, dtype=np.int64)
    ones = np.ones(len(keys), np.float32)
    with pytest.raises(MemoryBudgetError, match="raise --memory-budget"):
        for start in range(0, len(keys), 1000):
            part = keys[start:start + 1000]
            block, _ = store.pull(part, ones[:1000], ones[:1000], 0)
            store.push(part, block)


@pytest.mark.parametrize("budget", [f"{1 << 20}TB", "99999999999TB"])
def test_budget_beyond_this_machine_is_refused_naming_the_flag(tmp_path, budget):
    """The memory tier's index is allocated up front for the budget's hot rows: a budget
    no machine can allocate is one error naming --memory-budget, not numpy's."""
    optimizer = SparseOptimizer(SparseOptimizerConfig())
    with pytest.raises(MemoryBudgetError, match=f"--memory-budget {budget}: .* lower"):
        TieredStore(ROW_DIM, optimizer, StoreConfig(memory_budget=budget),
                    path=tmp_path / "s")


def test_change_tracking_matches_memory_store(tmp_path):
    """What incremental export reads: rows touched since a pass, and evicted keys."""
    mem, tiered = _stores(tmp_path, budget="2MB", evict_after_passes=3)
    for store in (mem, tiered):
        store.track_evictions()
        _run_passes(store, 5, rng_seed=4)
    assert len(tiered.disk) > len(tiered.memory) > 0
    for since in (0, 3, 4):
        keys_m, values_m = mem.changed_since(since)
        keys_t, values_t = tiered.changed_since(since)
        np.testing.assert_array_equal(keys_m, keys_t)
        np.testing.assert_array_equal(values_m, values_t)
    evicted = tiered.take_evicted()
    assert len(evicted) == tiered.evicted_total > 0
    np.testing.assert_array_equal(evicted, mem.take_evicted())
    assert len(tiered.take_evicted()) == 0
