"""``terarec inspect`` on model directories trained with the memory and tiered stores."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from terarec.cli.inspect import _fmt, show_histogram, summarise
from terarec.cli.main import main
from terarec.config import ModelConfig, SparseOptimizerConfig, StoreConfig, TrainConfig
from terarec.data.synth import generate
from terarec.modeldir import load_checkpoint, save_checkpoint
from terarec.train.trainer import Trainer
from terarec.types import FeatureSchema


def test_show_histogram_buckets_by_powers_of_two():
    show = np.array([0, 1, 1, 2, 3, 4, 7, 8, 100], np.float32)
    assert show_histogram(show) == {"0": 1, "1": 2, "2-3": 2, "4-7": 2, "8-15": 1,
                                    "64-127": 1}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    path = tmp_path_factory.mktemp("inspect") / "train.tsv"
    generate(path, 6000, model_seed=1, sample_seed=2)
    return path


@pytest.mark.parametrize("budget", [None, "3MB"])
def test_inspect_reports_keys_tiers_and_counts(data, tmp_path, budget, capsys):
    torch.set_num_threads(1)
    config = TrainConfig(batch_size=500, pass_rows=2000, model=ModelConfig(
        name="fm", embedding_dim=16), sparse_optimizer=SparseOptimizerConfig(name="adam"),
        store=StoreConfig(
        admit_min_count=2, evict_after_passes=1, memory_budget=budget,
        disk_path=str(tmp_path / "store") if budget else None))
    trainer = Trainer(FeatureSchema.criteo(), config)
    model = tmp_path / "model"
    trainer.fit([data], progress=False, on_pass_end=lambda t, _: save_checkpoint(model, t))
    info = summarise(model)
    arrays = load_checkpoint(model).sparse
    stats = trainer.store.stats()
    assert info["store"] == ("tiered" if budget else "memory")
    assert info["passes"] == 3
    assert info["keys"] == len(arrays["keys"]) == stats.keys
    assert (info["admitted"], info["evicted"], info["candidates"]) == (
        stats.admitted, stats.evicted, stats.candidates)
    assert info["evicted"] > 0 and info["candidates"] > 0
    assert info["rejected"] == stats.rejected > 0
    assert info["admission_bytes"] == stats.admission_bytes > 0
    per_pass = info["per_pass"]
    assert [h["pass_id"] for h in per_pass] == [0, 1, 2]
    assert sum(h["new_keys"] for h in per_pass) == stats.admitted
    assert sum(h["evicted_keys"] for h in per_pass) == stats.evicted
    assert sum(h["rejected_keys"] for h in per_pass) == stats.rejected
    assert per_pass[-1]["store_keys"] == stats.keys
    assert info["show_histogram"] == show_histogram(arrays["show"])
    assert sum(info["show_histogram"].values()) == info["keys"]
    if budget:
        assert 0 < info["memory_keys"] < info["keys"]
        # The bytes the slab files take, not their apparent size: slabs are sparse files
        # created at full size, so a tiny table said "disk tier 64.0 MiB" per slab.
        slabs = list((tmp_path / "store").rglob("slab-*.bin"))
        apparent = sum(p.stat().st_size for p in slabs)
        assert 0 < info["bytes"]["disk_tier"] < apparent / 4
        assert info["disk_tier_counted"] == "allocated"
    assert main(["inspect", str(model), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == json.loads(json.dumps(info))
    assert main(["inspect", str(model)]) == 0
    text = capsys.readouterr().out
    assert f"keys        {info['keys']:,}" in text and "show count" in text
    if budget:
        assert f"disk tier {_fmt(info['bytes']['disk_tier'])} allocated" in text
    assert f"{stats.rejected:,} rejected" in text and "admitted    rejected" in text


def test_inspect_without_checkpoint_is_a_clear_error(tmp_path, capsys):
    assert main(["inspect", str(tmp_path)]) == 2
    assert "no committed checkpoint" in capsys.readouterr().err
    afile = tmp_path / "train.tsv"
    afile.write_text("x")
    for path, what in ((tmp_path / "none", "no such folder"), (afile, "a file")):
        assert main(["inspect", str(path)]) == 2
        assert f"{path}: not a model directory ({what})" in capsys.readouterr().err


def test_inspect_counts_a_refit_models_own_passes(data, tmp_path, capsys):
    """A refit's checkpoint is numbered after the selection run's passes (pass-000006
    after 3 selection passes and 3 refit passes): inspect said "6 passes"."""
    valid = tmp_path / "valid.tsv"
    generate(valid, 1500, model_seed=1, sample_seed=3)
    out = tmp_path / "model"
    assert main(["train", "--train", str(data), "--valid", str(valid), "--out", str(out),
                 "--model", "lr", "--epochs", "3", "--patience", "3", "--threads", "1",
                 "--no-progress", "--refit"]) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    capsys.readouterr()
    refit = metrics["refit"]
    assert main(["inspect", str(out), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["checkpoint"] == refit["checkpoint"] != f"pass-{refit['epochs']:06d}"
    assert info["refit"] and info["passes"] == refit["epochs"] == len(info["per_pass"])
    assert main(["inspect", str(out)]) == 0
    assert (f"{refit['checkpoint']} (refit: {refit['epochs']} passes on the train and "
            "valid rows)") in capsys.readouterr().out


def test_inspect_into_a_closed_pipe_is_no_traceback(data, tmp_path):
    """``terarec inspect MODEL | head -3`` ended in a BrokenPipeError traceback once
    ``head`` exited (every time with unbuffered output, PYTHONUNBUFFERED=1)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    model = tmp_path / "model"
    assert main(["train", "--train", str(data), "--out", str(model), "--model", "lr",
                 "--threads", "1", "--no-progress", "--pass-rows", "2000"]) == 0
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the first line is written
    src = Path(__file__).resolve().parents[2] / "src"
    env = {**os.environ, "PYTHONPATH": str(src), "PYTHONUNBUFFERED": "1"}
    try:
        done = subprocess.run([sys.executable, "-m", "terarec", "inspect", str(model)],
                              stdout=write, stderr=subprocess.PIPE, env=env, text=True,
                              timeout=120)
    finally:
        os.close(write)
    assert "Traceback" not in done.stderr and "BrokenPipe" not in done.stderr, done.stderr
    assert done.returncode == 1
