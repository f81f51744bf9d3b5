"""Admission and eviction on 2 ranks (in-process gloo ranks): each owner decides for its
own keys, so the union of the shards is the single-process store; a capacity target is
split between the ranks."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from ranks import run_ranks

from terarec.config import ModelConfig, SparseOptimizerConfig, StoreConfig, TrainConfig
from terarec.distributed.context import DistContext
from terarec.distributed.sharding import deal_batches
from terarec.train.trainer import Trainer
from terarec.types import Batch, FeatureSchema, FieldSpec, KeyedIds

SCHEMA = FeatureSchema(label="label", fields=(
    FieldSpec("x", "numeric"), FieldSpec("a", "categorical"), FieldSpec("b", "categorical")),
    missing_flags=False)
LOCAL = 64  # rows of a local batch; a global step is 2 of them


def _config(store: dict) -> TrainConfig:
    # Full first steps: rows clear the L2 eviction bar the policies are set against.
    return TrainConfig(batch_size=2 * LOCAL, pass_rows=4 * LOCAL, threads=1, seed=3,
                       autocast="off",  # fp32: parity to float rounding (bf16 drifts)
                       model=ModelConfig(name="deepfm", embedding_dim=4),
                       sparse_optimizer=SparseOptimizerConfig(initial_accumulator=0.0),
                       store=StoreConfig(**store))


def _local_batches(seed: int, n: int = 4) -> list[Batch]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        keys = (rng.zipf(1.1, size=(LOCAL, 2)) % 3000).astype(np.int64)
        out.append(Batch(torch.from_numpy(rng.random((LOCAL, 1), np.float32)),
                         KeyedIds.from_dense(SCHEMA.sparse_names, torch.from_numpy(keys)),
                         torch.from_numpy((rng.random(LOCAL) < 0.3).astype(np.float32))))
    return out


PASSES = 4


def _train_rank(ctx: DistContext, store: dict) -> tuple[dict, list[dict]]:
    trainer = Trainer(SCHEMA, _config(store), ctx=ctx)
    results = [trainer.train_pass(trainer.plan(
        deal_batches(_local_batches(seed), ctx.rank, ctx.world))).as_dict()
        for seed in range(PASSES)]
    return trainer.store.to_arrays(), results


def _train_single(store: dict) -> tuple[dict, list]:
    trainer = Trainer(SCHEMA, _config(store))
    results = []
    for seed in range(PASSES):
        local = _local_batches(seed)
        results.append(trainer.train_pass(trainer.plan(
            [Batch.concat(local[i:i + 2]) for i in range(0, len(local), 2)])).as_dict())
    return trainer.store.to_arrays(), results


@pytest.mark.parametrize("store", [
    {"admit_min_count": 2, "admit_sketch_bytes": "1MB", "evict_show_below": 2,
     "evict_after_passes": 2},
    {"admit_probability": 0.5, "evict_l2_below": 0.03},
])
def test_two_ranks_admit_and_evict_the_keys_one_process_does(store):
    one, results = _train_single(store)
    ranks = run_ranks(_train_rank, 2, store)
    keys = np.concatenate([r[0]["keys"] for r in ranks])
    order = np.argsort(keys)
    assert len(one["keys"]) > 100
    np.testing.assert_array_equal(keys[order], one["keys"])
    for name in ("show", "click", "last_seen"):
        got = np.concatenate([r[0][name] for r in ranks])[order]
        np.testing.assert_array_equal(got, one[name], err_msg=name)
    values = np.concatenate([r[0]["values"] for r in ranks])[order]
    np.testing.assert_allclose(values, one["values"], atol=2e-5)
    counts = ("new_keys", "rejected_keys", "evicted_keys", "store_keys")
    for rank in ranks:  # pass figures are summed over the ranks
        assert [[r[k] for k in counts] for r in rank[1]] == \
            [[r[k] for k in counts] for r in results]
    assert sum(r["rejected_keys"] for r in results) > 0
    assert sum(r["evicted_keys"] for r in results) > 0


def test_a_capacity_target_is_split_between_the_ranks():
    store = {"max_keys": 300, "evict_score": "lru"}
    one, _ = _train_single(store)
    ranks = run_ranks(_train_rank, 2, store)
    sizes = [len(r[0]["keys"]) for r in ranks]
    assert len(one["keys"]) == 300
    assert sizes == [150, 150]
