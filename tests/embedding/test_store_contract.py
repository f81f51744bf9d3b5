"""The EmbeddingStore contract, run against every implementation and setting.

Each case is driven through the same passes (admission by count, TTL eviction, a
deterministic "training" update) next to a plain ``MemoryStore`` with the same store
settings, the reference: every store must return the same rows, admit and evict the same
keys, and stream, save and load the same table.
"""

from __future__ import annotations

import numpy as np
import pytest

from terarec.config import SparseOptimizerConfig, StoreConfig
from terarec.embedding.index import KeyIndex, iter_sorted_keys
from terarec.embedding.optimizers import SparseOptimizer
from terarec.embedding.protocol import EmbeddingStore
from terarec.embedding.shared import SharedKeys, SharedRowsStore
from terarec.embedding.store import MemoryStore, merge_sorted
from terarec.embedding.tiered import TieredStore, iter_saved
from terarec.embedding.types import RowBlock, RowChunk

ROW_DIM = 16
PASSES = 4
POLICY = dict(admit_min_count=2, evict_after_passes=2)
VARLEN = dict(precision="int8", variable_dims=(4, 8), promote_at=(3.0, 6.0))

# name -> (store kind, memory budget, store settings)
CASES = {
    "memory": ("memory", None, {}),
    "memory-int8": ("memory", None, dict(precision="int8")),
    "memory-varlen": ("memory", None, VARLEN),
    "tiered-in-ram": ("tiered", None, {}),
    "tiered-spilling": ("tiered", "2MB", {}),
    "tiered-spilling-int8": ("tiered", "2MB", dict(precision="int8")),
    "tiered-spilling-varlen": ("tiered", "2MB", VARLEN),
    "tiered-disk-index": ("tiered", None, dict(key_index="disk")),
    "tiered-spilling-disk-index": ("tiered", "2MB", dict(key_index="disk")),
    "tiered-spilling-int8-disk-index": ("tiered", "2MB", dict(precision="int8",
                                                              key_index="disk")),
    # A view of a shared key side (hyperparameter search): its own rows, grown as the
    # key side's slots grow.
    "shared-rows": ("shared", None, {}),
    "shared-rows-int8": ("shared", None, dict(precision="int8")),
}


def _optimizer() -> SparseOptimizer:
    return SparseOptimizer(SparseOptimizerConfig(name="adagrad"))


def _make(kind: str, budget, settings: dict, path) -> EmbeddingStore:
    config = StoreConfig(memory_budget=budget, **POLICY, **settings)
    if kind == "memory":
        return MemoryStore(ROW_DIM, _optimizer(), config, seed=5)
    if kind == "shared":
        return SharedRowsStore(SharedKeys(config, seed=5), ROW_DIM, _optimizer(), config,
                               seed=5)
    return TieredStore(ROW_DIM, _optimizer(), config, seed=5, path=path)


def _plan(passes: int = PASSES, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [np.unique(np.concatenate([rng.zipf(1.3, 6000) % 20_000,
                                      rng.integers(0, 60_000, 6000)]) * 7919 - 3_000_011)
            for _ in range(passes)]


def _drive(store: EmbeddingStore, plan: list[np.ndarray], first_pass: int = 0) -> list:
    """Run the passes; returns what each observable call said, per pass."""
    rng = np.random.default_rng(first_pass + 1)
    seen = []
    for pass_id, keys in enumerate(plan, first_pass):
        keys = rng.permutation(keys)
        show = (keys % 3 + 1).astype(np.float32)
        block, admitted = store.pull(keys, show, (keys % 2).astype(np.float32), pass_id)
        if pass_id + 1 - first_pass < len(plan):
            store.prefetch(plan[pass_id + 1 - first_pass])
        k = keys[admitted]
        values = block.values * 0.5 + (k % 101)[:, None].astype(np.float32) / 100
        if block.widths is not None:  # training keeps the columns past a row's width zero
            values[np.arange(ROW_DIM) >= block.widths[:, None]] = 0
        store.push(k, RowBlock(values, block.state + 1.0))
        evicted = store.end_pass(pass_id)
        order = np.argsort(k)
        changed = store.changed_since(pass_id)
        seen.append((k[order], block.values[order], admitted.sum(), evicted,
                     store.take_evicted(), changed[0], changed[1]))
    return seen


def _table(store: EmbeddingStore, chunk_rows: int = 1000) -> dict[str, np.ndarray]:
    chunks = [c.columns() for c in store.iter_sorted(chunk_rows)]
    return {name: np.concatenate([c[name] for c in chunks]) for name in chunks[0]}


def _assert_same_table(a: dict, b: dict, atol: float = 0.0) -> None:
    assert sorted(a) == sorted(b)
    for name in a:
        if atol and a[name].dtype == np.float32:
            np.testing.assert_allclose(a[name], b[name], rtol=0, atol=atol, err_msg=name)
        else:
            np.testing.assert_array_equal(a[name], b[name], err_msg=name)


@pytest.fixture(params=list(CASES))
def case(request, tmp_path):
    """(store under test, reference memory store), both driven through the passes."""
    kind, budget, settings = CASES[request.param]
    store = _make(kind, budget, settings, tmp_path / "store")
    reference = _make("memory", None, settings, None)
    for s in (store, reference):
        s.track_evictions()
    got, want = _drive(store, _plan()), _drive(reference, _plan())
    return request.param, store, reference, got, want


def test_every_store_implements_the_protocol(case):
    _, store, reference, _, _ = case
    assert isinstance(store, EmbeddingStore) and isinstance(reference, EmbeddingStore)


def test_pull_push_admission_eviction_and_changes_match_the_reference(case):
    name, store, _, got, want = case
    for pass_id, (g, w) in enumerate(zip(got, want, strict=True)):
        for what, a, b in zip(("keys", "rows", "admitted", "evicted", "take_evicted",
                               "changed keys", "changed values"), g, w, strict=True):
            np.testing.assert_array_equal(a, b, err_msg=f"{name} pass {pass_id}: {what}")
    admitted = [int(g[2]) for g in got]
    evicted = [int(g[3]) for g in got]
    # The plan exercises admission (not every key gets in) and TTL eviction.
    assert all(a > 0 for a in admitted) and sum(evicted) > 0
    assert len(got[-1][4]) == got[-1][3]  # take_evicted lists what end_pass evicted
    if CASES[name][1] is not None:  # the small budget really moved rows to disk and back
        tiers = store.tier_stats()
        assert tiers is not None and tiers.spilled > 0 and tiers.memory_keys < len(store)


def test_pushed_rows_come_back_from_lookup(case):
    _, store, _, _, _ = case
    table = _table(store)
    keys = np.concatenate([table["keys"][::7], [123, 456]])  # 123 and 456 were never seen
    values, found = store.lookup(keys)
    assert found[:-2].all() and not found[-2:].any()
    np.testing.assert_array_equal(values[:-2], table["values"][::7])
    np.testing.assert_array_equal(values[-2:], 0)


def test_iter_sorted_is_ordered_complete_and_chunk_bounded(case):
    _, store, reference, _, _ = case
    chunks = list(store.iter_sorted(333))
    assert chunks and all(0 < len(c) <= 333 for c in chunks)
    keys = np.concatenate([c.keys for c in chunks])
    assert bool(np.all(keys[1:] > keys[:-1]))
    want = reference.to_arrays()
    np.testing.assert_array_equal(keys, want["keys"])
    _assert_same_table(_table(store), {k: want[k] for k in RowChunk.__dataclass_fields__})
    assert len(keys) == len(store) == store.stats().keys


def test_stats_match_the_reference(case):
    _, store, reference, _, _ = case
    a, b = store.stats(), reference.stats()
    assert (a.keys, a.candidates, a.admitted, a.evicted, a.pruned) == (
        b.keys, b.candidates, b.admitted, b.evicted, b.pruned)
    assert a.candidates > 0 and a.value_bytes == store.value_bytes > 0
    assert (store.tier_stats() is None) == (not store.prefetches)


def test_evict_removes_keys_and_logs_them(case):
    name, store, _, _, _ = case
    keys = _table(store)["keys"][:50]
    if CASES[name][0] == "shared":  # a view's rows go when its key side evicts them
        with pytest.raises(TypeError, match="evicted by its key side"):
            store.evict(keys)
        return
    assert store.evict(np.concatenate([keys, [7, 8]])) == 50  # 7, 8: not stored
    assert not store.lookup(keys)[1].any()
    np.testing.assert_array_equal(store.take_evicted(), keys)
    assert len(store.take_evicted()) == 0  # the log was cleared


@pytest.mark.parametrize("into", ["memory", "tiered", "tiered-spilling"])
def test_save_and_load_into_any_store_keeps_table_stats_and_admission(case, into,
                                                                      tmp_path):
    name, store, reference, _, _ = case
    settings = CASES[name][2]
    digests = store.save(tmp_path / "saved")
    assert digests and all((tmp_path / "saved" / f).is_file() for f in digests)
    store.committed(tmp_path / "saved", digests)
    kind, budget = {"memory": ("memory", None), "tiered": ("tiered", None),
                    "tiered-spilling": ("tiered", "2MB")}[into]
    loaded = _make(kind, budget, settings, tmp_path / "loaded")
    loaded.load(tmp_path / "saved", digests)
    # Encoded rows are exact where they travel as bytes (slab snapshot to tiered store);
    # the arrays form holds decoded values, re-encoded on load to within float rounding.
    exact = "precision" not in settings or store.saved_format == loaded.saved_format == "tiered"
    atol = 0.0 if exact else 1e-6
    _assert_same_table(_table(loaded), _table(reference), atol)
    _assert_same_table(
        {k: v for k, v in
         [(c, np.concatenate([x.columns()[c] for x in iter_saved(tmp_path / "saved", 500)]))
          for c in RowChunk.__dataclass_fields__]}, _table(reference))
    a, b = loaded.stats(), reference.stats()
    assert (a.keys, a.candidates, a.admitted, a.evicted) == (
        b.keys, b.candidates, b.admitted, b.evicted)
    # Training on from the loaded store admits and evicts exactly as the reference does.
    more = _plan(2, seed=9)
    loaded.track_evictions()
    for g, w in zip(_drive(loaded, more, PASSES), _drive(reference, more, PASSES),
                    strict=True):
        for a_, b_ in zip(g, w, strict=True):
            np.testing.assert_allclose(a_, b_, rtol=0, atol=atol * 10)


def test_sorted_key_ranges_cover_the_union_in_order():
    rng = np.random.default_rng(3)
    a, b = KeyIndex(16), KeyIndex(16)
    ka = rng.integers(-(1 << 62), 1 << 62, 5000)
    kb = np.concatenate([ka[:1000], rng.integers(-100, 100, 300)])
    a.lookup_or_insert(ka)
    b.lookup_or_insert(kb)
    a.remove(ka[::5])
    parts = list(iter_sorted_keys([a, b], range_keys=700))
    assert len(parts) > 3 and max(len(p) for p in parts) < 3 * 700
    keys = np.concatenate(parts)
    np.testing.assert_array_equal(keys, np.union1d(a.items()[0], b.items()[0]))


def test_merge_sorted_interleaves_disjoint_streams_in_bounded_chunks():
    rng = np.random.default_rng(4)
    keys = np.sort(rng.choice(1 << 40, 5000, replace=False))
    owner = rng.integers(0, 3, len(keys))

    def stream(r: int, size: int):
        k = keys[owner == r]
        for lo in range(0, len(k), size):
            part = k[lo:lo + size]
            yield RowChunk(part, np.repeat(part[:, None], 2, 1).astype(np.float32),
                           np.zeros((len(part), 1), np.float32), part.astype(np.float32),
                           np.zeros(len(part), np.float32), np.zeros(len(part), np.int32))

    chunks = list(merge_sorted([stream(0, 100), stream(1, 777), stream(2, 1)], 250))
    assert all(0 < len(c) <= 250 for c in chunks)
    merged = np.concatenate([c.keys for c in chunks])
    np.testing.assert_array_equal(merged, keys)
    np.testing.assert_array_equal(np.concatenate([c.values[:, 1] for c in chunks]),
                                  keys.astype(np.float32))


def test_a_closed_store_frees_its_folder_for_the_next(case, tmp_path):
    """``close`` releases what outlives the object's use (a tiered store's folder lock):
    a new store of the same settings can take the folder at once, starting empty."""
    name, store, _, _, _ = case
    kind, budget, settings = CASES[name]
    store.close()
    store.close()  # twice is harmless
    again = _make(kind, budget, settings, tmp_path / "store")
    assert len(again) == 0 and list(again.iter_sorted()) == []
    again.close()


@pytest.mark.parametrize("name", list(CASES))
def test_an_empty_store_saves_and_loads(name, tmp_path):
    kind, budget, settings = CASES[name]
    store = _make(kind, budget, settings, tmp_path / "store")
    digests = store.save(tmp_path / "saved")
    assert list(store.iter_sorted()) == []
    for into in ("memory", "tiered"):
        loaded = _make(into, None, settings, tmp_path / f"loaded-{into}")
        loaded.load(tmp_path / "saved", digests)
        assert len(loaded) == 0 and list(loaded.iter_sorted()) == []
        assert loaded.stats().keys == 0


def test_implementations_keep_the_protocol_signatures():
    """Guard: every protocol method exists on each store with the same parameters."""
    import inspect

    members = [n for n, v in vars(EmbeddingStore).items()
               if callable(v) and not n.startswith("_") or n == "__len__"]
    assert {"pull", "push", "iter_sorted", "save", "load", "committed"} <= set(members)
    for cls in (MemoryStore, TieredStore):
        for name in members:
            want = list(inspect.signature(getattr(EmbeddingStore, name)).parameters)
            got = list(inspect.signature(getattr(cls, name)).parameters)
            assert got == want, (cls.__name__, name, got, want)
