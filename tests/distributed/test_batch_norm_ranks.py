"""``--batch-norm`` on N ranks: a step whose rows all fall on rank 0 (a file's tail
shorter than a local batch) leaves rank 1 an empty local batch, on which it still runs
the model (one zero row weighted 0: DDP all-reduces on every rank). That row must
neither fail batch norm nor move its statistics; at the pass end the ranks average
their statistics (in-process gloo ranks)."""

from __future__ import annotations

import numpy as np
import torch
from ranks import run_ranks

from terarec.config import ModelConfig, TrainConfig
from terarec.distributed.context import DistContext
from terarec.train.trainer import Trainer
from terarec.types import Batch, FeatureSchema, FieldSpec, KeyedIds

SCHEMA = FeatureSchema(label="label", fields=(
    FieldSpec("x", "numeric"), FieldSpec("a", "categorical"), FieldSpec("b", "categorical")),
    missing_flags=False)


def _batch(rng: np.random.Generator, rows: int) -> Batch:
    keys = rng.integers(0, 50, size=(rows, 2)).astype(np.int64)
    return Batch(torch.from_numpy(rng.random((rows, 1), np.float32)),
                 KeyedIds.from_dense(SCHEMA.sparse_names, torch.from_numpy(keys)),
                 torch.from_numpy((rng.random(rows) < 0.3).astype(np.float32)))


def _rank(ctx: DistContext) -> dict:
    torch.manual_seed(0)
    config = TrainConfig(batch_size=64, threads=1, seed=1,
                         model=ModelConfig(name="deepfm", embedding_dim=4, deep_mlp=(8,),
                                           batch_norm=True))
    trainer = Trainer(SCHEMA, config, ctx=ctx)
    rng = np.random.default_rng(ctx.rank)
    tail = _batch(rng, 10) if ctx.rank == 0 else _batch(rng, 0)
    result = trainer.train_pass(trainer.plan([_batch(rng, 32), _batch(rng, 32), tail]))
    stats = {k: v.clone() for k, v in trainer.model.state_dict().items()
             if "running" in k or "tracked" in k}
    return {"loss": result.train_loss, "rows": result.rows, "stats": stats}


def test_an_empty_local_batch_runs_batch_norm_without_moving_it() -> None:
    parts = run_ranks(_rank, 2)
    for part in parts:
        assert part["rows"] == 138 and np.isfinite(part["loss"])
    # rank 1's last step was its zero row only: its statistics saw its two real
    # batches, rank 0's three (the 10 tail rows too)
    tracked = [[int(v) for k, v in p["stats"].items() if k.endswith("num_batches_tracked")]
               for p in parts]
    assert tracked[0] and all(n == 3 for n in tracked[0]) and all(n == 2 for n in tracked[1])
    # the running statistics are averaged over the ranks at the pass end: one model
    for name, value in parts[0]["stats"].items():
        if "running" in name:
            torch.testing.assert_close(parts[1]["stats"][name], value, rtol=0, atol=0)
