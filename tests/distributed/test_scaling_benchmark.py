"""``benchmarks/distributed_scaling.py`` end to end on a tiny input: it launches real
torchrun ranks and prints the one JSON line its docs promise."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.dist

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "distributed_scaling.py"


def test_benchmark_prints_scaling_per_batch_and_dense_bytes_per_hook(tmp_path):
    done = subprocess.run(
        [sys.executable, str(BENCH), "--rows", "12000", "--valid-rows", "2000",
         "--batch-size", "1024", "--also-batch-sizes", "512", "--pass-rows", "3000",
         "--repeats", "1", "--dgc-warmup-steps", "4", "--workdir", str(tmp_path)],
        capture_output=True, text=True, timeout=480,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])

    assert set(result["scaling_by_batch"]) == {"512", "1024"}
    assert result["scaling_by_batch"]["1024"]["scaling"] == result["scaling"]
    # the line rounds ratios to 3 places
    assert result["scaling"] == pytest.approx(result["sps_2ranks"] / result["sps_1rank"],
                                              abs=5.1e-4)
    assert result["sps_1rank"] > 0 and result["sps_2ranks"] > 0 and result["scaling_cli"] > 0
    # the 2-rank loop over an emulated 10 Gb/s link, and the projection from it
    assert result["scaling_emulated_10gbps"] == pytest.approx(
        result["sps_2ranks_emulated_10gbps"] / result["sps_1rank"], abs=5.1e-4)
    assert result["link_bytes_per_step"] > result["bytes_per_step"]["none"]  # rows too
    assert result["link_calls_per_step"] >= 2
    projected = result["projected_scaling"]
    assert set(projected) == {"8", "64"}
    for ranks in projected.values():
        assert 0 < ranks["10gbps"] < ranks["100gbps"]
    dense = result["bytes_per_step"]
    assert dense["fp16"] == pytest.approx(dense["none"] / 2)
    assert dense["dgc"] < dense["none"] / 50
    assert result["dgc_compression"] == pytest.approx(dense["none"] / dense["dgc"], rel=1e-3)
    # 2 ranks train the single process's model: the same validation AUC within noise
    assert abs(result["auc_none"] - result["auc_1rank"]) < 2e-3
    assert result["delta_auc_dgc"] == pytest.approx(result["auc_dgc"] - result["auc_none"],
                                                    abs=2e-5)
    # where each end-to-end run's wall time went, and how loaded the machine was
    for side in ("phases_cli_1rank", "phases_cli_2ranks"):
        phases = result[side]
        assert {"start", "setup", "train", "checkpoint", "wall", "other"} <= set(phases)
        assert phases["train"] > 0 and phases["wall"] >= phases["train"]
    # both sides trained the same rows (the same passes before patience stopped them)
    assert result["phases_cli_1rank"]["rows_trained"] == result["phases_cli_2ranks"]["rows_trained"]
    assert result["phases_cli_1rank"]["passes"] == result["phases_cli_2ranks"]["passes"]
    assert result["load_avg"] >= 0 and result["load_avg_start"] >= 0
