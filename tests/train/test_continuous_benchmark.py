"""``benchmarks/continuous.py`` end to end on a tiny stream: one JSON line, every landed
row trained once through two SIGKILLs, no failed request."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "continuous.py"
SRC = Path(__file__).resolve().parents[2] / "src"


@pytest.mark.slow
def test_continuous_benchmark_prints_its_line(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC),
                                                        os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, str(BENCH), "--files", "4", "--rows", "1500",
                           "--interval", "3", "--workdir", str(tmp_path)],
                          capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 1
    out = json.loads(lines[0])
    assert out["files"] == 4 and out["kills"] == 2
    assert out["rows_trained"] == out["rows_landed"] == 6000
    assert out["serve_errors"] == 0 and out["serve_requests"] > 0
    assert 0 < out["freshness_p50_s"] <= out["freshness_p99_s"]
    assert 0 < out["auc_progressive_frozen"] < 1 and 0 < out["auc_progressive_continuous"] < 1
