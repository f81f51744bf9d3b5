"""Admission policies: exact counts, the fixed-size count-min sketch, probability and
show/click thresholds, through the stores that use them."""

from __future__ import annotations

import numpy as np
import pytest

from terarec.config import SparseOptimizerConfig, StoreConfig, TrainConfig, from_dict
from terarec.embedding.admission import SKETCH_ARRAY, ExactCount, SketchCount, make_admission
from terarec.embedding.optimizers import SparseOptimizer
from terarec.embedding.store import MemoryStore
from terarec.embedding.tiered import TieredStore
from terarec.validation import InvalidInput

DIM = 4


def _store(tmp_path=None, **cfg) -> MemoryStore | TieredStore:
    opt = SparseOptimizer(SparseOptimizerConfig())
    if tmp_path is not None:
        return TieredStore(DIM, opt, StoreConfig(memory_budget="2MB", **cfg), seed=1,
                           path=tmp_path / "tier")
    return MemoryStore(DIM, opt, StoreConfig(**cfg), seed=1)


def _zipf_passes(passes: int, rows: int, seed: int = 0) -> list[tuple[np.ndarray, ...]]:
    """Unique keys of each pass with their shows and clicks, Zipf distributed."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(passes):
        raw = rng.zipf(1.2, rows).astype(np.int64) * 7919
        keys, show = np.unique(raw, return_counts=True)
        click = rng.binomial(show, 0.3).astype(np.float32)
        out.append((keys, show.astype(np.float32), click))
    return out


def _run(store, passes) -> list[np.ndarray]:
    """Pull and push every pass; the admitted keys after each."""
    seen = []
    for p, (keys, show, click) in enumerate(passes):
        block, admitted = store.pull(keys, show, click, p)
        store.push(keys[admitted], block)
        store.end_pass(p)
        seen.append(np.sort(store.to_arrays()["keys"]))
    return seen


def test_sketch_ram_is_fixed_while_the_stream_grows_and_holds_no_per_key_state():
    store = _store(admit_min_count=2, admit_sketch_bytes="64KB")
    sizes = []
    rng = np.random.default_rng(1)
    for p in range(6):  # 40,000 new keys a pass, each seen once: none is ever admitted
        keys = rng.integers(1, 1 << 60, 40_000)
        ones = np.ones(len(keys), np.float32)
        _, admitted = store.pull(keys, ones, ones, p)
        store.end_pass(p)
        sizes.append(store.stats().admission_bytes)
    assert sizes == [64 << 10] * 6
    assert store.stats().candidates == 0
    exact = _store(admit_min_count=2)
    for p in range(2):
        keys = rng.integers(1, 1 << 60, 40_000)
        exact.pull(keys, np.ones(len(keys), np.float32), np.zeros(len(keys), np.float32), p)
    assert exact.stats().admission_bytes > 20 * sizes[-1]  # the exact table keeps growing


def test_sketch_never_admits_later_than_exact_counts_and_matches_them_when_large():
    passes = _zipf_passes(4, 20_000)
    exact = _run(_store(admit_min_count=3), passes)
    small = _run(_store(admit_min_count=3, admit_sketch_bytes="4KB"), passes)
    large = _run(_store(admit_min_count=3, admit_sketch_bytes="16MB"), passes)
    for e, s, g in zip(exact, small, large, strict=True):
        assert np.isin(e, s).all()  # an estimate never undercounts
        np.testing.assert_array_equal(e, g)  # no collisions: exact counts
    assert len(small[-1]) > len(exact[-1])  # a crowded sketch admits some keys early


def test_sketch_admitted_rows_start_from_their_estimated_earlier_shows():
    store = _store(admit_min_count=3, admit_sketch_bytes="1MB")
    keys = np.array([5, 6], np.int64)
    store.pull(keys, np.array([2, 1], np.float32), np.zeros(2, np.float32), 0)
    _, admitted = store.pull(keys, np.array([1, 1], np.float32), np.zeros(2, np.float32), 1)
    assert admitted.tolist() == [True, False]
    assert store.to_arrays()["show"].tolist() == [3.0]


def test_click_threshold_waits_for_clicks_in_exact_and_sketch_counts():
    for extra in ({}, {"admit_sketch_bytes": "1MB"}):
        store = _store(admit_min_count=2, admit_min_clicks=1, **extra)
        keys = np.array([1, 2, 3], np.int64)
        _, a0 = store.pull(keys, np.array([5, 5, 1], np.float32),
                           np.array([0, 1, 1], np.float32), 0)
        assert a0.tolist() == [False, True, False]
        _, a1 = store.pull(keys[[0, 2]], np.array([1, 1], np.float32),
                           np.array([1, 0], np.float32), 1)
        assert a1.tolist() == [True, True]
        assert store.stats().rejected == 2  # keys 1 and 3 in pass 0, none in pass 1


def test_probability_admits_about_p_per_show_keeps_nothing_and_draws_alike():
    keys = np.arange(1, 40_001, dtype=np.int64)
    ones = np.ones(len(keys), np.float32)
    a = _store(admit_probability=0.25)
    _, first = a.pull(keys, ones, ones, 0)
    assert first.mean() == pytest.approx(0.25, abs=0.01)
    assert a.stats().admission_bytes == 0 and a.stats().candidates == 0
    _, twice = _store(admit_probability=0.25).pull(keys, 2 * ones, ones, 0)
    assert twice.mean() == pytest.approx(1 - 0.75 ** 2, abs=0.01)
    _, again = _store(admit_probability=0.25).pull(keys, ones, ones, 0)
    np.testing.assert_array_equal(first, again)  # a hash of (key, pass, seed)
    _, later = a.pull(keys[~first], ones[~first], ones[~first], 1)  # a new draw per pass
    assert later.mean() == pytest.approx(0.25, abs=0.015)


def test_tiered_store_admits_exactly_as_the_memory_store(tmp_path):
    passes = _zipf_passes(3, 20_000, seed=4)
    configs = ({"admit_min_count": 2, "admit_sketch_bytes": "8KB"},
               {"admit_probability": 0.3}, {"admit_min_count": 2, "admit_min_clicks": 1})
    for i, cfg in enumerate(configs):
        mem = _store(**cfg)
        tiered = _store(tmp_path / f"t{i}", **cfg)
        for want, got in zip(_run(mem, passes), _run(tiered, passes), strict=True):
            np.testing.assert_array_equal(want, got)
        assert tiered.stats().rejected == mem.stats().rejected > 0
        assert tiered.stats().admission_bytes == mem.stats().admission_bytes


def test_sketch_state_round_trips_through_the_saved_arrays():
    passes = _zipf_passes(3, 10_000, seed=2)
    a = _store(admit_min_count=3, admit_sketch_bytes="8KB")
    _run(a, passes[:2])
    b = _store(admit_min_count=3, admit_sketch_bytes="8KB")
    b.load_arrays(a.to_arrays())
    np.testing.assert_array_equal(_run(a, passes[2:])[0], _run(b, passes[2:])[0])
    c = _store(admit_min_count=3, admit_sketch_bytes="16KB")
    with pytest.raises(ValueError, match="admit-sketch-bytes"):
        c.load_arrays(a.to_arrays())


def test_policy_choice_and_bad_combinations_are_refused_with_the_field():
    assert isinstance(make_admission(StoreConfig(admit_min_count=2)), ExactCount)
    assert isinstance(make_admission(StoreConfig(admit_min_count=2, admit_sketch_bytes=4096)),
                      SketchCount)
    with pytest.raises(InvalidInput, match=r"store: .*admit_probability .* does not combine"):
        from_dict(TrainConfig, {"store": {"admit_probability": 0.5, "admit_min_count": 2}})
    with pytest.raises(InvalidInput, match=r"store\.admit_probability: 0 must be > 0"):
        from_dict(TrainConfig, {"store": {"admit_probability": 0}})
    with pytest.raises(InvalidInput, match=r"store: admit_sketch_bytes counts up to 255"):
        from_dict(TrainConfig, {"store": {"admit_min_count": 300, "admit_sketch_bytes": "1MB"}})
    with pytest.raises(InvalidInput, match=r"store\.admit_sketch_bytes: size '1XB'"):
        from_dict(TrainConfig, {"store": {"admit_sketch_bytes": "1XB", "admit_min_count": 2}})
    with pytest.raises(InvalidInput, match=r"store: admit_sketch_bytes counts keys until"):
        from_dict(TrainConfig, {"store": {"admit_sketch_bytes": "1MB"}})


def test_sketch_counters_are_as_narrow_as_the_threshold_and_merge_by_sum():
    a, b = SketchCount(4096, 2), SketchCount(4096, 2)
    assert (a.bits, a.width) == (2, 4096)  # 4 rows of 4,096 2-bit counters in 4 KB
    assert SketchCount(4096, 4).bits == 4 and SketchCount(4096, 200).bits == 8
    keys = np.arange(1, 301, dtype=np.int64)
    ones = np.ones(300, np.float32)
    admitted, earlier, _ = a.admit(keys[:1], 5 * ones[:1], ones[:1], 0)
    assert admitted.tolist() == [1] and earlier.tolist() == [0.0]  # saturated at 3
    assert a.counters().max() == 3
    assert len(a.admit(keys[1:150], ones[:149], ones[:149], 0)[0]) < 10
    assert len(b.admit(keys[150:], ones[150:], ones[150:], 0)[0]) < 10
    merged = SketchCount(4096, 2)  # what a re-sharded restore gets: the ranks' sum
    merged.load_arrays({SKETCH_ARRAY: a.counters().astype(np.int64) + b.counters()})
    assert len(merged.admit(keys[1:], ones[1:], ones[1:], 1)[0]) == 299  # each seen twice


def test_loaded_candidates_take_the_ram_grown_ones_take() -> None:
    """A resumed run's candidate arrays (loaded from a checkpoint) have the capacity the
    uninterrupted run's have, which the memory budget counts: loaded at their exact
    size they later doubled past the grown ones, and a resume from some checkpoints was
    refused under the budget the run had trained within."""
    from terarec.embedding.admission import ExactCount

    grown_table = ExactCount(min_show=3)
    for pass_id, n in enumerate((10, 27, 9)):  # jumps past twice the capacity, then not
        keys = np.arange(1000 * pass_id, 1000 * pass_id + n, dtype=np.int64)
        ones = np.ones(n, np.float32)
        grown_table.admit(keys, ones, ones * 0, pass_id)
    loaded = ExactCount(min_show=3)
    loaded.load_arrays(grown_table.arrays())
    assert loaded.candidate_count == grown_table.candidate_count == 46
    for pass_id, n in enumerate((14, 40, 100), start=3):  # both go on alike
        keys = np.arange(1000 * pass_id, 1000 * pass_id + n, dtype=np.int64)
        ones = np.ones(n, np.float32)
        for table in (grown_table, loaded):
            table.admit(keys, ones, ones * 0, pass_id)
        assert loaded.candidate_count == grown_table.candidate_count
        # the per-candidate arrays (3 of them) have the same capacity either way
        assert loaded.nbytes - loaded._index.nbytes \
            == grown_table.nbytes - grown_table._index.nbytes, pass_id
