"""Dropout, batch norm and embedding L2: present when asked, acting as they should."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from model_helpers import as_trained
from torch import nn

from terarec.config import ModelConfig, SparseOptimizerConfig, TrainConfig, from_dict
from terarec.embedding.optimizers import SparseOptimizer, slot_l2
from terarec.models import build_model
from terarec.models.layers import MLP
from terarec.train.trainer import Trainer
from terarec.types import Batch, FeatureSchema, FieldSpec, KeyedIds


def test_mlp_layers_follow_the_flags() -> None:
    plain = MLP(8, (16, 4), out_dim=1)
    assert not any(isinstance(m, (nn.Dropout, nn.BatchNorm1d)) for m in plain)
    full = MLP(8, (16, 4), dropout=0.5, out_dim=1, batch_norm=True)
    kinds = [type(m).__name__ for m in full]
    assert kinds == ["Linear", "BatchNorm", "ReLU", "Dropout"] * 2 + ["Linear"]
    with pytest.raises(ValueError, match="dropout"):
        MLP(8, (4,), dropout=1.0)


@pytest.mark.parametrize("name", ["widedeep", "deepfm", "dcnv2", "dlrm", "dssm"])
def test_every_mlp_model_takes_dropout_and_batch_norm(name: str) -> None:
    torch.manual_seed(0)
    config = ModelConfig(name=name, embedding_dim=4, dropout=0.5, batch_norm=True,
                         deep_mlp=(8, 4), bottom_mlp=(8, 4), top_mlp=(8,),
                         user_fields=("C1", "C2") if name == "dssm" else ())
    model = as_trained(build_model(FeatureSchema.criteo(), config))
    assert any(isinstance(m, nn.BatchNorm1d) for m in model.modules())
    dense = torch.randn(32, FeatureSchema.criteo().dense_dim)
    emb = torch.randn(32, 26, model.row_dim)
    model.train()
    assert not torch.equal(model(dense, emb), model(dense, emb))  # dropout is random
    model.eval()
    torch.testing.assert_close(model(dense, emb), model(dense, emb))
    single = model(dense[:1], emb[:1])  # batch norm in eval scores one row
    assert torch.isfinite(single).all()


def test_batch_norm_trains_on_a_one_row_batch_with_its_running_statistics() -> None:
    """A file's last batch may hold one row: it is normalised with the running
    statistics, which it leaves as they are; larger batches update them as usual."""
    torch.manual_seed(0)
    mlp = MLP(4, (3,), out_dim=1, batch_norm=True)
    norm = next(m for m in mlp if isinstance(m, nn.BatchNorm1d))
    mlp.train()
    mlp(torch.randn(16, 4)).sum().backward()
    mean, var = norm.running_mean.clone(), norm.running_var.clone()
    assert not torch.equal(mean, torch.zeros(3))  # a batch of 16 moved them
    out = mlp(torch.randn(1, 4))
    out.sum().backward()
    assert torch.isfinite(out).all() and norm.weight.grad is not None
    torch.testing.assert_close(norm.running_mean, mean, rtol=0, atol=0)
    torch.testing.assert_close(norm.running_var, var, rtol=0, atol=0)
    mlp.eval()
    x = torch.randn(1, 4)
    mlp.train()
    torch.testing.assert_close(mlp(x), mlp.eval()(x))  # what scoring gives that row


def _step(kernel: str, l2: float, batch_rows: int | None = 4):
    opt = SparseOptimizer(SparseOptimizerConfig(name="sgd", lr=0.5, embedding_l2=l2))
    weights = torch.tensor([[0.0, 0.0], [1.0, -2.0], [3.0, 4.0]])
    rows = torch.tensor([1, 1, 2, 0])
    grads = torch.zeros(4, 2)
    step = opt.step if kernel == "cpu" else opt.step_torch
    step(weights, torch.zeros(3, 0), rows, grads, batch_rows=batch_rows)
    return weights


@pytest.mark.parametrize("kernel", ["cpu", "torch"])
def test_embedding_l2_pulls_rows_by_use(kernel: str) -> None:
    w = _step(kernel, l2=1.0)
    # Row 1 is used twice in a 4-row batch: w -= 0.5 * 1.0 * 2/4 * w; row 2 once.
    torch.testing.assert_close(w[1], torch.tensor([0.75, -1.5]))
    torch.testing.assert_close(w[2], torch.tensor([3.0, 4.0]) * (1 - 0.5 / 4))
    assert (w[0] == 0).all()
    torch.testing.assert_close(_step(kernel, l2=0.0), torch.tensor(
        [[0.0, 0.0], [1.0, -2.0], [3.0, 4.0]]))


def test_embedding_l2_kernel_matches_reference_under_adagrad() -> None:
    rng = np.random.default_rng(1)
    config = SparseOptimizerConfig(name="adagrad", lr=0.1, embedding_l2=0.3)
    out = []
    for kernel in ("cpu", "torch"):
        opt = SparseOptimizer(config)
        w = torch.from_numpy(rng.standard_normal((6, 3)).astype(np.float32)) if not out \
            else out[0][1].clone()
        start = w.clone()
        s = torch.zeros(6, 1)
        rows = torch.tensor([1, 3, 3, 5, 1, 0])
        g = torch.from_numpy(np.arange(18, dtype=np.float32).reshape(6, 3) / 10)
        (opt.step if kernel == "cpu" else opt.step_torch)(w, s, rows, g, batch_rows=3)
        out.append((w, start))
    torch.testing.assert_close(out[0][0], out[1][0])


def test_embedding_l2_needs_the_batch_size() -> None:
    with pytest.raises(ValueError, match="batch size"):
        _step("cpu", l2=1.0, batch_rows=None)


def _bucketed_schema() -> FeatureSchema:
    """Two categorical fields and a numeric one cut into buckets (sparse slot 2)."""
    return FeatureSchema(label="y", fields=(
        FieldSpec("user", "categorical"),
        FieldSpec("count", "numeric", transform="log1p", buckets=(1.0, 2.0)),
        FieldSpec("item", "categorical")))


def test_bucket_l2_is_the_gradient_of_a_per_use_penalty_on_bucket_rows_only() -> None:
    schema = _bucketed_schema()
    opt = SparseOptimizer(SparseOptimizerConfig(bucket_l2=0.7))
    strength = opt.bucket_l2_slots(schema, "cpu")
    assert strength is not None and strength.tolist() == pytest.approx([0.0, 0.0, 0.7])
    torch.manual_seed(0)
    emb = torch.randn(5, 3, 4, requires_grad=True)
    target = torch.randn(5, 3, 4)
    (slot_l2(emb, strength, 1.0 / 5) * target).mean(dim=0).sum().backward()
    got = emb.grad.clone()
    emb.grad = None
    # the same as adding 0.7 / 2 * mean over the batch of ||e_count||^2 to the loss
    loss = (emb * target).mean(dim=0).sum() + 0.35 * emb[:, 2].square().sum(dim=1).mean()
    loss.backward()
    torch.testing.assert_close(got, emb.grad)
    torch.testing.assert_close(got[:, :2], target[:, :2] / 5)  # categorical: untouched
    assert not torch.allclose(got[:, 2], target[:, 2] / 5)
    scored = emb.detach()  # scoring: no gradient, the rows pass through as they are
    assert slot_l2(scored, strength, 0.2) is scored


def test_bucket_l2_applies_only_where_a_numeric_field_has_buckets() -> None:
    opt = SparseOptimizer(SparseOptimizerConfig(bucket_l2=1.0))
    plain = FeatureSchema(label="y", fields=(FieldSpec("a", "categorical"),
                                             FieldSpec("x", "numeric")))
    assert opt.bucket_l2_slots(plain, "cpu") is None
    off = SparseOptimizer(SparseOptimizerConfig(bucket_l2=0.0))
    assert off.bucket_l2_slots(_bucketed_schema(), "cpu") is None
    with pytest.raises(ValueError, match="bucket_l2"):
        from_dict(TrainConfig, {"sparse_optimizer": {"bucket_l2": -1.0}})


def test_a_trainer_with_bucket_l2_keeps_the_bucket_rows_smaller() -> None:
    schema = _bucketed_schema()
    rng = np.random.default_rng(3)
    batches = []
    for _ in range(6):
        keys = np.stack([rng.integers(1, 50, 64), rng.integers(100, 150, 64),
                         rng.integers(1000, 1003, 64)], axis=1)
        batches.append(Batch(torch.from_numpy(rng.random((64, schema.dense_dim),
                                                         np.float32)),
                             KeyedIds.from_dense(schema.sparse_names,
                                                 torch.from_numpy(keys)),
                             torch.from_numpy((rng.random(64) < 0.4).astype(np.float32))))
    norms = {}
    for strength in (0.0, 5.0):
        torch.manual_seed(0)
        trainer = Trainer(schema, TrainConfig(
            batch_size=64, threads=1, model=ModelConfig(name="fm", embedding_dim=4),
            sparse_optimizer=SparseOptimizerConfig(lr=0.3, bucket_l2=strength)))
        for _ in range(3):
            trainer.train_pass(trainer.plan(batches))
        arrays = trainer.store.to_arrays()
        norms[strength] = {part: float(np.linalg.norm(arrays["values"][sel]))
                           for part, sel in (("bucket", arrays["keys"] >= 1000),
                                             ("user", arrays["keys"] < 100))}
    assert norms[5.0]["bucket"] < 0.5 * norms[0.0]["bucket"]
    assert norms[5.0]["user"] > 0.5 * norms[0.0]["user"]  # the categorical rows train on
