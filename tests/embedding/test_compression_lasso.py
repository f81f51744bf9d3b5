"""Group lasso on embedding rows: the proximal step, both kernels, pruning of zero rows."""

import math

import numpy as np
import pytest
import torch

from terarec.config import ModelConfig, SparseOptimizerConfig, StoreConfig, TrainConfig
from terarec.embedding.optimizers import SparseOptimizer
from terarec.embedding.store import MemoryStore
from terarec.embedding.types import RowBlock
from terarec.train.trainer import Trainer
from terarec.types import Batch, FeatureSchema, FieldSpec, KeyedIds


def reference(name, cfg, w, s, rows, grads):
    """Per-row float64 reference: optimizer step, then w *= max(0, 1 - step*lambda/||w||)."""
    w, s = w.astype(np.float64).copy(), s.astype(np.float64).copy()
    summed = {}
    for r, g in zip(rows, grads, strict=True):
        if r:
            summed[r] = summed.get(r, 0) + g.astype(np.float64)
    for r, g in summed.items():
        if name == "adagrad":
            s[r, 0] += float(np.mean(g * g))
            step = cfg.lr / (math.sqrt(s[r, 0]) + cfg.eps)
        else:
            step = cfg.lr
        w[r] -= step * g
        norm = np.linalg.norm(w[r])
        w[r] *= max(0.0, 1 - step * cfg.group_lasso / norm) if norm > 0 else 0.0
    return w, s


@pytest.mark.parametrize("name", ["adagrad", "sgd"])
@pytest.mark.parametrize("kernel", ["cpu", "torch"])
def test_group_lasso_step_matches_reference_and_zeroes_whole_rows(name, kernel):
    rng = np.random.default_rng(0)
    cfg = SparseOptimizerConfig(name=name, lr=0.1, group_lasso=0.5)
    opt = SparseOptimizer(cfg)
    n, dim = 10, 4
    scale = np.where(np.arange(n) % 2 == 0, 1e-3, 1.0)[:, None]  # even rows short: pruned
    w = (rng.normal(size=(n, dim)) * scale).astype(np.float32)
    w[0] = 0
    s = opt.init_state(n, dim)
    rows = np.arange(1, n)
    grads = (rng.normal(size=(n - 1, dim)) * 0.1).astype(np.float32)
    ref_w, ref_s = reference(name, cfg, w, s, rows, grads)
    tw, ts = torch.from_numpy(w.copy()), torch.from_numpy(s.copy())
    step = opt.step if kernel == "cpu" else opt.step_torch
    step(tw, ts, torch.from_numpy(rows), torch.from_numpy(grads))
    np.testing.assert_allclose(tw.numpy(), ref_w, rtol=1e-4, atol=1e-6)
    zero = ~tw.numpy().any(axis=1)
    assert zero[2::2].all() and not zero[1::2].any()  # short rows exactly zero, long ones not


def test_group_lasso_rejects_ftrl_and_negative_strength():
    with pytest.raises(ValueError, match="ftrl"):
        SparseOptimizer(SparseOptimizerConfig(name="ftrl", group_lasso=0.1))
    with pytest.raises(ValueError, match=">= 0"):
        SparseOptimizer(SparseOptimizerConfig(group_lasso=-1.0))


@pytest.mark.parametrize("precision", ["fp32", "int8"])
def test_store_prunes_exactly_the_zero_rows_at_pass_end(precision):
    store = MemoryStore(4, SparseOptimizer(SparseOptimizerConfig(group_lasso=0.1)),
                        StoreConfig(precision=precision), seed=0)
    keys = np.arange(1, 11, dtype=np.int64)
    block, _ = store.pull(keys, np.ones(10, np.float32), np.zeros(10, np.float32), 0)
    values = block.values.copy()
    values[[1, 4, 7]] = 0
    values[5] = [0, 0, 0, 1e-6]  # tiny but not zero: kept
    store.push(keys, RowBlock(values, block.state))
    assert store.end_pass(0) == 3
    assert sorted(store.to_arrays()["keys"].tolist()) == [1, 3, 4, 6, 7, 9, 10]
    assert store.stats().pruned == 3
    # rows not seen in the pass are not scanned (they cannot have changed)
    store.push(np.array([1], np.int64), RowBlock(np.zeros((1, 4), np.float32), block.state[:1]))
    store.pull(np.array([3], np.int64), np.ones(1, np.float32), np.zeros(1, np.float32), 1)
    assert store.end_pass(1) == 0 and len(store) == 7
    assert store.prune_zero_rows() == 1 and len(store) == 6


def test_training_with_group_lasso_prunes_rare_rows_and_keeps_the_rest_nonzero():
    schema = FeatureSchema(label="y", fields=(FieldSpec("a", "categorical"),
                                              FieldSpec("b", "categorical")),
                           missing_flags=False)
    rng = np.random.default_rng(0)

    def passes(group_lasso):
        config = TrainConfig(batch_size=64, seed=0,
                             model=ModelConfig(name="fm", embedding_dim=4),
                             sparse_optimizer=SparseOptimizerConfig(
                                 lr=0.05, group_lasso=group_lasso,
                                 initial_accumulator=0.0))  # full first steps: rare rows grow
        trainer = Trainer(schema, config)
        for _ in range(3):
            hot = rng.integers(0, 20, 256)  # informative, frequent
            rare = rng.integers(1000, 10**6, 256)  # noise, seen about once
            ids = torch.from_numpy(np.stack([hot, rare], axis=1))
            labels = torch.from_numpy((hot % 2).astype(np.float32))
            batch = Batch(torch.zeros(256, 0), KeyedIds.from_dense(("a", "b"), ids), labels)
            trainer.train_pass(trainer.plan([batch.slice(i, i + 64)
                                             for i in range(0, 256, 64)]))
        return trainer.store

    plain, lasso = passes(0.0), passes(0.02)
    assert plain.stats().pruned == 0
    pruned = lasso.stats().pruned
    assert pruned > 0.5 * lasso.stats().admitted
    live = lasso.to_arrays()
    assert live["values"].any(axis=1).all()  # every kept row is nonzero
    hot_keys = np.arange(20)
    assert (lasso.index.lookup(hot_keys) >= 0).mean() > 0.9  # frequent rows survive
