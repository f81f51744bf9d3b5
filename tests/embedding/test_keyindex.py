"""The two-level key index (``RunIndex``) and the tiered store on it (``key_index="disk"``).

The store-level behaviour (same rows, admissions, evictions, changes, saves as a memory
store) is in test_store_contract.py; exact resume after SIGKILL in train/test_resume.py.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from terarec.config import SparseOptimizerConfig, StoreConfig
from terarec.embedding import keyindex
from terarec.embedding.keyindex import RunIndex
from terarec.embedding.optimizers import SparseOptimizer
from terarec.embedding.tiered import TieredStore
from terarec.embedding.types import RowBlock


def test_batches_of_changes_match_a_dict_through_flushes_merges_and_removals(
        tmp_path, monkeypatch):
    monkeypatch.setattr(keyindex, "MERGE_CHUNK", 700)  # merges cross several key ranges
    monkeypatch.setattr(keyindex, "MAPPED_BYTES", 1)  # lookups resolve 1024 keys a part
    index = RunIndex(tmp_path, buffer_keys=3000)  # the hot level fills and is flushed
    rng = np.random.default_rng(0)
    ref: dict[int, tuple[int, int]] = {}
    for step in range(25):
        keys = np.unique(rng.integers(-10_000, 10_000, 2500))
        slots = index.assign(keys, np.full(len(keys), step))
        for k, s in zip(keys.tolist(), slots.tolist(), strict=True):
            assert ref.get(k, (s,))[0] == s  # a key keeps its slot
            ref[k] = (s, step)
        gone = np.unique(rng.integers(-10_000, 10_000, 400))
        for k, s in zip(gone.tolist(), index.remove(gone).tolist(), strict=True):
            assert s == (ref.pop(k)[0] if k in ref else -1)
        probe = rng.permutation(np.unique(rng.integers(-12_000, 12_000, 3000)))
        expected = [ref[k][0] if k in ref else -1 for k in probe.tolist()]
        assert index.lookup(probe).tolist() == expected
        if step % 3 == 0:
            index.plan(rng.integers(-10_000, 10_000, 300))
            index.end_pass()
    assert len(index.runs) > 1
    keys, slots, seen = index.items_seen()
    assert keys.tolist() == sorted(ref)
    assert [(s, t) for s, t in zip(slots.tolist(), seen.tolist(), strict=True)] == \
        [ref[k] for k in keys.tolist()]
    assert len(index) == len(ref) and len(set(slots.tolist())) == len(slots)
    # Removed keys' slots are handed out again: slots stay dense.
    assert index.slot_bound < len(ref) + 3000
    index.compact()
    assert len(index.runs) == 1 and index.runs[0].n == len(ref)  # removed keys dropped


def test_cold_keys_cost_about_a_byte_of_ram(tmp_path):
    index = RunIndex(tmp_path)
    n = 300_000
    keys = np.random.default_rng(1).permutation(n).astype(np.int64) * 7919
    for lo in range(0, n, 100_000):
        index.assign(keys[lo:lo + 100_000], np.zeros(100_000, np.int32))
    index.end_pass()
    assert index.hot_keys == 0
    assert index.nbytes / n < 4
    # A pass's keys in play cost their hot entries, and leave after the pass.
    index.plan(keys[:50_000])
    assert index.hot_keys == 50_000
    index.end_pass()  # planned: kept for the next pass
    index.end_pass()
    assert index.hot_keys == 0


def test_snapshot_links_the_runs_and_restores_the_same_index(tmp_path):
    index = RunIndex(tmp_path / "live")
    keys = np.arange(0, 50_000, 3, dtype=np.int64)
    index.assign(keys, keys.astype(np.int32) % 7)
    index.remove(keys[::5])
    (tmp_path / "snap").mkdir()
    arrays, manifest = index.snapshot(tmp_path / "snap")
    for run in index.runs:
        for name in run.files:
            assert os.stat(tmp_path / "snap" / name).st_ino == \
                os.stat(tmp_path / "live" / name).st_ino
    restored = RunIndex(tmp_path / "other")
    restored.restore(tmp_path / "snap", arrays, manifest)
    for a, b in zip(index.items_seen(), restored.items_seen(), strict=True):
        np.testing.assert_array_equal(a, b)
    # The same free slots, handed out in the same order.
    new = np.arange(100_000, 100_050, dtype=np.int64)
    np.testing.assert_array_equal(index.assign(new, np.ones(50, np.int32)),
                                  restored.assign(new, np.ones(50, np.int32)))


def _store(path, key_index: str, **settings) -> TieredStore:
    config = StoreConfig(memory_budget="6MB", key_index=key_index, **settings)
    return TieredStore(8, SparseOptimizer(SparseOptimizerConfig(name="adagrad")), config,
                       seed=3, path=path)


def _train(store: TieredStore, passes: int, seed: int = 0, keys_per_pass: int = 8000) -> None:
    rng = np.random.default_rng(seed)
    for pass_id in range(passes):
        keys = np.unique(rng.integers(0, 40_000, keys_per_pass)) * 11
        block, admitted = store.pull(keys, np.ones(len(keys), np.float32),
                                     np.zeros(len(keys), np.float32), pass_id)
        store.push(keys[admitted], RowBlock(block.values + 0.5, block.state + 1))
        store.end_pass(pass_id)


@pytest.mark.parametrize(("saved", "loaded"), [("disk", "ram"), ("ram", "disk")])
def test_snapshots_load_across_key_indexes(tmp_path, saved, loaded):
    store = _store(tmp_path / "a", saved)
    _train(store, 3)
    store.save(tmp_path / "snap")
    other = _store(tmp_path / "b", loaded)
    other.load(tmp_path / "snap")
    a, b = store.to_arrays(), other.to_arrays()
    for name in ("keys", "values", "state", "show", "last_seen"):
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)
    _train(store, 2, seed=1)
    _train(other, 2, seed=1)
    np.testing.assert_array_equal(store.to_arrays()["values"], other.to_arrays()["values"])


def test_ttl_eviction_drops_keys_from_the_runs_at_compaction(tmp_path):
    store = _store(tmp_path / "s", "disk", evict_after_passes=1)
    _train(store, 4)
    assert store.stats().evicted > 0
    runs = store.disk.runs
    assert runs is not None
    runs.compact()
    assert sum(r.n for r in runs.runs) == len(runs) == len(store.disk)
    keys, _, seen = runs.items_seen()
    assert (seen >= 2).all()  # last seen within the TTL, read from the runs


def test_the_table_streams_in_key_order_across_key_ranges(tmp_path, monkeypatch):
    """Disk keys come from the runs a key range at a time, hot rows only in RAM are
    merged in between."""
    monkeypatch.setattr(keyindex, "MERGE_CHUNK", 500)
    store = _store(tmp_path / "s", "disk", precision="int8")
    _train(store, 3)
    reference = _store(tmp_path / "r", "ram", precision="int8")
    _train(reference, 3)
    chunks = list(store.iter_sorted(300))
    keys = np.concatenate([c.keys for c in chunks])
    assert len(chunks) > 10 and (np.diff(keys) > 0).all() and len(keys) == len(store)
    expected = np.concatenate([c.keys for c in reference.iter_sorted(300)])
    np.testing.assert_array_equal(keys, expected)
    np.testing.assert_array_equal(np.concatenate([c.values for c in chunks]),
                                  np.concatenate([c.values for c in
                                                  reference.iter_sorted(300)]))


def test_consecutive_snapshots_share_unchanged_run_files(tmp_path):
    store = _store(tmp_path / "s", "disk")
    _train(store, 2)
    runs = store.disk.runs
    assert runs is not None
    runs.wait()  # the merges due now have swapped in: the first snapshot lists their output
    first = tmp_path / "c1"
    digests = store.save(first)
    store.committed(first, digests)
    # A small pass: its run is far smaller than the ones before it, so no merge rewrites
    # them, and the second snapshot links the same files.
    _train(store, 1, seed=5, keys_per_pass=300)
    runs.wait()
    second = store.save(tmp_path / "c2")
    shared = [n for n in second if n.startswith("run-") and (first / n).exists()]
    assert shared, "no run carried over"
    for name in shared:
        assert os.stat(first / name).st_ino == os.stat(tmp_path / "c2" / name).st_ino
        assert second[name] == digests[name]


def test_a_disk_index_store_stays_inside_its_budget_through_a_bulk_load_and_passes(
        tmp_path, monkeypatch):
    # numpy reports its buffers to tracemalloc: what the store holds after each step, and
    # its peak during the bulk load (the hot level filled to its limit and flushed, with
    # the memory tier allocated beside it), stay inside the budget plus the load chunk.
    # Merges work a key range at a time (a fixed transient, not charged to the budget):
    # small ranges here, so that the budget's own accounting is what is tested.
    import tracemalloc

    from terarec.embedding.types import RowChunk

    monkeypatch.setattr(keyindex, "MERGE_CHUNK", 8192)
    budget, dim, n, chunk = 16 << 20, 16, 400_000, 16_384
    rng = np.random.default_rng(0)
    keys = rng.permutation(n).astype(np.int64) * 7919

    def chunks(k_all):
        for lo in range(0, len(k_all), chunk):
            k = k_all[lo:lo + chunk]
            m = len(k)
            yield RowChunk(k, np.full((m, dim), 0.01, np.float32), np.ones((m, 1), np.float32),
                           np.ones(m, np.float32), np.zeros(m, np.float32),
                           np.zeros(m, np.int32))

    def new_store(name):
        return TieredStore(dim, SparseOptimizer(SparseOptimizerConfig(name="adagrad")),
                           StoreConfig(memory_budget=budget, key_index="disk"), seed=0,
                           path=tmp_path / name)

    def one_pass(store, pass_id):
        pk = rng.choice(keys, 30_000, replace=False)
        block, admitted = store.pull(pk, np.ones(len(pk), np.float32),
                                     np.zeros(len(pk), np.float32), pass_id)
        store.push(pk[admitted], RowBlock(block.values, block.state))
        store.end_pass(pass_id)
        store.disk.runs.wait()

    warm = new_store("warm")  # compiles the kernels: their objects are not the store's
    warm.load_rows(chunks(keys[:3 * chunk]), {})
    one_pass(warm, 0)
    warm.close()
    chunk_bytes = 4 * chunk * (8 + 2 * dim + 8)  # a chunk, its records and write buffers
    # A background merge running beside the load holds a key range of 20 B entries and
    # its copies (the inputs, the merged output, its order): not the store's to budget.
    merge_bytes = 8 * 20 * keyindex.MERGE_CHUNK
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        store = new_store("s")
        store.load_rows(chunks(keys), {})
        store.disk.runs.wait()
        held, peak = tracemalloc.get_traced_memory()
        assert held - base <= budget
        assert peak - base <= budget + chunk_bytes + merge_bytes
        for pass_id in range(4):  # passes that fill the memory tier to its capacity
            one_pass(store, pass_id)
            assert tracemalloc.get_traced_memory()[0] - base <= budget
        assert len(store.memory) >= store.memory_capacity() // 2  # the tier did fill
    finally:
        tracemalloc.stop()
    store.close()
