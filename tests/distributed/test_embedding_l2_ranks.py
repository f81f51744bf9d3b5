"""L2 on embedding rows on N ranks (in-process gloo ranks, ``ranks.run_ranks``).

``embedding_l2``: each requester adds the term for its own occurrences of a row and the
owner sums them; ``bucket_l2`` (the same on the bucketed numeric field's rows) is added
to the looked-up rows' gradient before they leave the requester. ``l2`` (every row,
every step): the owner decays its rows for the global steps that did not touch them.
Either way 2 ranks train the rows 1 process trains."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from ranks import run_ranks

from terarec.config import ModelConfig, SparseOptimizerConfig, TrainConfig
from terarec.distributed.context import DistContext
from terarec.train.trainer import Trainer
from terarec.types import Batch, FeatureSchema, FieldSpec, KeyedIds

SCHEMA = FeatureSchema(label="label", fields=(
    FieldSpec("x", "numeric", buckets=(0.3, 0.6)), FieldSpec("a", "categorical"),
    FieldSpec("b", "categorical")), missing_flags=False)
BATCH = 64


def _config(l2: float, knob: str) -> TrainConfig:
    return TrainConfig(batch_size=BATCH, pass_rows=4 * BATCH, threads=1, seed=5,
                       autocast="off",  # fp32: parity to float rounding (bf16 drifts)
                       model=ModelConfig(name="deepfm", embedding_dim=4),
                       sparse_optimizer=SparseOptimizerConfig(
                           name="adagrad", lr=0.2, **{"bucket_l2": 0.0, knob: l2}))


def _passes() -> list[list[Batch]]:
    """Two passes of 4 global batches; keys repeat within and across batches (a
    frequent key is pulled by L2 once per use)."""
    rng = np.random.default_rng(7)
    out = []
    for _ in range(2):
        batches = []
        for _ in range(4):
            keys = rng.zipf(1.5, size=(BATCH, 3)).astype(np.int64) % 300
            keys[:, 2] = 1000 + rng.integers(0, 3, BATCH)  # x's bucket (sparse slot 2)
            batches.append(Batch(torch.from_numpy(rng.random((BATCH, 1), np.float32)),
                                 KeyedIds.from_dense(SCHEMA.sparse_names,
                                                     torch.from_numpy(keys)),
                                 torch.from_numpy((rng.random(BATCH) < 0.3)
                                                  .astype(np.float32))))
        out.append(batches)
    return out


def _one_process(l2: float, knob: str) -> dict[str, np.ndarray]:
    torch.manual_seed(0)
    trainer = Trainer(SCHEMA, _config(l2, knob))
    for batches in _passes():
        trainer.train_pass(trainer.plan(batches))
    return trainer.store.to_arrays()


def _rank(ctx: DistContext, l2: float, knob: str) -> dict[str, np.ndarray]:
    torch.manual_seed(0)
    trainer = Trainer(SCHEMA, _config(l2, knob), ctx=ctx)
    local = BATCH // ctx.world
    for batches in _passes():  # rank r trains rows [r * local, (r + 1) * local) of a step
        trainer.train_pass(trainer.plan([b.slice(ctx.rank * local, (ctx.rank + 1) * local)
                                         for b in batches]))
    arrays = trainer.store.to_arrays()
    return {"keys": arrays["keys"], "values": arrays["values"], "state": arrays["state"]}


def _merged(parts: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    keys = np.concatenate([p["keys"] for p in parts])
    order = np.argsort(keys)
    return {name: np.concatenate([p[name] for p in parts])[order] for name in parts[0]}


@pytest.mark.slow
@pytest.mark.parametrize(("knob", "strength"), [("embedding_l2", 0.5), ("l2", 0.05),
                                                ("bucket_l2", 2.0)])
def test_embedding_l2_on_two_ranks_matches_one_process(knob: str, strength: float) -> None:
    want = _one_process(strength, knob)
    unregularised = _one_process(0.0, knob)
    got = _merged(run_ranks(_rank, 2, strength, knob))
    np.testing.assert_array_equal(got["keys"], want["keys"])
    np.testing.assert_allclose(got["values"], want["values"], atol=2e-5)
    np.testing.assert_allclose(got["state"], want["state"], atol=2e-5, rtol=1e-4)
    # the term matters: rows trained without it are far from these, and smaller norms
    # are what L2 gives
    assert np.abs(unregularised["values"] - want["values"]).max() > 1e-2
    rows = want["keys"] >= 1000 if knob == "bucket_l2" else slice(None)  # x's buckets
    assert np.linalg.norm(want["values"][rows]) < np.linalg.norm(unregularised["values"][rows])
