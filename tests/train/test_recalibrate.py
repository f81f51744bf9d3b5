"""``--recalibrate`` (the default): after every pass the model's output bias is fitted so
that its mean prediction on the pass's rows equals their click rate."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from terarec.cli.main import main
from terarec.config import ModelConfig, TrainConfig
from terarec.data.synth import generate
from terarec.train.metrics import offset_shift
from terarec.train.trainer import RECALIBRATE_ROWS, Trainer
from terarec.types import Batch, FeatureSchema, FieldSpec, KeyedIds

SCHEMA = FeatureSchema(label="label", fields=(
    FieldSpec("x", "numeric"), FieldSpec("a", "categorical"), FieldSpec("b", "categorical")),
    missing_flags=False)


def _logit(p: float) -> float:
    return math.log(p / (1 - p))


def test_offset_shift_matches_the_click_rate() -> None:
    labels = np.array([1, 0, 0, 1, 0, 0, 0, 1, 0, 0], np.float32)  # rate 0.3
    assert offset_shift(labels, np.full(10, 0.2)) == pytest.approx(_logit(0.3) - _logit(0.2))
    probs = np.linspace(0.05, 0.6, 10)
    shift = offset_shift(labels, probs)
    z = np.log(probs / (1 - probs)) + shift
    assert (1 / (1 + np.exp(-z))).mean() == pytest.approx(0.3, abs=1e-9)
    assert offset_shift(np.zeros(4), np.full(4, 0.3)) == 0.0  # one class: nothing to fit
    assert offset_shift(labels, np.full(10, 1.0)) == pytest.approx(
        _logit(0.3) - _logit(1 - 1e-7), rel=1e-6)  # clipped, finite


def _batches(n: int = 8, size: int = 64, rate: float = 0.3) -> list[Batch]:
    rng = np.random.default_rng(5)
    out = []
    for _ in range(n):
        keys = rng.zipf(1.5, size=(size, 2)).astype(np.int64) % 200
        out.append(Batch(torch.from_numpy(rng.random((size, 1), np.float32)),
                         KeyedIds.from_dense(SCHEMA.sparse_names, torch.from_numpy(keys)),
                         torch.from_numpy((rng.random(size) < rate).astype(np.float32))))
    return out


@pytest.mark.parametrize("model", ["lr", "fm", "widedeep", "deepfm", "dcnv2", "dlrm"])
def test_after_a_pass_the_mean_prediction_is_the_click_rate(model: str) -> None:
    batches = _batches()
    rate = float(torch.cat([b.labels for b in batches]).mean())
    trainers = {}
    for recalibrate in (True, False):
        torch.manual_seed(0)
        config = TrainConfig(batch_size=64, pass_rows=512, threads=1, seed=3,
                             recalibrate=recalibrate,
                             model=ModelConfig(name=model).with_embedding_dim(4))
        trainer = Trainer(SCHEMA, config)
        planned = trainer.plan(batches)
        trainer.train_pass(planned)
        shift = trainer.recalibrate(planned)
        assert (shift is not None) == recalibrate
        trainers[recalibrate] = (trainer, shift)
    fitted, shift = trainers[True]
    unfitted, _ = trainers[False]
    mean = float(fitted.predict_batches(batches).mean())
    assert mean == pytest.approx(rate, abs=1e-5)
    assert abs(float(unfitted.predict_batches(batches).mean()) - rate) > 1e-3
    assert shift is not None and shift != 0.0
    # Only the output bias moved.
    offset = fitted.model.logit_offset()
    assert offset is not None
    for (name, a), (_, b) in zip(fitted.model.named_parameters(),
                                 unfitted.model.named_parameters(), strict=True):
        if a is offset:
            assert float((a - b).detach()) == pytest.approx(shift, abs=1e-6)
        else:
            torch.testing.assert_close(a, b, atol=0, rtol=0, msg=name)


def test_the_fit_takes_evenly_spread_steps_up_to_the_row_cap(monkeypatch) -> None:
    batches = _batches(n=10)
    torch.manual_seed(0)
    trainer = Trainer(SCHEMA, TrainConfig(batch_size=64, pass_rows=640, threads=1,
                                          model=ModelConfig(name="fm", embedding_dim=4)))
    planned = trainer.plan(batches)
    trainer.train_pass(planned)
    seen: list[int] = []
    predict = trainer.predict_batches

    def spy(chosen):
        seen.extend(id(b) for b in chosen)
        return predict(chosen)

    monkeypatch.setattr(trainer, "predict_batches", spy)
    monkeypatch.setattr("terarec.train.trainer.RECALIBRATE_ROWS", 3 * 64)
    trainer.recalibrate(planned)
    assert seen == [id(batches[i]) for i in (0, 4, 9)]  # first, middle, last
    assert RECALIBRATE_ROWS == 65_536


def test_train_records_each_pass_shift_and_can_be_told_not_to(tmp_path: Path) -> None:
    data = tmp_path / "train.tsv"
    generate(data, 3000, model_seed=1, sample_seed=3)
    common = ["--train", str(data), "--threads", "1", "--no-progress", "--embedding-dim",
              "4", "--batch-size", "256", "--pass-rows", "1024", "--epochs", "2",
              "--valid-split", "0"]  # both epochs of every row: 6 passes
    assert main(["train", *common, "--out", str(tmp_path / "on")]) == 0
    assert main(["train", *common, "--out", str(tmp_path / "off"), "--no-recalibrate"]) == 0
    on = json.loads((tmp_path / "on" / "history.json").read_text())
    off = json.loads((tmp_path / "off" / "history.json").read_text())
    assert len(on) == len(off) == 6
    assert all(math.isfinite(h["offset_shift"]) for h in on)
    assert not any("offset_shift" in h for h in off)
    config = json.loads((tmp_path / "off" / "train_config.json").read_text())
    assert config["recalibrate"] is False
