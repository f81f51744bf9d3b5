"""``benchmarks/gpu_throughput.py`` on CPU with tiny shapes: one JSON line with every key
the GPU run reports, the device figures within their bounds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
KEYS = ("terarec_sps", "dense_only_sps", "torchrec_sps", "ratio_vs_dense_only",
        "ratio_vs_torchrec", "device_hit_rate", "h2d_bytes_per_pass", "h2d_hidden_share",
        "peak_device_bytes", "loadavg")


@pytest.mark.slow
def test_gpu_benchmark_prints_its_keys_on_cpu():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"),
                                                        os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_throughput.py"),
                           "--device", "cpu", "--rows", "12000", "--batch-size", "1000",
                           "--pass-batches", "3", "--passes", "2", "--steps", "2",
                           "--threads", "1"],
                          capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 1
    out = json.loads(lines[0])
    assert all(key in out for key in KEYS)
    assert out["device"] == "cpu" and out["device_budget"] < out["table_bytes"]
    assert out["cached_rows"] == out["cache_capacity"] > 0  # the cache is full
    assert 0 < out["device_hit_rate"] < 1 and 0 < out["h2d_hidden_share"] <= 1
    assert out["h2d_bytes_per_pass"] > 0 and out["terarec_sps"] > 0
    assert out["peak_device_bytes"] >= out["device_budget"] // 2
