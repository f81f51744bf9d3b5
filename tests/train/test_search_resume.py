"""``terarec search --resume`` after a real kill -9: finished trials are kept as they
were, the interrupted one runs again with its values, and every grid point ends with the
value an uninterrupted search gives it. A fresh search refuses a directory holding one; a
resume with other settings names the setting."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from terarec.cli.main import main
from terarec.data.synth import generate

SRC = Path(__file__).resolve().parents[2] / "src"


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("resume")
    generate(root / "train.tsv", 3000, model_seed=3, sample_seed=1)
    generate(root / "valid.tsv", 1000, model_seed=3, sample_seed=2)
    space = root / "space.json"
    space.write_text(json.dumps({"model.embedding_dim": [2, 4, 8]}))
    return {"train": root / "train.tsv", "valid": root / "valid.tsv", "space": space}


def _args(files, out: Path, epochs: int = 4) -> list[str]:
    return ["search", "--train", str(files["train"]), "--valid", str(files["valid"]),
            "--out", str(out), "--model", "fm", "--trials", "3", "--parallel", "1",
            "--sampler", "grid", "--space", str(files["space"]), "--pruner", "none",
            "--epochs", str(epochs), "--patience", "10", "--batch-size", "250",
            "--pass-rows", "500", "--threads", "1", "--seed", "1", "--no-progress",
            "--admit-min-count", "1"]


def _values(out: Path) -> dict[int, float]:
    rows = json.loads((out / "results.json").read_text())["trials"]
    return {r["params.model.embedding_dim"]: r["value"] for r in rows}


@pytest.mark.slow
def test_resume_after_kill_keeps_finished_trials_and_reruns_the_interrupted(files,
                                                                            tmp_path):
    reference = tmp_path / "reference"
    assert main(_args(files, reference)) == 0
    out = tmp_path / "killed"
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    proc = subprocess.Popen([sys.executable, "-m", "terarec", *_args(files, out)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    first = out / "trials" / "trial-000" / "metrics.json"
    deadline = time.monotonic() + 240
    while not first.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert first.exists(), proc.stderr.read().decode() if proc.poll() else "too slow"
    time.sleep(0.5)  # optuna is told just after the trial's files are written
    os.kill(proc.pid, signal.SIGKILL)  # while the second trial trains
    proc.wait()
    assert not (out / "results.json").exists(), "killed after the search ended"
    kept = first.read_text()
    assert main(_args(files, out)) == 2  # a fresh search refuses the directory
    assert main([*_args(files, out), "--resume"]) == 0
    assert first.read_text() == kept  # the finished trial was not trained again
    results = json.loads((out / "results.json").read_text())
    numbers = sorted(r["trial"] for r in results["trials"])
    assert len(numbers) == 3 and numbers[0] == 0
    # a trial the kill interrupted (which one depends on the machine's speed) is left
    # out of the results, its folder removed, and its grid point asked again
    interrupted = set(range(numbers[-1] + 1)) - set(numbers)
    assert len(interrupted) == numbers[-1] - 2
    for number in interrupted:
        assert not (out / "trials" / f"trial-{number:03d}").exists()
    # each grid point ends with the value the uninterrupted search gave it
    want = _values(reference)
    got = _values(out)
    assert got.keys() == want.keys() == {2, 4, 8}
    for dim, value in want.items():
        assert got[dim] == pytest.approx(value, abs=1e-12), dim
    assert results["best_trial"] is not None and (out / "best" / "BEST").exists()
    best_dim = next(r for r in results["trials"] if r["trial"] == results["best_trial"])
    assert best_dim["value"] == min(want.values())  # selected by logloss


def test_resume_needs_the_settings_it_was_started_with(files, tmp_path):
    out = tmp_path / "s"
    assert main(_args(files, out, epochs=1)) == 0
    before = json.loads((out / "results.json").read_text())
    model = (out / "best" / "checkpoints").glob("pass-*/dense.safetensors")
    weights = next(model).read_bytes()
    assert main([*_args(files, out, epochs=1), "--resume"]) == 0  # nothing left: no-op
    after = json.loads((out / "results.json").read_text())
    assert len(after["trials"]) == 3 and after["best_trial"] == before["best_trial"]
    assert next((out / "best" / "checkpoints").glob("pass-*/dense.safetensors")
                ).read_bytes() == weights
    assert main([*_args(files, out, epochs=2), "--resume"]) == 2
    assert main([*_args(files, tmp_path / "none"), "--resume"]) == 2
