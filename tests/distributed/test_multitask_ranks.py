"""Several labels under torchrun: an MMoE over click and conversion trained on 2 gloo
ranks reports every task's metrics, and a resumed run continues it."""

from __future__ import annotations

import json

import pytest
from test_torchrun import torchrun

from terarec.data.synth_conversion import CATEGORICAL, NUMERIC, generate_conversion

pytestmark = pytest.mark.dist


def test_mmoe_trains_and_resumes_on_two_ranks(tmp_path) -> None:
    train, valid = tmp_path / "train.csv", tmp_path / "valid.csv"
    generate_conversion(train, 3000, sample_seed=0, vocab_scale=0.0005)
    generate_conversion(valid, 1000, sample_seed=1, vocab_scale=0.0005)
    out = tmp_path / "model"
    args = ["--train", str(train), "--valid", str(valid), "--out", str(out),
            "--format", "csv", "--label", "click:1,conversion:0.5",
            "--numeric", ",".join(NUMERIC), "--categorical", ",".join(CATEGORICAL),
            "--model", "mmoe", "--embedding-dim", "8", "--batch-size", "256",
            "--pass-rows", "1500", "--sparse-lr", "0.1", "--dense-lr", "0.003",
            "--select-by", "auc", "--select-task", "conversion", "--no-refit",
            "--no-progress"]
    torchrun([*args, "--epochs", "1"])
    first = json.loads((out / "metrics.json").read_text())
    assert first["world_size"] == 2 and first["passes"] == 2
    assert first["select_task"] == "conversion"
    for task in ("click", "conversion"):
        assert 0.55 < first[f"auc_{task}"] <= 1.0, first
    torchrun(["--resume", *args, "--epochs", "2"])
    again = json.loads((out / "metrics.json").read_text())
    history = json.loads((out / "history.json").read_text())
    assert again["passes"] == 4 and len(history) == 4
    assert all("valid_auc_conversion" in h and "valid_auc_click" in h for h in history)
    assert again["best_value"] == pytest.approx(max(h["valid_auc_conversion"]
                                                    for h in history))
