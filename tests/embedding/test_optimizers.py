"""Sparse optimizer math against straightforward per-row reference implementations."""

import math

import numpy as np
import pytest
import torch

from terarec.config import SparseOptimizerConfig
from terarec.embedding.optimizers import SparseOptimizer


def reference_step(name, cfg, w, s, rows, grads):
    """Per-row Python reference: sum gradients of repeated rows, then update each row."""
    w, s = w.copy(), s.copy()
    dim = w.shape[1]
    summed = {}
    for r, g in zip(rows, grads, strict=True):
        if r == 0:
            continue
        summed[r] = summed.get(r, 0) + g.astype(np.float64)
    for r, g in summed.items():
        g = g + cfg.weight_decay * w[r]
        if name == "adagrad":
            s[r, 0] += float(np.mean(g * g))
            w[r] -= cfg.lr * g / (math.sqrt(s[r, 0]) + cfg.eps)
        elif name == "adam":
            s[r, 2 * dim] += 1
            t = s[r, 2 * dim]
            s[r, :dim] = cfg.beta1 * s[r, :dim] + (1 - cfg.beta1) * g
            s[r, dim:2 * dim] = cfg.beta2 * s[r, dim:2 * dim] + (1 - cfg.beta2) * g * g
            mhat = s[r, :dim] / (1 - cfg.beta1**t)
            vhat = s[r, dim:2 * dim] / (1 - cfg.beta2**t)
            w[r] -= cfg.lr * mhat / (np.sqrt(vhat) + cfg.eps)
        elif name == "ftrl":
            for d in range(dim):
                n_old = s[r, dim + d]
                n_new = n_old + g[d] ** 2
                sigma = (math.sqrt(n_new) - math.sqrt(n_old)) / cfg.ftrl_alpha
                s[r, d] += g[d] - sigma * w[r, d]
                s[r, dim + d] = n_new
                z = s[r, d]
                if abs(z) <= cfg.ftrl_l1:
                    w[r, d] = 0.0
                else:
                    w[r, d] = -(z - math.copysign(cfg.ftrl_l1, z)) / (
                        (cfg.ftrl_beta + math.sqrt(n_new)) / cfg.ftrl_alpha + cfg.ftrl_l2)
        else:
            w[r] -= cfg.lr * g
    return w, s


@pytest.mark.parametrize("name", ["adagrad", "adam", "ftrl", "sgd"])
@pytest.mark.parametrize("kernel", ["cpu", "torch"])
def test_matches_reference(name, kernel):
    rng = np.random.default_rng(1)
    cfg = SparseOptimizerConfig(name=name, lr=0.1, weight_decay=0.01, ftrl_l1=0.05,
                                ftrl_l2=0.1)
    opt = SparseOptimizer(cfg)
    dim, n_rows = 5, 12
    w = rng.normal(size=(n_rows, dim)).astype(np.float32)
    w[0] = 0
    s = opt.init_state(n_rows, dim)
    ref_w, ref_s = w.astype(np.float64), s.astype(np.float64)
    tw, ts = torch.from_numpy(w.copy()), torch.from_numpy(s.copy())
    for _ in range(4):
        rows = rng.integers(0, n_rows, 30)  # repeats and the zero row included
        grads = rng.normal(size=(30, dim)).astype(np.float32)
        ref_w, ref_s = reference_step(name, cfg, ref_w, ref_s, rows, grads)
        step = opt.step if kernel == "cpu" else opt.step_torch
        step(tw, ts, torch.from_numpy(rows), torch.from_numpy(grads))
    np.testing.assert_allclose(tw.numpy(), ref_w, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(ts.numpy(), ref_s, rtol=1e-4, atol=1e-5)
    assert not tw[0].any(), "the shared zero row must never move"


def test_untouched_rows_do_not_change():
    opt = SparseOptimizer(SparseOptimizerConfig(name="adam"))
    w = torch.randn(10, 4)
    s = torch.from_numpy(opt.init_state(10, 4))
    before = w.clone()
    opt.step(w, s, torch.tensor([2, 2, 5]), torch.ones(3, 4))
    changed = (w != before).any(dim=1).nonzero().flatten().tolist()
    assert changed == [2, 5]


def test_unknown_optimizer_is_rejected():
    with pytest.raises(ValueError, match="unknown sparse optimizer"):
        SparseOptimizer(SparseOptimizerConfig(name="rmsprop"))  # type: ignore[arg-type]
