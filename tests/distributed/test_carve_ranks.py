"""Validation rows carved from --train under torchrun: rank 0 cuts the input, every rank
selects on the same rows, the refit trains all of them, and the run matches one
process's."""

from __future__ import annotations

import json

import pytest
from test_torchrun import single, torchrun

from terarec.data.synth import generate

pytestmark = pytest.mark.dist

ARGS = ["--model", "lr", "--batch-size", "200", "--epochs", "3", "--patience", "1",
        "--threads", "1", "--no-progress", "--seed", "4", "--autocast", "off"]


def test_two_ranks_carve_the_rows_one_process_carves(tmp_path) -> None:
    data = tmp_path / "train.tsv"
    generate(data, 1600, model_seed=1, sample_seed=2)
    single(["--train", str(data), "--out", str(tmp_path / "one"), *ARGS])
    torchrun(["--train", str(data), "--out", str(tmp_path / "two"), *ARGS])
    one, two = (json.loads((tmp_path / m / "metrics.json").read_text())
                for m in ("one", "two"))
    assert two["world_size"] == 2
    assert two["validation"] == one["validation"]
    assert two["validation"]["valid_files"] == [{"file": str(data), "rows": [1400, 1600]}]
    assert two["eval_rows"] == one["eval_rows"] == 200
    history = [json.loads((tmp_path / m / "history.json").read_text()) for m in ("one", "two")]
    assert [h["rows"] for h in history[1]] == [h["rows"] for h in history[0]]
    assert all(h["rows"] == 1400 for h in history[1])  # the carved rows never train here
    assert two["refit"]["rows"] == 1600 * two["refit"]["epochs"]
    assert two["auc"] == pytest.approx(one["auc"], abs=1e-4)
    assert not (tmp_path / "two" / "carved").exists()
