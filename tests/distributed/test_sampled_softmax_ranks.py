"""``--loss sampled_softmax`` on N ranks: every rank scores its clicked rows against the
clicked items of all ranks (gathered with their gradients), so 2 ranks train the two
towers and the rows that 1 process trains (in-process gloo ranks, ``ranks.run_ranks``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from ranks import run_ranks

from terarec.config import ModelConfig, SparseOptimizerConfig, StoreConfig, TrainConfig
from terarec.distributed.context import DistContext
from terarec.train.trainer import Trainer
from terarec.types import Batch, FeatureSchema, FieldSpec, KeyedIds

SCHEMA = FeatureSchema(label="label", fields=(
    FieldSpec("x", "numeric"), FieldSpec("user", "categorical"),
    FieldSpec("item", "categorical"), FieldSpec("topic", "categorical")),
    missing_flags=False)
BATCH = 64


def _config(admit_min_count: int = 1) -> TrainConfig:
    return TrainConfig(batch_size=BATCH, pass_rows=4 * BATCH, threads=1, seed=5,
                       loss="sampled_softmax",
                       store=StoreConfig(admit_min_count=admit_min_count),
                       model=ModelConfig(name="dssm", embedding_dim=4, deep_mlp=(8, 4),
                                         user_fields=("user",)),
                       sparse_optimizer=SparseOptimizerConfig(name="adagrad", lr=0.2))


def _passes() -> list[list[Batch]]:
    """Two passes of 4 global batches. Items repeat (a popular item is its own
    duplicate in a batch); one step has clicks only in its first half (rank 1 of 2 has
    none) and one step has no clicks at all."""
    rng = np.random.default_rng(3)
    out = []
    for p in range(2):
        batches = []
        for s in range(4):
            users = rng.integers(0, 50, BATCH)
            items = rng.zipf(1.6, BATCH) % 200
            keys = np.stack([users, 1000 + items, 5000 + items % 7], axis=1)
            labels = (rng.random(BATCH) < 0.4).astype(np.float32)
            if (p, s) == (0, 1):
                labels[BATCH // 2:] = 0.0
            if (p, s) == (1, 2):
                labels[:] = 0.0
            batches.append(Batch(torch.from_numpy(rng.random((BATCH, 1), np.float32)),
                                 KeyedIds.from_dense(SCHEMA.sparse_names,
                                                     torch.from_numpy(keys.astype(np.int64))),
                                 torch.from_numpy(labels)))
        out.append(batches)
    return out


def _result(trainer: Trainer, losses: list[float]) -> dict:
    arrays = trainer.store.to_arrays()
    return {"keys": arrays["keys"], "values": arrays["values"], "state": arrays["state"],
            "dense": {k: v.detach().clone() for k, v in trainer.model.state_dict().items()},
            "losses": losses}


def _one_process(admit_min_count: int) -> dict:
    torch.manual_seed(0)
    trainer = Trainer(SCHEMA, _config(admit_min_count))
    losses = [trainer.train_pass(trainer.plan(batches)).train_loss
              for batches in _passes()]
    return _result(trainer, losses)


def _rank(ctx: DistContext, admit_min_count: int) -> dict:
    torch.manual_seed(0)
    trainer = Trainer(SCHEMA, _config(admit_min_count), ctx=ctx)
    local = BATCH // ctx.world
    losses = [trainer.train_pass(trainer.plan([b.slice(ctx.rank * local,
                                                       (ctx.rank + 1) * local)
                                               for b in batches])).train_loss
              for batches in _passes()]  # rank r trains rows [r * local, (r + 1) * local)
    return _result(trainer, losses)


@pytest.mark.slow
@pytest.mark.parametrize("admit_min_count", [1, 2])
def test_sampled_softmax_on_two_ranks_matches_one_process(admit_min_count: int) -> None:
    """With admission, items whose keys have no row yet are still told apart by their
    keys (one process once took them for one item: the zero row's local id)."""
    want = _one_process(admit_min_count)
    parts = run_ranks(_rank, 2, admit_min_count)
    keys = np.concatenate([p["keys"] for p in parts])
    order = np.argsort(keys)
    np.testing.assert_array_equal(keys[order], want["keys"])
    for name in ("values", "state"):
        got = np.concatenate([p[name] for p in parts])[order]
        np.testing.assert_allclose(got, want[name], atol=2e-5, rtol=1e-4)
    for part in parts:  # DDP keeps the replicas equal; they equal the one process's
        for name, value in want["dense"].items():
            torch.testing.assert_close(part["dense"][name], value, atol=2e-5, rtol=1e-4)
        np.testing.assert_allclose(part["losses"], want["losses"], rtol=1e-5)
    # the towers trained: the rows moved away from their initial values
    assert np.abs(want["values"]).max() > 0.05
