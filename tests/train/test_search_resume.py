"""``terarec search --resume`` after a real kill -9: finished trials are kept as they
were, the interrupted one continues from the last pass it committed (or, with none, runs
again with its values), and every grid point ends with the value an uninterrupted search
gives it. A fresh search refuses a directory holding one; a
resume with other settings names the setting."""

from __future__ import annotations

import json
import os
import shutil
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


def _kill_while_trial_1_trains(files, out: Path) -> None:
    """Start the search in a process and SIGKILL it once trial 1 committed a pass."""
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    proc = subprocess.Popen([sys.executable, "-m", "terarec", *_args(files, out)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    second = out / "trials" / "trial-001" / "LATEST"
    deadline = time.monotonic() + 240
    while not second.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    assert second.exists(), proc.stderr.read().decode() if proc.poll() else "too slow"
    os.kill(proc.pid, signal.SIGKILL)  # while the second trial trains
    proc.wait()
    assert not (out / "results.json").exists(), "killed after the search ended"


def _check_values(out: Path, reference: Path) -> dict:
    """Each grid point ends with the value the uninterrupted search gave it."""
    want = _values(reference)
    got = _values(out)
    assert got.keys() == want.keys() == {2, 4, 8}
    for dim, value in want.items():
        assert got[dim] == pytest.approx(value, abs=1e-12), dim
    results = json.loads((out / "results.json").read_text())
    assert results["best_trial"] is not None and (out / "best" / "BEST").exists()
    best_dim = next(r for r in results["trials"] if r["trial"] == results["best_trial"])
    assert best_dim["value"] == min(want.values())  # selected by logloss
    return results


@pytest.fixture(scope="module")
def reference(files, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("whole") / "reference"
    assert main(_args(files, out)) == 0
    return out


@pytest.mark.slow
def test_resume_after_kill_continues_the_interrupted_trial_from_its_last_pass(
        files, reference, tmp_path, capsys):
    out = tmp_path / "killed"
    _kill_while_trial_1_trains(files, out)
    first = out / "trials" / "trial-000" / "metrics.json"
    kept = first.read_text()
    committed = (out / "trials" / "trial-001" / "LATEST").read_text()
    assert main(_args(files, out)) == 2  # a fresh search refuses the directory
    capsys.readouterr()
    assert main([*_args(files, out), "--resume"]) == 0
    assert "continuing trial(s) 1 after pass-" in capsys.readouterr().out
    assert first.read_text() == kept  # the finished trial was not trained again
    results = _check_values(out, reference)
    assert sorted(r["trial"] for r in results["trials"]) == [0, 1, 2]
    metrics = json.loads((out / "trials" / "trial-001" / "metrics.json").read_text())
    # continued from the last pass it committed (or the one before, if the kill came
    # between its commit and LATEST), not from its first
    assert metrics["continued_from"] >= committed
    history = json.loads((out / "trials" / "trial-001" / "history.json").read_text())
    assert [h["pass_id"] for h in history] == list(range(len(history)))  # none twice
    # only the best trial keeps checkpoints (in out/best), as in an uninterrupted search
    assert not list((out / "trials").glob("trial-*/checkpoints"))


@pytest.mark.slow
def test_an_interrupted_trial_without_a_committed_pass_is_asked_again(
        files, reference, tmp_path):
    out = tmp_path / "killed"
    _kill_while_trial_1_trains(files, out)
    # as if the kill had come before trial 1 committed its first pass
    second = out / "trials" / "trial-001"
    shutil.rmtree(second / "checkpoints")
    (second / "LATEST").unlink()
    assert main([*_args(files, out), "--resume"]) == 0
    results = _check_values(out, reference)
    # trial 1 is left out of the results, its folder removed, its grid point asked again
    assert sorted(r["trial"] for r in results["trials"]) == [0, 2, 3]
    assert not second.exists()


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


class _Stop(Exception):
    """Stands for the process dying at a pass boundary."""


@pytest.mark.parametrize(("budget", "corrupt", "every"),
                         [(None, False, 1), ("8MB", False, 1), (None, True, 1),
                          (None, False, 3)],
                         ids=["shared-keys", "tiered", "newest-corrupted", "every-3-passes"])
def test_a_stopped_wave_continues_with_its_passes_cut_as_before(files, tmp_path, budget,
                                                                corrupt, every):
    """Two trials of one wave (one key index in RAM; or each a tiered store with its
    share of a memory budget), the one whose sizes cut the passes done after its single
    epoch; the search stops while the other trains and is resumed: it ends with the
    values of an uninterrupted search, its passes cut by the finished trial's batch size
    as before the stop (300 rows: another cut than its own 250). A newest checkpoint
    that does not verify is passed over for the one before; committing every 3 passes,
    the search continues from pass 3, the last such pass, when it stops after pass 4."""
    from terarec.config import TrainConfig
    from terarec.data.numeric import with_numeric_stats
    from terarec.train.passes import iter_file_batches
    from terarec.train.search import SearchConfig, run_search
    from terarec.train.search.space import check_space
    from terarec.types import FeatureSchema

    schema = with_numeric_stats(FeatureSchema.criteo(), [files["train"]])
    config = TrainConfig()
    config.batch_size, config.pass_rows, config.threads, config.seed = 300, 1000, 1, 4
    config.store.admit_min_count, config.store.memory_budget = 2, budget
    # Rows that move from their first step: the best pass, and so the checkpoints
    # kept, are those the scenario was written for.
    config.sparse_optimizer.initial_accumulator = 0.0
    valid = list(iter_file_batches([files["valid"]], schema, 500))
    fixed = [{"epochs": 1, "batch_size": 300, "model.embedding_dim": 4},
             {"epochs": 3, "batch_size": 250, "model.embedding_dim": 8}]
    space = check_space({k: sorted({t[k] for t in fixed}) for k in fixed[0]}, config)

    def search(out: Path, resume: bool = False, on_boundary=None):
        settings = SearchConfig(base=config, trials=2, pruner="none", sampler="random",
                                fixed=fixed, space=space, patience=10,
                                checkpoint_every=every, resume=resume)
        return run_search(settings, schema, [files["train"]], valid, out,
                          on_boundary=on_boundary)

    def curves(result) -> dict[int, list[tuple[int, float]]]:
        return {t.number: [(h["rows"], h["valid_logloss"]) for h in t.history]
                for t in result.trials}

    whole = curves(search(tmp_path / "whole"))
    seen = []

    def stop(trials) -> None:
        seen.append([t.state for t in trials])
        if len(seen) == 4:  # epoch 2: trial 0 is done, trial 1 committed its 4th pass
            raise _Stop  # 1,800 rows left: 1,200 + 600 as cut before, not 1,000 + 800

    out = tmp_path / "stopped"
    with pytest.raises(_Stop):
        search(out, on_boundary=stop)
    assert seen[-1] == ["complete", "running"]
    if corrupt:
        rows = next((out / "trials" / "trial-001" / "checkpoints" / "pass-000004"
                     ).glob("sparse/*.safetensors"))
        data = bytearray(rows.read_bytes())
        data[-1] ^= 0xFF
        rows.write_bytes(bytes(data))
    resumed = search(out, resume=True)
    got = curves(resumed)
    assert got.keys() == whole.keys() == {0, 1}
    for number, curve in whole.items():  # every pass's rows and validation loss
        assert [rows for rows, _ in got[number]] == [rows for rows, _ in curve]
        assert [loss for _, loss in got[number]] == pytest.approx(
            [loss for _, loss in curve], abs=1e-12), number
    continued = next(t for t in resumed.trials if t.number == 1)
    assert continued.continued_from == ("pass-000003" if corrupt or every == 3
                                        else "pass-000004")
