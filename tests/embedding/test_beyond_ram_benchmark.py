"""``benchmarks/beyond_ram.py`` at a tiny size: one JSON line with the fields the large
run reports, served scores equal to ``predict`` on rows of the delta, the table past the
budget, the working folders removed, and a refusal when the disk is too small."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
KEYS = ("table_bytes", "machine_ram_bytes", "sps_ratio_vs_in_ram", "peak_rss_bytes",
        "budget_bytes", "max_score_diff_served_vs_predict", "seconds_by_phase",
        "peak_rss_by_phase", "disk_bytes_per_key", "ram_bytes_per_key")


def _run(args: list[str]) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "beyond_ram.py"), *args],
                          capture_output=True, text=True, timeout=300, env=env)


def test_tiny_run_trains_exports_and_serves_what_predict_scores(tmp_path):
    work = tmp_path / "work"
    done = _run(["--keys", "240000", "--budget-gb", "0.012", "--workdir", str(work),
                 "--pass-rows", "2000", "--unique-fields", "16", "--batch-size", "1000",
                 "--in-ram-keys", "60000", "--requests", "64"])
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 1
    out = json.loads(lines[0])
    assert all(key in out for key in KEYS)
    assert out["keys"] >= 240000
    assert out["row_dim"] >= out["dim"] == 16 and out["state_dim"] == 1  # Adagrad
    assert out["table_bytes"] == out["keys"] * 4 * (out["row_dim"] + out["state_dim"])
    assert out["table_bytes"] > out["budget_bytes"]
    assert out["max_score_diff_served_vs_predict"] < 1e-6  # delta rows are fp32
    assert out["max_score_diff_int8_rows"] < 5e-3  # full version rows are int8
    assert out["served_version"] == 2  # the full version and its delta
    assert out["export_full_rows"] >= 240000 and out["export_delta_rows"] > 0
    assert out["sps_ratio_vs_in_ram"] > 0 and out["sps_in_ram"] > 0
    assert set(out["seconds_by_phase"]) >= {"train", "checkpoint", "export_full_int8",
                                            "export_delta", "serve"}
    assert out["disk_bytes_per_key"]["store"] >= out["record_bytes"]
    assert not work.exists()  # removed without --keep


def test_refuses_to_start_without_the_disk_it_needs(tmp_path):
    done = _run(["--keys", str(10 ** 15), "--workdir", str(tmp_path / "w"), "--no-in-ram"])
    assert done.returncode != 0
    assert "--workdir" in done.stderr and "GB free" in done.stderr
    assert not (tmp_path / "w" / "store").exists()
