"""Validation-driven training: the best pass is kept and used, patience stops training,
--eval-every cuts passes, BEST survives pruning, resume continues from the latest."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from terarec.cli.main import main
from terarec.data.synth import generate
from terarec.modeldir import list_checkpoints, load_checkpoint
from terarec.train.selection import SelectionTracker

TRAIN = ["--batch-size", "500", "--pass-rows", "2000", "--embedding-dim", "4",
         "--threads", "1", "--no-progress", "--seed", "3"]
# A sparse learning rate high enough that validation logloss goes up and down from pass
# to pass, so the best pass is not the last one.
NOISY = ["--sparse-lr", "0.3", "--dense-lr", "0.01"]


def test_tracker_improves_and_stops_after_patience() -> None:
    t = SelectionTracker("logloss", patience=2)
    verdicts = [t.update(v, i + 1) for i, v in enumerate([0.5, 0.4, 0.45, 0.39, 0.41, 0.42])]
    assert [v.improved for v in verdicts] == [True, True, False, True, False, False]
    assert [v.stop for v in verdicts] == [False] * 5 + [True]
    assert t.best_pass == 4 and t.best_value == 0.39


def test_tracker_auc_is_maximised_and_nan_never_improves() -> None:
    t = SelectionTracker("auc", patience=None)
    assert t.update(0.7, 1).improved
    assert not t.update(math.nan, 2).improved
    assert not t.update(0.69, 3).improved
    assert t.update(0.71, 4).improved and t.best_pass == 4
    assert not t.update(0.1, 5).stop  # patience None never stops


def test_tracker_rebuilt_from_history_matches_the_live_one() -> None:
    values = [0.5, 0.4, 0.45, 0.46]
    live = SelectionTracker("logloss", patience=3)
    for i, v in enumerate(values):
        live.update(v, i + 1)
    history = [{"pass_id": i, "valid_logloss": v} for i, v in enumerate(values)]
    again = SelectionTracker.from_history(history, "logloss", 3)
    assert (again.best_pass, again.best_value, again.since_best) == (2, 0.4, 2)
    assert (live.best_pass, live.since_best) == (again.best_pass, again.since_best)
    assert again.update(0.47, 5).stop


def test_tracker_patience_counts_epochs_of_evaluations() -> None:
    t = SelectionTracker("logloss", patience=2, per_epoch=3)
    values = [0.5, 0.4, 0.41, 0.42, 0.43, 0.44, 0.45, 0.46]
    verdicts = [t.update(v, i + 1) for i, v in enumerate(values)]
    assert [v.stop for v in verdicts] == [False] * 7 + [True]
    assert t.wait == 6 and t.summary()["evaluations_per_epoch"] == 3
    history = [{"pass_id": i, "valid_logloss": v} for i, v in enumerate(values[:-1])]
    again = SelectionTracker.from_history(history, "logloss", 2, per_epoch=3)
    assert not again.exhausted and again.update(0.46, 8).stop


def test_tracker_rejects_bad_settings() -> None:
    with pytest.raises(ValueError, match="select-by"):
        SelectionTracker("accuracy")
    with pytest.raises(ValueError, match="patience"):
        SelectionTracker("auc", patience=0)
    with pytest.raises(ValueError, match="per_epoch"):
        SelectionTracker("auc", per_epoch=0)


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("select")
    generate(root / "train.tsv", 8000, model_seed=1, sample_seed=2)
    generate(root / "valid.tsv", 2000, model_seed=1, sample_seed=3)
    return root / "train.tsv", root / "valid.tsv"


def _train(files, out: Path, *extra: str) -> tuple[dict, list[dict]]:
    train, valid = files
    assert main(["train", "--train", str(train), "--valid", str(valid), "--out", str(out),
                 *TRAIN, *extra]) == 0
    return (json.loads((out / "metrics.json").read_text()),
            json.loads((out / "history.json").read_text()))


def _eval(model: Path, data: Path, *extra: str) -> dict:
    out = model / "eval.json"
    assert main(["eval", "--model", str(model), "--data", str(data), "--out", str(out),
                 *extra]) == 0
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def noisy_run(files, tmp_path_factory) -> tuple[Path, dict, list[dict]]:
    out = tmp_path_factory.mktemp("noisy") / "model"
    metrics, history = _train(files, out, *NOISY, "--epochs", "3", "--patience", "100")
    return out, metrics, history


def test_best_pass_is_restored_for_eval_predict_and_export(files, noisy_run, tmp_path):
    out, metrics, history = noisy_run
    losses = [h["valid_logloss"] for h in history]
    best = min(range(len(losses)), key=losses.__getitem__)
    assert best != len(losses) - 1, "the data should make the last pass not the best"
    assert [h["best"] for h in history].count(True) >= 1 and history[best]["best"]
    assert metrics["best_pass"] == best + 1
    assert (out / "BEST").read_text() == f"pass-{best + 1:06d}"
    assert metrics["checkpoint"] == f"pass-{best + 1:06d}"
    assert metrics["logloss"] == pytest.approx(losses[best], rel=1e-6)
    assert metrics["stop_reason"] == "epochs_exhausted"
    assert history[-1]["stop_reason"] == "epochs_exhausted"

    _, valid = files
    assert _eval(out, valid)["logloss"] == pytest.approx(losses[best], rel=1e-6)
    assert _eval(out, valid, "--checkpoint", "latest")["logloss"] == pytest.approx(
        losses[-1], rel=1e-6)
    # predict scores with the best checkpoint too: its mean is the best pass's
    scores = tmp_path / "scores.txt"
    assert main(["predict", "--model", str(out), "--data", str(valid),
                 "--out", str(scores)]) == 0
    mean = sum(float(x) for x in scores.read_text().split()) / 2000
    assert mean == pytest.approx(_eval(out, valid)["mean_prediction"], rel=1e-5)
    assert main(["export", "--model", str(out), "--out", str(tmp_path / "exp")]) == 0
    manifest = json.loads(next((tmp_path / "exp").glob("v*/manifest.json")).read_text())
    assert manifest["pass_id"] == best + 1


def test_best_checkpoint_is_kept_out_of_pruning(noisy_run):
    out, metrics, history = noisy_run
    names = [p.name for p in list_checkpoints(out)]
    assert names[0] == f"pass-{len(history):06d}"  # the latest, for resuming
    assert f"pass-{metrics['best_pass']:06d}" in names
    assert load_checkpoint(out, (out / "BEST").read_text()).meta["pass_id"] == \
        metrics["best_pass"]


def test_patience_counts_epochs_of_evaluations(files, tmp_path):
    """An epoch of 4 passes is evaluated 4 times: patience 2 waits 8 evaluations, so a
    pass or two that end worse do not stop a run that still improves epoch over epoch."""
    metrics, history = _train(files, tmp_path / "m", *NOISY, "--epochs", "40",
                              "--patience", "2")
    assert metrics["evaluations_per_epoch"] == 4 and metrics["patience"] == 2
    assert metrics["stop_reason"] == "patience"
    flags = [h["best"] for h in history]
    assert flags[-8:] == [False] * 8
    last_best = max(i for i, f in enumerate(flags) if f)
    assert len(history) == last_best + 9
    # no earlier run of 8 evaluations without improvement, but shorter ones that a
    # count of evaluations would have stopped on
    runs, since = [], 0
    for f in flags[:-1]:
        since = 0 if f else since + 1
        runs.append(since)
    assert 2 <= max(runs) < 8


def test_patience_counts_evaluations_with_eval_every(files, tmp_path):
    metrics, history = _train(files, tmp_path / "m", *NOISY, "--epochs", "20",
                              "--patience", "2", "--eval-every", "4")
    assert "evaluations_per_epoch" not in metrics
    assert metrics["stop_reason"] == "patience"
    flags = [h["best"] for h in history]
    assert flags[-2:] == [False, False]
    assert len(history) == max(i for i, f in enumerate(flags) if f) + 3


def test_eval_every_cuts_passes_to_n_steps(files, tmp_path):
    metrics, history = _train(files, tmp_path / "m", "--epochs", "1", "--eval-every", "2",
                              "--pass-rows", "8000")
    # 8,000 rows in batches of 500 = 16 steps: evaluated every 2 steps, 8 times
    assert [h["steps"] for h in history] == list(range(2, 17, 2))
    assert all("valid_auc" in h for h in history)
    assert metrics["evaluations"] == 8


def test_resume_continues_from_latest_not_best(files, noisy_run, tmp_path):
    out, metrics, history = noisy_run
    copy = tmp_path / "model"
    import shutil

    shutil.copytree(out, copy)
    resumed, again = _train(files, copy, *NOISY, "--epochs", "4", "--patience", "100",
                            "--resume")
    assert again[:len(history)][-1]["pass_id"] == history[-1]["pass_id"]
    assert len(again) == len(history) + 4  # one more epoch, after the latest pass
    assert again[len(history)]["pass_id"] == len(history)


def test_without_valid_training_is_unchanged(files, tmp_path):
    train, _ = files
    out = tmp_path / "m"
    assert main(["train", "--train", str(train), "--out", str(out), *TRAIN,
                 "--valid-split", "0"]) == 0  # (small data carves validation rows otherwise)
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["passes"] == 4 and metrics["stop_reason"] == "end_of_data"
    assert not (out / "BEST").exists()
    with pytest.raises(SystemExit):
        main(["train", "--train", str(train), "--out", str(out), "--eval-every", "x"])
    assert main(["train", "--train", str(train), "--out", str(out), "--eval-every",
                 "2"]) == 2


def test_resume_after_patience_ran_out_trains_nothing_more(files, tmp_path):
    """A run killed after committing the pass whose evaluation stopped it resumes to the
    uninterrupted run's model: patience rebuilt from the history stops it at once."""
    out = tmp_path / "m"
    args = (*NOISY, "--epochs", "20", "--patience", "2", "--no-refit")
    metrics, history = _train(files, out, *args)
    assert metrics["stop_reason"] == "patience"
    (out / "metrics.json").unlink()  # as if killed between the commit and the metrics
    resumed, again = _train(files, out, *args, "--resume")
    assert [h["pass_id"] for h in again] == [h["pass_id"] for h in history]
    assert resumed["stop_reason"] == "patience"
    assert resumed["checkpoint"] == metrics["checkpoint"]
    assert resumed["logloss"] == metrics["logloss"]
