"""``--device-budget`` on N ranks: each rank's cache holds the hottest rows of the shard
it owns, and is transparent as in one process: 2 ranks with a cache train, bit for bit,
the model 2 ranks train without one (in-process gloo ranks, ``ranks.run_ranks``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from ranks import run_ranks

from terarec.config import ModelConfig, SparseOptimizerConfig, StoreConfig, TrainConfig
from terarec.data.synth import generate_arrays
from terarec.distributed.context import DistContext
from terarec.kernels import splitmix64_array
from terarec.train.trainer import Trainer
from terarec.types import Batch, FeatureSchema, FieldSpec, KeyedIds

BATCH, PASS_BATCHES, DIM = 128, 8, 8
SCHEMA = FeatureSchema(label="label", fields=(
    *(FieldSpec(f"I{i}", "numeric") for i in range(1, 14)),
    *(FieldSpec(f"C{i}", "categorical") for i in range(1, 27))), missing_flags=False)


def _passes(n_passes: int) -> list[list[Batch]]:
    rows = n_passes * PASS_BATCHES * BATCH
    arrays = generate_arrays(rows, model_seed=0, sample_seed=1)
    dense = np.log1p(np.nan_to_num(arrays.dense, nan=0.0).clip(min=0)).astype(np.float32)
    field = np.arange(arrays.categorical.shape[1], dtype=np.uint64)
    keys = splitmix64_array(arrays.categorical.astype(np.uint64) + (field << np.uint64(40)))
    keys = np.ascontiguousarray(keys.view(np.int64))
    batches = [Batch(torch.from_numpy(dense[s:s + BATCH]),
                     KeyedIds.from_dense(SCHEMA.sparse_names,
                                         torch.from_numpy(keys[s:s + BATCH])),
                     torch.from_numpy(arrays.labels[s:s + BATCH].astype(np.float32)))
               for s in range(0, rows, BATCH)]
    return [batches[p * PASS_BATCHES:(p + 1) * PASS_BATCHES] for p in range(n_passes)]


def _config(budget: int | None, optimizer: str, **store) -> TrainConfig:
    return TrainConfig(
        batch_size=BATCH, seed=3, device="cpu", threads=1, device_budget=budget,
        model=ModelConfig(name="deepfm", embedding_dim=DIM),
        sparse_optimizer=SparseOptimizerConfig(name=optimizer, lr=0.05),
        store=StoreConfig(**store))


def _rank(ctx: DistContext, budget: int | None, optimizer: str, store: dict) -> dict:
    torch.manual_seed(0)
    trainer = Trainer(SCHEMA, _config(budget, optimizer, **store), ctx=ctx)
    local = BATCH // ctx.world
    shares = [[b.slice(ctx.rank * local, (ctx.rank + 1) * local) for b in p]
              for p in _passes(5)]
    plans = [trainer.plan(share) for share in shares]
    losses = []
    for i, plan in enumerate(plans):  # the next pass's plan known: its misses read ahead
        upcoming = plans[i + 1] if i + 1 < len(plans) else None
        losses.append(trainer.train_pass(plan, upcoming=upcoming).train_loss)
    scores = trainer.predict_batches(shares[0])
    cache = trainer.device_cache
    stats = (len(cache), cache.capacity, cache.stats.hits, cache.stats.misses) \
        if cache is not None else None
    trainer.sync_store()
    arrays = trainer.store.to_arrays()
    return {"losses": losses, "scores": scores, "stats": stats,
            "dense": {k: v.clone() for k, v in trainer.model.state_dict().items()},
            **{k: arrays[k] for k in ("keys", "values", "state", "show", "click")}}


@pytest.mark.slow
@pytest.mark.parametrize("optimizer,store", [("adagrad", {}),
                                             ("adam", {"admit_min_count": 2})])
def test_ranks_with_a_device_cache_train_the_plain_ranks_bit_for_bit(optimizer, store):
    plain = run_ranks(_rank, 2, None, optimizer, store)
    # a budget well below a pass's rows per rank: the caches fill, rows come and go
    row = DIM + 1  # deepfm: the factors and the first-order weight
    state = {"adagrad": 1, "adam": 2 * row + 1}[optimizer]
    cached = run_ranks(_rank, 2, 300 * 4 * (row + state), optimizer, store)
    for a, b in zip(plain, cached, strict=True):
        assert a["stats"] is None
        size, capacity, hits, misses = b["stats"]
        assert 0 < size <= capacity == 300 < len(b["keys"]) and hits > 0 and misses > 0
        assert a["losses"] == b["losses"]
        np.testing.assert_array_equal(a["scores"], b["scores"])
        for name in ("keys", "values", "state", "show", "click"):
            np.testing.assert_array_equal(a[name], b[name], err_msg=name)
        for name, tensor in a["dense"].items():
            torch.testing.assert_close(tensor, b["dense"][name], rtol=0, atol=0)

