"""The quality benchmark's plumbing: splits, references on terarec's rows, the JSON line."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("sklearn")

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "real_data_quality.py"
_spec = importlib.util.spec_from_file_location("real_data_quality", _PATH)
quality = importlib.util.module_from_spec(_spec)
sys.modules["real_data_quality"] = quality
_spec.loader.exec_module(quality)


def test_onehot_vocabulary_comes_from_the_training_rows_only():
    enc = quality.Encoded(codes=np.array([[0], [0], [1], [2], [2]]), numeric=np.zeros((5, 1)),
                          labels=np.zeros(5, np.int64),
                          parts={"fit": slice(0, 3), "valid": slice(3, 4), "test": slice(4, 5),
                                 "train": slice(0, 4)})
    cols, width = enc.onehot(slice(0, 3), min_count=1)
    # values 0 and 1 were seen in the fit rows; 2 (valid and test only) shares the
    # out-of-vocabulary column
    assert width == 3 and cols[:, 0].tolist() == [0, 0, 1, 2, 2]
    cols, width = enc.onehot(slice(0, 3), min_count=2)
    assert width == 2 and cols[:, 0].tolist() == [0, 0, 1, 1, 1]
    cols, width = enc.onehot(slice(0, 4), min_count=1)
    assert width == 4 and cols[:, 0].tolist() == [0, 0, 1, 2, 2]


def test_dense_is_standardised_on_the_given_rows():
    enc = quality.Encoded(codes=np.zeros((4, 1), np.int64),
                          numeric=np.array([[1.0], [3.0], [np.nan], [1000.0]]),
                          labels=np.zeros(4, np.int64), parts={})
    x = enc.dense(slice(0, 2))
    assert x.shape == (4, 2)
    assert x[:2, 0].mean() == pytest.approx(0.0) and x[:2, 0].std() == pytest.approx(1.0)
    assert x[:, 1].tolist() == [0.0, 0.0, 1.0, 0.0]  # the missing flag


def test_quick_run_prints_every_model_trained_on_the_same_rows(capsys, tmp_path):
    code = quality.main(["--quick", "--datasets", "linear", "--rows", "1600", "--test-rows",
                         "800", "--search-trials", "1", "--jobs", "1"])
    out = capsys.readouterr()
    assert code == 0
    result = json.loads(out.out.strip().splitlines()[-1])
    assert {"seeds", "search", "split", "datasets", "load_avg", "seconds"} <= set(result)
    entry = result["datasets"]["linear-1600"]
    assert entry["rows"] == {"fit": 1400, "valid": 200, "test": 800}
    assert entry["refit"] is True and 0.5 < entry["ceiling_auc"] < 1.0
    refs = entry["references"]
    assert set(refs) == {"lr", "mlp", "hgb"}
    # every final model trains on the fit + valid rows, as terarec's refit does
    assert entry["default"]["trained_rows"] == 1600
    assert all(ref["trained_rows"] == 1600 for ref in refs.values())
    assert len(entry["default"]["auc"]) == 1 and entry["search"]["trials"] == 1
    for auc in [*entry["default"]["auc"], entry["search"]["auc"],
                *(ref["auc"] for ref in refs.values())]:
        assert 0.0 <= auc <= 1.0
    targets = entry["targets"]
    best = max(refs["lr"]["auc"], refs["mlp"]["auc"])
    assert targets["default_minus_best_lr_mlp"] == pytest.approx(
        min(entry["default"]["auc"]) - best, abs=1e-4)
    assert targets["default_ge_lr_mlp"] == (min(entry["default"]["auc"]) >= best)
    assert targets["search_ge_default"] == (entry["search"]["auc"]
                                            >= entry["default"]["auc"][0])
    assert "linear-1600" in out.err  # the table


def test_unknown_data_set_is_refused(capsys):
    with pytest.raises(SystemExit):
        quality.main(["--datasets", "criteo,nosuch"])
    assert "nosuch" in capsys.readouterr().err
