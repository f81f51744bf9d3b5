"""DGC keeps its promise on the benchmark's data: 2 gloo ranks train the benchmark's
model with today's defaults once with every dense gradient all-reduced and once with
Deep Gradient Compression; the compressed run sends over 100x fewer dense bytes and
scores within 0.002 validation AUC.

Adam fed DGC's sparse accumulated gradients lost more than 0.002 here (a coordinate's
residual, sent once in many steps, moved it about one step's length); compressing each
rank's Adam update instead keeps the loss inside the budget."""

from __future__ import annotations

from pathlib import Path

import pytest
from ranks import run_ranks

pytestmark = pytest.mark.dist

ROWS, VALID_ROWS, BATCH, PASS_ROWS = 128_000, 16_000, 1024, 32_000


def _train(ctx, root: str, mode: str) -> dict:
    from terarec.config import DenseCommConfig, ModelConfig, TrainConfig
    from terarec.distributed.sharding import iter_rank_passes
    from terarec.train.passes import iter_file_batches
    from terarec.train.trainer import Trainer
    from terarec.types import FeatureSchema

    schema = FeatureSchema.criteo()
    # The benchmark's worker: its model, today's TrainConfig defaults, one thread.
    config = TrainConfig(batch_size=BATCH, pass_rows=PASS_ROWS, threads=1, seed=0,
                         model=ModelConfig(name="deepfm"))
    comm = DenseCommConfig(mode=mode, dgc_ratio=0.001, dgc_warmup_steps=50)
    trainer = Trainer(schema, config, ctx=ctx, dense_comm=comm)
    history = [trainer.train_pass(trainer.plan(p)).as_dict()
               for p in iter_rank_passes([Path(root) / "train.txt"], schema, BATCH,
                                         PASS_ROWS, ctx.rank, ctx.world)]
    valid = iter_file_batches([Path(root) / "valid.txt"], schema, BATCH)
    return {"auc": trainer.evaluate(valid)["auc"],
            "dense_bytes_per_step": history[-1]["dense_bytes_per_step"]}


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    from terarec.data.synth import generate

    root = tmp_path_factory.mktemp("dgc-synth")
    generate(root / "train.txt", ROWS, sample_seed=1)
    generate(root / "valid.txt", VALID_ROWS, sample_seed=2)
    return root


def test_dgc_sends_100x_fewer_dense_bytes_within_0002_auc_of_all_reduce(data):
    none = run_ranks(_train, 2, str(data), "none")[0]
    dgc = run_ranks(_train, 2, str(data), "dgc")[0]
    assert none["auc"] > 0.7  # it learned
    assert none["dense_bytes_per_step"] / dgc["dense_bytes_per_step"] >= 100
    assert dgc["auc"] - none["auc"] >= -0.002
