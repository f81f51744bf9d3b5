"""``l2``: L2 on every row at every step, applied lazily, against an eager reference
that decays every row at every step."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from terarec.config import SparseOptimizerConfig
from terarec.embedding.optimizers import LazyL2, SparseOptimizer


def eager_steps(cfg: SparseOptimizerConfig, w: np.ndarray, s: np.ndarray,
                steps: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """Every step, every row takes l2's proximal step at its step size; touched rows
    take their summed gradient's update first."""
    w, s = w.astype(np.float64), s.astype(np.float64)
    for rows, grads in steps:
        summed: dict[int, np.ndarray] = {}
        for r, g in zip(rows, grads, strict=True):
            if r:
                summed[int(r)] = summed.get(int(r), 0) + g.astype(np.float64)
        for r in range(1, len(w)):
            rate = (cfg.lr / (np.sqrt(s[r, 0]) + cfg.eps) if cfg.name == "adagrad"
                    else cfg.lr)
            if r in summed:
                g = summed[r]
                if cfg.name == "adagrad":
                    s[r, 0] += float(np.mean(g * g))
                    rate = cfg.lr / (np.sqrt(s[r, 0]) + cfg.eps)
                w[r] -= rate * g
            w[r] /= 1.0 + rate * cfg.l2
    return w, s


@pytest.mark.parametrize("name", ["adagrad", "sgd"])
@pytest.mark.parametrize("kernel", ["cpu", "torch"])
def test_lazy_decay_equals_decaying_every_row_at_every_step(name: str, kernel: str) -> None:
    rng = np.random.default_rng(3)
    cfg = SparseOptimizerConfig(name=name, lr=0.1, l2=0.3, initial_accumulator=0.01)
    opt = SparseOptimizer(cfg)
    n_rows, dim = 20, 4
    w = rng.normal(size=(n_rows, dim)).astype(np.float32)
    w[0] = 0
    s = opt.init_state(n_rows, dim)
    # rows 1-5 every step, the rest now and then: most rows miss most steps
    steps = [(np.concatenate([np.arange(6), rng.integers(0, n_rows, 3)]),
              rng.normal(size=(9, dim)).astype(np.float32)) for _ in range(12)]
    want_w, want_s = eager_steps(cfg, w, s, steps)
    tw, ts = torch.from_numpy(w.copy()), torch.from_numpy(s.copy())
    lazy = opt.lazy_l2(n_rows, "cpu")
    assert isinstance(lazy, LazyL2)
    for i, (rows, grads) in enumerate(steps):
        if kernel == "cpu":
            opt.step(tw, ts, torch.from_numpy(rows), torch.from_numpy(grads), lazy=lazy,
                     step_index=i)
        else:
            opt.step_torch(tw, ts, torch.from_numpy(rows), torch.from_numpy(grads),
                           lazy=lazy, step_index=i)
    opt.catch_up(tw, ts, lazy, len(steps))
    np.testing.assert_allclose(tw.numpy(), want_w, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(ts.numpy(), want_s, rtol=1e-4, atol=1e-6)
    assert not tw[0].any(), "the shared zero row must never move"
    # a second catch-up at the same step changes nothing
    before = tw.clone()
    opt.catch_up(tw, ts, lazy, len(steps))
    torch.testing.assert_close(tw, before)


def test_a_rare_row_shrinks_more_than_with_per_touch_decay() -> None:
    """The point of ``l2``: a row touched once in a pass is pulled toward zero at every
    step of the pass, which weight decay (per touch) does not do."""
    w0 = torch.ones(2, 3)
    w0[0] = 0
    grads = torch.zeros(1, 3)
    out = {}
    for knob in ("l2", "weight_decay"):
        opt = SparseOptimizer(SparseOptimizerConfig(name="sgd", lr=0.1, **{knob: 0.1}))
        w, s = w0.clone(), torch.zeros(2, 0)
        lazy = opt.lazy_l2(2, "cpu")
        opt.step(w, s, torch.tensor([1]), grads, lazy=lazy, step_index=0)
        for i in range(1, 50):  # steps that touch only the zero row
            opt.step(w, s, torch.tensor([0]), grads, lazy=lazy, step_index=i)
        opt.catch_up(w, s, lazy, 50)
        out[knob] = float(w[1, 0])
    assert out["weight_decay"] == pytest.approx(0.99)
    assert out["l2"] == pytest.approx(1.01 ** -50, rel=1e-4)


@pytest.mark.parametrize("kernel", ["cpu", "torch"])
def test_a_step_size_far_past_one_over_l2_shrinks_without_flipping(kernel: str) -> None:
    """Adagrad from a start of 0 gives a rarely seen row a huge step size; l2's proximal
    step still only shrinks it (``1 - step * l2`` would flip and grow it)."""
    opt = SparseOptimizer(SparseOptimizerConfig(name="sgd", lr=50.0, l2=1.0))
    w, s = torch.ones(2, 2), torch.zeros(2, 0)
    lazy = opt.lazy_l2(2, "cpu")
    step = opt.step if kernel == "cpu" else opt.step_torch
    step(w, s, torch.tensor([1]), torch.zeros(1, 2), lazy=lazy, step_index=2)
    opt.catch_up(w, s, lazy, 5)
    assert torch.isfinite(w).all()
    assert 0.0 < float(w[1, 0]) < 1e-6


@pytest.mark.parametrize(("name", "hint"), [("adam", "weight_decay"), ("ftrl", "ftrl_l2")])
def test_l2_is_refused_where_it_has_no_meaning(name: str, hint: str) -> None:
    with pytest.raises(ValueError, match=f"l2 .*adagrad and sgd.*{hint}"):
        SparseOptimizer(SparseOptimizerConfig(name=name, l2=0.1))


def test_without_l2_there_is_no_bookkeeping() -> None:
    assert SparseOptimizer(SparseOptimizerConfig()).lazy_l2(10, "cpu") is None


def test_the_tiered_store_trains_the_rows_the_memory_store_trains(tmp_path) -> None:
    """Rows come back to a store after their pass's catch-up: one with most rows in its
    disk tier ends with the rows the all-in-RAM store ends with."""
    from dataclasses import replace

    from terarec.config import ModelConfig, TrainConfig
    from terarec.train.trainer import Trainer
    from terarec.types import Batch, FeatureSchema, FieldSpec, KeyedIds

    schema = FeatureSchema(label="label", fields=(
        FieldSpec("x", "numeric"), FieldSpec("a", "categorical"),
        FieldSpec("b", "categorical")), missing_flags=False)
    rng = np.random.default_rng(2)
    passes = [[Batch(torch.from_numpy(rng.random((64, 1), np.float32)),
                     KeyedIds.from_dense(schema.sparse_names, torch.from_numpy(
                         rng.zipf(1.3, size=(64, 2)).astype(np.int64) % 2000)),
                     torch.from_numpy((rng.random(64) < 0.3).astype(np.float32)))
               for _ in range(4)] for _ in range(3)]
    base = TrainConfig(batch_size=64, pass_rows=256, threads=1, seed=5,
                       model=ModelConfig(name="lr"),
                       sparse_optimizer=SparseOptimizerConfig(lr=0.2, l2=0.05))
    out = {}
    for name, store in (("ram", base.store),
                        ("tiered", replace(base.store, memory_budget="40KB",
                                           disk_path=str(tmp_path / "disk")))):
        torch.manual_seed(0)
        trainer = Trainer(schema, replace(base, store=store))
        for batches in passes:
            trainer.train_pass(trainer.plan(batches))
        out[name] = trainer.store.to_arrays()
        if name == "tiered":
            tiers = trainer.store.tier_stats()
            assert len(trainer.store) > tiers.memory_keys > 0  # most rows only on disk
    np.testing.assert_array_equal(out["tiered"]["keys"], out["ram"]["keys"])
    np.testing.assert_allclose(out["tiered"]["values"], out["ram"]["values"], atol=1e-6)
