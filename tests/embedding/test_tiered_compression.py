"""TieredStore with compressed rows: the same rows as MemoryStore with the same settings,
encoded records on disk, variable-length rows, group-lasso pruning in both tiers."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from terarec.cli.main import main as cli_main
from terarec.config import SparseOptimizerConfig, StoreConfig
from terarec.data.readers import iter_batches
from terarec.data.synth import generate
from terarec.embedding.disk import RESERVE_BYTES
from terarec.embedding.optimizers import SparseOptimizer
from terarec.embedding.quant import row_bytes
from terarec.embedding.store import MemoryStore
from terarec.embedding.tiered import TieredStore, snapshot_arrays
from terarec.embedding.types import RowBlock
from terarec.modeldir import load_checkpoint
from terarec.serving.engine import ServingEngine
from terarec.train.trainer import Trainer

ROW_DIM = 32


def _stores(tmp_path, budget=1_800_000, opt=None, **store_kw):
    optimizer = opt or SparseOptimizer(SparseOptimizerConfig())
    mem = MemoryStore(ROW_DIM, optimizer, StoreConfig(**store_kw), seed=3)
    tiered = TieredStore(ROW_DIM, optimizer, StoreConfig(memory_budget=budget, **store_kw),
                         seed=3, path=tmp_path / "store")
    return mem, tiered


def _plan(passes, seed=0):
    rng = np.random.default_rng(seed)
    return [np.unique(np.concatenate([rng.zipf(1.3, 3000) % 20_000,
                                      rng.integers(0, 100_000, 3000)]) * 7919 + 11)
            for _ in range(passes)]


def _run_passes(store, plan, prefetch=False, widths=None):
    """Passes with a deterministic key-dependent 'training' update; ``widths`` collects
    the widths each pull returned, per pass."""
    rng = np.random.default_rng(1)
    for pass_id, keys in enumerate(plan):
        keys = rng.permutation(keys)
        show = (keys % 3 + 1).astype(np.float32)
        block, admitted = store.pull(keys, show, (keys % 2).astype(np.float32), pass_id)
        if widths is not None:
            order = np.argsort(keys[admitted])
            widths.append(None if block.widths is None else block.widths[order])
        if prefetch and pass_id + 1 < len(plan):
            store.prefetch(plan[pass_id + 1])
        k = keys[admitted]
        values = block.values * 0.5 + (k % 101)[:, None].astype(np.float32) / 100
        if block.widths is not None:  # training keeps the columns past a row's width zero
            values[np.arange(ROW_DIM) >= block.widths[:, None]] = 0
        store.push(k, RowBlock(values, block.state + 1.0))
        store.end_pass(pass_id)


def _assert_same(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


@pytest.mark.parametrize("precision", ["fp16", "int8", "int4"])
def test_compressed_tiered_store_matches_the_memory_store(tmp_path, precision):
    mem, tiered = _stores(tmp_path, precision=precision)
    plan = _plan(6)
    _run_passes(mem, plan)
    _run_passes(tiered, plan, prefetch=True)
    stats = tiered.tier_stats()
    assert stats.spilled > 0 and stats.loaded > 0 and stats.prefetched > 0
    assert stats.memory_keys <= stats.memory_capacity < len(tiered)
    # Rows move between the tiers as bytes, never re-encoded: equal, not just close.
    _assert_same(mem.to_arrays(), tiered.to_arrays())
    keys = np.concatenate([plan[-1][:500], np.array([5, 6], np.int64)])
    for got, want in zip(tiered.lookup(keys), mem.lookup(keys), strict=True):
        np.testing.assert_array_equal(got, want)
    for got, want in zip(tiered.changed_since(4), mem.changed_since(4), strict=True):
        np.testing.assert_array_equal(got, want)
    assert tiered.stats().keys == len(mem)


def test_encoded_rows_stay_within_the_quantisation_bound_of_fp32(tmp_path):
    opt = SparseOptimizer(SparseOptimizerConfig())
    fp32 = MemoryStore(ROW_DIM, opt, StoreConfig(), seed=3)
    tiered = TieredStore(ROW_DIM, opt, StoreConfig(memory_budget="3MB", precision="int8"),
                         seed=3, path=tmp_path / "store")
    plan = _plan(3)
    _run_passes(fp32, plan)
    _run_passes(tiered, plan)
    a, b = fp32.to_arrays(), tiered.to_arrays()
    np.testing.assert_array_equal(a["keys"], b["keys"])
    # each pass halves the row and re-encodes it: errors of earlier passes shrink
    span = a["values"].max(axis=1) - a["values"].min(axis=1)
    err = np.abs(a["values"] - b["values"]).max(axis=1)
    assert (err <= span / 255 + 1e-6).all() and err.max() > 0


@pytest.mark.parametrize("precision", ["int8", "int4"])
def test_disk_records_hold_encoded_rows(tmp_path, precision):
    opt = SparseOptimizer(SparseOptimizerConfig())
    stores = {p: TieredStore(ROW_DIM, opt, StoreConfig(memory_budget="3MB", precision=p),
                             path=tmp_path / p) for p in ("fp32", precision)}
    for store in stores.values():
        _run_passes(store, _plan(2))
        store.flush()
    plain, coded = stores["fp32"], stores[precision]
    state_and_counts = 4 * (plain.state_dim + 3)
    assert 4 * plain.width == 4 * ROW_DIM + state_and_counts
    value_bytes = row_bytes(precision, ROW_DIM)
    assert 4 * coded.width == -(-value_bytes // 4) * 4 + state_and_counts
    assert coded.width < plain.width / 2
    def used(store):  # slab blocks are allocated for the records, and RESERVE_BYTES ahead
        allocated = sum(f.stat().st_blocks * 512 for f in store.disk.path.glob("slab-*.bin"))
        return allocated - RESERVE_BYTES

    assert used(coded) < used(plain) / 2
    # and the budget holds more hot rows when they are smaller
    assert coded.memory_capacity() > 1.4 * plain.memory_capacity()
    # hot rows count their codes, rows only on disk their record's value area
    assert len(coded) * value_bytes <= coded.stats().value_bytes \
        <= len(coded) * -(-value_bytes // 4) * 4


VARLEN = dict(precision="int8", variable_dims=(4, 16), promote_at=(3.0, 6.0))


def test_variable_length_rows_across_tiers_match_the_memory_store(tmp_path):
    mem, tiered = _stores(tmp_path, **VARLEN)
    plan = _plan(6)
    mem_widths, tiered_widths = [], []
    _run_passes(mem, plan, widths=mem_widths)
    _run_passes(tiered, plan, prefetch=True, widths=tiered_widths)
    assert tiered.tier_stats().spilled > 0 and tiered.tier_stats().loaded > 0
    for want, got in zip(mem_widths, tiered_widths, strict=True):
        np.testing.assert_array_equal(got, want)
    assert set(np.concatenate(tiered_widths).tolist()) == {4, 16, ROW_DIM}
    _assert_same(mem.to_arrays(), tiered.to_arrays())


@pytest.mark.parametrize("hot", [False, True])
def test_promotion_from_either_tier_keeps_the_decoded_row(tmp_path, hot):
    _, tiered = _stores(tmp_path, budget="6MB", **VARLEN)
    keys = np.arange(1, 40_001, dtype=np.int64)
    ones = np.ones(len(keys), np.float32)
    block, _ = tiered.pull(keys, ones, ones * 0, 0)
    assert (block.widths == 4).all()
    tiered.push(keys, RowBlock(block.values + 0.25 * (block.values != 0), block.state))
    tiered.end_pass(0)
    in_memory = tiered.memory.index.lookup(keys) >= 0
    assert in_memory.any() and not in_memory.all()
    probe = keys[in_memory if hot else ~in_memory][:100]
    stored, _ = tiered.lookup(probe)
    assert (stored[:, 4:] == 0).all() and (stored[:, :4] != 0).all()
    # 2 + 1 shows: the keys reach the 16-wide class as this pull counts them
    block, _ = tiered.pull(probe, np.full(len(probe), 2, np.float32),
                           np.zeros(len(probe), np.float32), 1)
    assert (block.widths == 16).all()
    np.testing.assert_array_equal(block.values, stored)
    now, _ = tiered.lookup(probe)
    np.testing.assert_allclose(now, stored, rtol=0, atol=np.abs(stored).max() / 127)
    grown = block.values.copy()
    grown[:, 4:16] = 0.5
    tiered.push(probe, RowBlock(grown, block.state))
    tiered.end_pass(1)
    after, _ = tiered.lookup(probe)
    np.testing.assert_allclose(after[:, :16], grown[:, :16], rtol=0, atol=1 / 127)
    assert (after[:, 16:] == 0).all()


def test_group_lasso_prunes_exactly_the_zero_rows_of_both_tiers(tmp_path):
    opt = SparseOptimizer(SparseOptimizerConfig(group_lasso=0.1))
    mem, tiered = _stores(tmp_path, budget="6MB", opt=opt, precision="int8")
    for store in (mem, tiered):
        store.track_evictions()
    keys = np.arange(1, 40_001, dtype=np.int64)
    ones = np.ones(len(keys), np.float32)
    zero = (keys % 7 == 0) | (keys % 11 == 0)
    for store in (mem, tiered):
        block, _ = store.pull(keys, ones, ones * 0, 0)
        values = block.values.copy()
        values[zero] = 0
        values[keys % 13 == 0, 1:] = 0  # partly zero: kept
        store.push(keys, RowBlock(values, block.state))
    in_memory = tiered.memory.index.lookup(keys[zero]) >= 0
    assert in_memory.any() and not in_memory.all()  # zero rows in both tiers
    assert tiered.end_pass(0) == mem.end_pass(0) == int(zero.sum())
    assert tiered.stats().pruned == tiered.stats().evicted == int(zero.sum())
    np.testing.assert_array_equal(tiered.take_evicted(), keys[zero])
    assert len(tiered) == int((~zero).sum())
    assert not tiered.disk.contains(keys[zero]).any()
    assert (tiered.memory.index.lookup(keys[zero]) < 0).all()
    _assert_same(mem.to_arrays(), tiered.to_arrays())
    # a zero row not seen in the pass is left alone, as in the memory store
    survivor = keys[~zero][:1]
    row = np.zeros((1, ROW_DIM), np.float32)
    for store in (mem, tiered):
        store.push(survivor, RowBlock(row, np.zeros((1, store.state_dim), np.float32)))
        assert store.end_pass(1) == 0
    # the pruned total survives a checkpoint, whichever store writes or reads it
    tiered.save_snapshot(tmp_path / "snap")
    restored = TieredStore(ROW_DIM, opt, StoreConfig(memory_budget="6MB", precision="int8"),
                           seed=3, path=tmp_path / "restored")
    restored.load_snapshot(tmp_path / "snap")
    from_snapshot = MemoryStore(ROW_DIM, opt, StoreConfig(precision="int8"), seed=3)
    from_snapshot.load_arrays(snapshot_arrays(tmp_path / "snap", ROW_DIM, tiered.state_dim))
    from_memory = MemoryStore(ROW_DIM, opt, StoreConfig(precision="int8"), seed=3)
    from_memory.load_arrays(mem.to_arrays())
    for store in (restored, from_snapshot, from_memory):
        assert store.stats().pruned == int(zero.sum())


@pytest.mark.parametrize("config", [dict(precision="int4"), VARLEN])
def test_snapshot_round_trip_and_a_mismatching_store_is_refused(tmp_path, config):
    _, tiered = _stores(tmp_path, **config)
    _run_passes(tiered, _plan(3))
    before = tiered.to_arrays()
    tiered.save_snapshot(tmp_path / "snap")
    other = TieredStore(ROW_DIM, tiered.optimizer, StoreConfig(memory_budget="3MB", **config),
                        seed=3, path=tmp_path / "other")
    other.load_snapshot(tmp_path / "snap")
    _assert_same(before, other.to_arrays())
    decoded = snapshot_arrays(tmp_path / "snap", ROW_DIM, tiered.state_dim)
    _assert_same({k: v for k, v in before.items() if k != "counters"},
                 {k: v for k, v in decoded.items() if k != "counters"})
    # an in-memory store re-encodes the decoded rows: within a quantisation step
    mem = MemoryStore(ROW_DIM, tiered.optimizer, StoreConfig(**config), seed=3)
    mem.load_arrays(decoded)
    step = np.ptp(before["values"], axis=1, keepdims=True) / 15
    assert (np.abs(mem.to_arrays()["values"] - before["values"]) <= step + 1e-6).all()
    for wrong in (StoreConfig(memory_budget="3MB"),
                  StoreConfig(memory_budget="3MB", precision="fp16")):
        store = TieredStore(ROW_DIM, tiered.optimizer, wrong, path=tmp_path / "wrong")
        with pytest.raises(ValueError, match="the snapshot holds"):
            store.load_snapshot(tmp_path / "snap")
        store.close()


def test_cli_trains_checkpoints_and_exports_a_compressed_tiered_model(tmp_path, capsys):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        generate(tmp_path / "train.tsv", 3000, model_seed=0, sample_seed=5,
                 vocab_scale=0.02)
        generate(tmp_path / "test.tsv", 500, model_seed=0, sample_seed=6, vocab_scale=0.02)
        args = ["train", "--train", str(tmp_path / "train.tsv"), "--model", "deepfm",
                "--embedding-dim", "8", "--pass-rows", "1000", "--batch-size", "250",
                "--threads", "1", "--no-progress", "--precision", "int8",
                "--variable-dims", "1,4", "--promote-at", "2,4", "--group-lasso", "1e-3",
                "--admit-min-count", "1",  # every key a row: more than the budget holds
                "--valid-split", "0"]  # the last pass scored in the live store
        model, uri = tmp_path / "model", tmp_path / "export"
        assert cli_main([*args, "--out", str(model), "--memory-budget", "1000KB",
                         "--export-to", str(uri)]) == 0
        assert cli_main([*args, "--out", str(tmp_path / "in-memory")]) == 0
        metrics = json.loads((model / "metrics.json").read_text())
        reference = json.loads((tmp_path / "in-memory" / "metrics.json").read_text())
        # the same rows, pruned keys and scores as the in-memory store with these settings
        for name in ("auc", "logloss", "store_keys", "pruned_keys"):
            assert metrics[name] == reference[name], name
        assert metrics["pruned_keys"] > 0 and metrics["store_keys"] > 0
        assert metrics["store_bytes_per_key"] < 4 * 9 / 2  # encoded rows, not fp32
        ckpt = load_checkpoint(model)
        meta = ckpt.meta["store"]
        assert ckpt.tiered and 0 < meta["tiers"]["memory_keys"] < meta["keys"]
        trainer = Trainer.from_checkpoint(model)
        assert trainer.store.layout.precisions == ("fp16", "fp16", "int8")
        batch = next(iter(iter_batches(tmp_path / "test.tsv", trainer.schema, 500)))
        offline = trainer.predict_batches([batch])
        engine = ServingEngine(uri)
        assert engine.refresh()
        np.testing.assert_allclose(engine.score_batch(batch), offline, rtol=0, atol=1e-6)
        capsys.readouterr()
        assert cli_main(["inspect", str(model), "--json"]) == 0
        info = json.loads(capsys.readouterr().out)
        assert info["keys"] == meta["keys"] == len(ckpt.sparse["keys"])
        assert sum(info["show_histogram"].values()) == info["keys"]
    finally:
        torch.set_num_threads(threads)


def test_snapshots_without_a_layout_read_as_fp32_records(tmp_path):
    from terarec.embedding.disk import DiskTier, read_snapshot_rows, record_width

    disk = DiskTier(tmp_path / "d", record_width(4, 1))  # as written before layouts
    rec = np.arange(5 * 8, dtype=np.float32).reshape(5, 8)
    rec[:, -1] = np.arange(5, dtype=np.int32).view(np.float32)
    disk.write(np.arange(10, 15, dtype=np.int64), rec)
    disk.snapshot(tmp_path / "snap", None, {})
    [(keys, cols)] = list(read_snapshot_rows(tmp_path / "snap", row_dim=4))
    order = np.argsort(keys)
    np.testing.assert_array_equal(cols["values"][order], rec[:, :4])
    np.testing.assert_array_equal(cols["show"][order], rec[:, 5])
    np.testing.assert_array_equal(cols["last_seen"][order], np.arange(5))
    with pytest.raises(ValueError, match="expected rows of 4 with 2 optimizer"):
        list(read_snapshot_rows(tmp_path / "snap", row_dim=4, state_dim=2))
