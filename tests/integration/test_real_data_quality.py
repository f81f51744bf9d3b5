"""Default flags on the real Criteo sample against one-hot logistic regression, both
trained on the same rows and scored on held-out rows (the split of
benchmarks/real_data_quality.py: 7,000 fit, 1,000 validate, the last 2,000 test).

Default DeepFM once scored 0.647 here against one-hot logistic regression's 0.735-0.740;
it now beats it (docs/models.md, "Quality on held-out rows").
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

import terarec
from terarec.cli.main import main

pytestmark = pytest.mark.real_data

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "real_data_quality.py"
_spec = importlib.util.spec_from_file_location("real_data_quality", _PATH)
quality = importlib.util.module_from_spec(_spec)
sys.modules["real_data_quality"] = quality  # dataclasses look their module up here
_spec.loader.exec_module(quality)


def test_default_deepfm_is_near_one_hot_lr_on_criteo(tmp_path):
    sample = quality.shared_sample("criteo", tmp_path)
    if sample is None:
        pytest.skip("../shared/data's Criteo sample is absent")
    out = tmp_path / "criteo"
    assert main(["train", "--train", str(sample.fit), "--valid", str(sample.valid),
                 "--out", str(out), "--no-progress"]) == 0
    scored = terarec.load(out).evaluate(sample.test)
    reference = quality.lr_reference(sample, quality.Encoded.of(sample))
    assert scored["auc"] >= 0.715, scored
    assert scored["auc"] >= reference["auc"] - 0.015, (scored, reference)
    assert scored["logloss"] <= reference["logloss"] + 0.015, (scored, reference)
    assert (out / "report" / "report.html").exists()
