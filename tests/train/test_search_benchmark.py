"""``benchmarks/search.py`` end to end on a tiny input: one JSON line with every key its
docs promise, consistent ratios and AUCs that are AUCs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "search.py"
SRC = Path(__file__).resolve().parents[2] / "src"


@pytest.mark.slow
def test_search_benchmark_prints_its_line():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC),
                                                        os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, str(BENCH), "--rows", "4000", "--trials", "3",
                           "--epochs", "1", "--no-real"], capture_output=True, text=True,
                          timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 1
    out = json.loads(lines[0])
    assert out["trials"] == 3
    separate = out["seconds_separate"]
    for key in ("shared", "pruned"):
        # seconds are printed to 0.01 s, the ratio from the unrounded seconds
        ratio = out[f"seconds_{key}"] / separate
        assert out[f"ratio_{key}_vs_separate"] == pytest.approx(
            ratio, abs=0.005 * (1 + ratio) / separate + 1e-3)
    assert 0.5 < out["auc_default"] <= out["auc_best"] < 1
    assert out["auc_ceiling"] > 0.5
    assert len(out["load_avg"]) == 3 and len(out["load_avg_start"]) == 3
