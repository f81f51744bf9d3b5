"""Background merges of the disk key index, and eviction other than TTL over it.

A merge's inputs are immutable, so lookups and changes go on while it runs; evicted keys
become tombstones in the next flushed run and leave the files when a merge reaches the
oldest run.
"""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest

from terarec.config import SparseOptimizerConfig, StoreConfig
from terarec.embedding import keyindex
from terarec.embedding.keyindex import RunIndex
from terarec.embedding.optimizers import SparseOptimizer
from terarec.embedding.tiered import TieredStore
from terarec.embedding.types import RowBlock, RowChunk


def _fill(index: RunIndex, runs: int, per_run: int, seed: int = 0) -> dict[int, int]:
    """``runs`` flushed runs of ``per_run`` new keys each; returns key -> slot."""
    rng = np.random.default_rng(seed)
    ref: dict[int, int] = {}
    for _ in range(runs):
        keys = np.unique(rng.integers(0, 1 << 40, per_run))
        keys = keys[[k not in ref for k in keys.tolist()]]
        for k, s in zip(keys.tolist(), index.assign(keys, np.ones(len(keys), np.int32)).tolist(),
                        strict=True):
            ref[k] = s
        index.end_pass()
    return ref


def test_lookups_and_changes_go_on_while_a_merge_is_held(tmp_path, monkeypatch):
    started, release = threading.Event(), threading.Event()
    plain = keyindex._ranges

    def held(runs, chunk=None):  # the merge stops after its first key range
        for i, parts in enumerate(plain(runs, chunk)):
            yield parts
            if i == 0 and threading.current_thread().name == "run-index-merge":
                started.set()
                assert release.wait(30)

    monkeypatch.setattr(keyindex, "_ranges", held)
    monkeypatch.setattr(keyindex, "MERGE_CHUNK", 300)
    index = RunIndex(tmp_path)
    ref = _fill(index, 1, 4000)
    ref.update(_fill(index, 1, 3000, seed=1))  # 3000 <= 2 * 4000: a merge is due
    assert started.wait(30)
    assert len(index.runs) == 2  # the merge's inputs still serve lookups
    keys = np.array(sorted(ref), np.int64)
    np.testing.assert_array_equal(index.lookup(keys), [ref[k] for k in keys.tolist()])
    gone = keys[::7]
    np.testing.assert_array_equal(index.remove(gone), [ref.pop(k) for k in gone.tolist()])
    new = np.arange(5, 505, dtype=np.int64)
    for k, s in zip(new.tolist(), index.assign(new, np.full(500, 2, np.int32)).tolist(),
                    strict=True):
        ref[k] = s
    index.end_pass()  # flushes a third run while the merge is still held
    assert len(index.runs) == 3
    release.set()
    index.wait()
    assert index.merges >= 1 and len(index.runs) < 3
    k, s, _ = index.items_seen()
    assert k.tolist() == sorted(ref)
    assert s.tolist() == [ref[x] for x in k.tolist()]
    assert sorted(p.name for p in tmp_path.glob("run-*")) == sorted(
        f for r in index.runs for f in r.files)  # the inputs' files are gone
    index.close()


@pytest.mark.parametrize("background", [True, False])
def test_background_and_inline_merges_give_the_same_index(tmp_path, background):
    index = RunIndex(tmp_path / "i", buffer_keys=2000, background=background)
    rng = np.random.default_rng(4)
    ref: dict[int, int] = {}
    for step in range(30):
        keys = np.unique(rng.integers(0, 20_000, 1500))
        for k, s in zip(keys.tolist(), index.assign(keys, np.full(len(keys), step)).tolist(),
                        strict=True):
            ref[k] = s
        gone = np.unique(rng.integers(0, 20_000, 300))
        index.remove(gone)
        for k in gone.tolist():
            ref.pop(k, None)
        index.end_pass()
    index.wait()
    keys, slots, _ = index.items_seen()
    assert keys.tolist() == sorted(ref) and slots.tolist() == [ref[k] for k in keys.tolist()]
    assert len(index.runs) <= 8  # size-tiered: O(log n) runs
    index.close()


def test_a_failed_background_merge_is_raised_by_the_next_change(tmp_path, monkeypatch):
    def full(parts, drop_removed):
        raise OSError(28, "No space left on device")

    index = RunIndex(tmp_path)
    _fill(index, 1, 1000)
    monkeypatch.setattr(keyindex, "_newest", full)
    _fill(index, 1, 1000, seed=1)
    with pytest.raises(RuntimeError, match=f"merging the key index runs in {tmp_path}"):
        index.wait()
    assert len(index.runs) == 2  # the inputs are intact and still serve lookups
    monkeypatch.undo()
    index.compact()
    assert len(index.runs) == 1 and index.runs[0].n == len(index) == 2000
    index.close()


def _store(path, key_index: str, **settings) -> TieredStore:
    config = StoreConfig(memory_budget="6MB", key_index=key_index, **settings)
    return TieredStore(8, SparseOptimizer(SparseOptimizerConfig(name="adagrad")), config,
                       seed=3, path=path)


def _train(store: TieredStore, passes: int, seed: int = 0) -> list[int]:
    rng = np.random.default_rng(seed)
    evicted = []
    for pass_id in range(passes):
        keys = np.unique(rng.zipf(1.3, 6000) % 30_000) * 11
        block, admitted = store.pull(keys, np.ones(len(keys), np.float32),
                                     np.zeros(len(keys), np.float32), pass_id)
        store.push(keys[admitted], RowBlock(block.values + 0.5, block.state + 1))
        evicted.append(store.end_pass(pass_id))
    return evicted


@pytest.mark.parametrize("score", ["lfu", "lru", "l2"])
def test_capacity_eviction_over_the_disk_index_matches_the_ram_index(tmp_path, score):
    disk = _store(tmp_path / "d", "disk", max_keys=3000, evict_score=score)
    ram = _store(tmp_path / "r", "ram", max_keys=3000, evict_score=score)
    assert _train(disk, 4) == _train(ram, 4)
    assert len(disk) == len(ram) == 3000
    a, b = disk.to_arrays(), ram.to_arrays()
    for name in ("keys", "values", "show", "last_seen"):
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


def test_eviction_writes_tombstones_and_leaves_the_big_run_alone(tmp_path):
    store = _store(tmp_path / "s", "disk")
    n = 10_000
    keys = np.arange(n, dtype=np.int64) * 13
    store.load_rows([RowChunk(keys, np.ones((n, 8), np.float32), np.ones((n, 1), np.float32),
                              np.ones(n, np.float32), np.zeros(n, np.float32),
                              np.zeros(n, np.int32))], {})
    runs = store.disk.runs
    assert runs is not None
    runs.compact()
    (big,) = runs.runs
    inode = os.stat(big.path("keys")).st_ino
    n_before = big.n
    evicted = store.evict(runs.items()[0][:1000])  # as a policy's selection is evicted
    assert evicted == 1000
    store.end_pass(3)
    runs.wait()
    assert runs.runs[0] is big and os.stat(big.path("keys")).st_ino == inode  # no full merge
    assert len(runs.runs) == 2 and (runs.runs[1].cols["slots"] < 0).sum() == 1000
    assert len(runs) == len(store.disk) == n_before - 1000
    keys = runs.items()[0]
    assert len(keys) == n_before - 1000
    runs.compact()  # the tombstones leave the files when a merge reaches the oldest run
    assert len(runs.runs) == 1 and runs.runs[0].n == n_before - 1000
    assert (runs.runs[0].cols["slots"] >= 0).all()


@pytest.mark.parametrize("settings", [
    {"evict_after_passes": 2, "evict_show_below": 2.0, "max_keys": 2500},
    {"evict_l2_below": 0.8, "max_keys": 2800, "evict_score": "l2"},
    {"evict_after_passes": 1, "max_store_bytes": "200KB", "evict_score": "lru"},
])
def test_chained_policies_over_the_disk_index_match_the_ram_index(tmp_path, settings):
    disk = _store(tmp_path / "d", "disk", **settings)
    ram = _store(tmp_path / "r", "ram", **settings)
    evicted = _train(disk, 5)
    assert evicted == _train(ram, 5)
    assert sum(evicted) > 0
    a, b = disk.to_arrays(), ram.to_arrays()
    for name in ("keys", "values", "show", "last_seen"):
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


def test_capacity_eviction_over_the_disk_index_holds_parts_not_every_key(
        tmp_path, monkeypatch):
    # numpy reports its buffers to tracemalloc: selecting the 500 lowest of 200 k keys
    # (almost all only on disk) holds key ranges and candidates, not a 20 B-per-key view
    # of every key as the RAM index's selection does.
    import tracemalloc

    from terarec.embedding import tiered

    monkeypatch.setattr(keyindex, "MERGE_CHUNK", 8192)
    monkeypatch.setattr(tiered, "MERGE_CHUNK", 8192)
    n, dim = 200_000, 8
    keys = np.arange(1, n + 1, dtype=np.int64) * 13
    show = (keys % 1000).astype(np.float32) + 1
    store = TieredStore(dim, SparseOptimizer(SparseOptimizerConfig(name="adagrad")),
                        StoreConfig(memory_budget="8MB", key_index="disk", max_keys=n - 500),
                        seed=0, path=tmp_path / "s")
    store.load_rows(iter([RowChunk(keys, np.full((n, dim), 0.1, np.float32),
                                   np.ones((n, 1), np.float32), show,
                                   np.zeros(n, np.float32), np.zeros(n, np.int32))]), {})
    store.disk.runs.wait()
    expected = keys[np.lexsort((keys, np.zeros(n, np.int32), show))[:500]]
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        store.track_evictions()
        assert store.end_pass(1) == 500
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    np.testing.assert_array_equal(np.sort(store.take_evicted()), np.sort(expected))
    assert len(store) == n - 500
    # The whole-row view alone is n x 20 B (4 MB; 8.4 MB at its peak); streamed, a
    # peak of 1.5-2.7 MB, plus up to 1.3 MB for a background merge's key range.
    assert peak < 6_000_000, peak
    store.close()


def test_a_snapshot_lists_the_runs_it_linked_when_a_merge_swaps_them_right_after(
        tmp_path, monkeypatch):
    # A background merge can finish between linking the runs and hashing them: the
    # snapshot must hash (and list) the runs it linked, not the merged one.
    store = TieredStore(8, SparseOptimizer(SparseOptimizerConfig(name="adagrad")),
                        StoreConfig(memory_budget="1MB", key_index="disk"), seed=3,
                        path=tmp_path / "d")
    runs = store.disk.runs
    rng = np.random.default_rng(0)
    for pass_id in range(3):  # a run flushed per pass (most rows spill to disk)
        keys = np.unique(rng.integers(0, 60_000, 8000)) * 11
        block, admitted = store.pull(keys, np.ones(len(keys), np.float32),
                                     np.zeros(len(keys), np.float32), pass_id)
        store.push(keys[admitted], RowBlock(block.values + 0.5, block.state + 1))
        store.end_pass(pass_id)
        runs.flush()
        runs.wait()
    assert len(runs.runs) > 1
    linked, at_link = RunIndex.snapshot, []

    def snapshot_then_merge(self, dst):
        at_link.append(len(self.runs))
        out = linked(self, dst)
        self.compact()  # what a merge finishing at that moment does
        return out

    # No merge but the one above: one that save's own flush started could otherwise
    # finish first, leaving a single run to link and nothing for compact to swap.
    monkeypatch.setattr(RunIndex, "_schedule", lambda self: None)
    monkeypatch.setattr(RunIndex, "snapshot", snapshot_then_merge)
    digests = store.save(tmp_path / "saved")
    assert at_link[0] > 1
    assert len(runs.runs) == 1 and runs.runs[0].files[0] not in digests
    loaded = _store(tmp_path / "l", "disk")
    loaded.load(tmp_path / "saved")
    assert len(loaded) == len(store) > 0
    a, b = store.to_arrays(), loaded.to_arrays()
    for name in ("keys", "values", "show", "last_seen"):
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)
