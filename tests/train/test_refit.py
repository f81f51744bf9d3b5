"""Refit after selection: once validation has picked the epoch count, a fresh model
trains that long on train + valid and is what BEST (eval, export, serve) names."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from terarec.cli.main import main
from terarec.data.synth import generate
from terarec.modeldir import load_checkpoint
from terarec.train.defaults import refit_by_default
from terarec.train.selection import refit_epochs

TRAIN = ["--batch-size", "250", "--embedding-dim", "4", "--threads", "1", "--no-progress",
         "--seed", "5", "--sparse-lr", "0.3", "--dense-lr", "0.01", "--epochs", "6",
         "--patience", "2", "--model", "fm"]


def _history(epochs: list[int]) -> list[dict]:
    return [{"pass_id": i, "epoch": e} for i, e in enumerate(epochs)]


def test_refit_epochs_is_the_selected_pass_epoch_count() -> None:
    assert refit_epochs(_history([0, 1, 2, 3, 4]), best_pass=3) == 3
    assert refit_epochs(_history([0, 1, 2]), best_pass=1) == 1
    # resumed history: pass ids continue, epochs too
    assert refit_epochs([{"pass_id": 3, "epoch": 3}, {"pass_id": 4, "epoch": 4}], 5) == 5


def test_refit_epochs_refuses_cut_passes_and_no_selection() -> None:
    assert refit_epochs(_history([0, 0, 1, 1]), best_pass=3) is None  # --eval-every
    assert refit_epochs(_history([0, 1]), best_pass=None) is None
    assert refit_epochs(_history([0, 1]), best_pass=7) is None


def test_refit_is_the_default_on_small_data_only() -> None:
    assert refit_by_default(8000) and refit_by_default(99_999)
    assert not refit_by_default(100_000) and not refit_by_default(None)


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("refit")
    generate(root / "train.tsv", 3000, model_seed=1, sample_seed=2)
    generate(root / "valid.tsv", 1000, model_seed=1, sample_seed=3)
    return root / "train.tsv", root / "valid.tsv"


def _train(files, out: Path, *extra: str) -> dict:
    train, valid = files
    assert main(["train", "--train", str(train), "--valid", str(valid), "--out", str(out),
                 *TRAIN, *extra]) == 0
    return json.loads((out / "metrics.json").read_text())


def _eval(model: Path, data: Path, *extra: str) -> dict:
    out = model / "eval.json"
    assert main(["eval", "--model", str(model), "--data", str(data), "--out", str(out),
                 *extra]) == 0
    return json.loads(out.read_text())


def test_refit_trains_the_selected_epochs_on_train_and_valid(files, tmp_path):
    out = tmp_path / "m"
    metrics = _train(files, out)
    best, passes = metrics["best_pass"], metrics["passes"]
    refit = metrics["refit"]
    assert refit["epochs"] == best  # one pass per epoch here
    assert refit["rows"] == best * 4000  # train + valid rows, every epoch
    name = f"pass-{passes + best:06d}"  # after the selection run's checkpoints
    assert refit["checkpoint"] == name == metrics["checkpoint"]
    assert metrics["selected_checkpoint"] == f"pass-{best:06d}"
    assert (out / "BEST").read_text() == name
    assert load_checkpoint(out, name).meta["pass_id"] == passes + best
    # metrics keep the selected pass's validation score (the honest one) ...
    _, valid = files
    selected = _eval(out, valid, "--checkpoint", f"pass-{best}")
    assert metrics["logloss"] == pytest.approx(selected["logloss"], rel=1e-6)
    # ... while eval (and export, serve) use the refit model, which has seen valid
    refit_scores = _eval(out, valid)
    assert refit_scores["logloss"] < selected["logloss"]


def test_no_refit_keeps_the_selected_pass(files, tmp_path):
    out = tmp_path / "m"
    metrics = _train(files, out, "--no-refit")
    assert "refit" not in metrics
    assert (out / "BEST").read_text() == f"pass-{metrics['best_pass']:06d}"
    assert metrics["checkpoint"] == f"pass-{metrics['best_pass']:06d}"


def test_refit_needs_valid_and_skips_cut_passes(files, tmp_path):
    train, _ = files
    assert main(["train", "--train", str(train), "--out", str(tmp_path / "a"), "--refit",
                 "--valid-split", "0", *TRAIN]) == 2
    metrics = _train(files, tmp_path / "b", "--pass-rows", "1000")
    assert "skipped" in metrics["refit"]
    assert (tmp_path / "b" / "BEST").read_text() == f"pass-{metrics['best_pass']:06d}"


def test_refit_of_a_tiered_run_takes_over_its_store_folder(files, tmp_path):
    """Under --memory-budget the refit's tiered store opens the folder the training
    store held (it failed as "store folder in use"); it trains and becomes BEST."""
    out = tmp_path / "m"
    metrics = _train(files, out, "--memory-budget", "4MB")
    refit = metrics["refit"]
    assert refit["epochs"] == metrics["best_pass"] and (out / "BEST").read_text() == \
        refit["checkpoint"] == metrics["checkpoint"]
    assert load_checkpoint(out, refit["checkpoint"]).tiered
    _, valid = files
    assert _eval(out, valid)["logloss"] < metrics["logloss"]  # the refit has seen valid


def _served(uri: Path, model: Path, data: Path) -> tuple[str, np.ndarray, np.ndarray]:
    """(newest version, its scores of ``data``, ``terarec predict``'s scores of it)."""
    from terarec.export import latest_version
    from terarec.export.storage import Storage
    from terarec.serving.engine import ServingEngine

    scores = model / "scores.txt"
    assert main(["predict", "--model", str(model), "--data", str(data), "--out",
                 str(scores)]) == 0
    engine = ServingEngine(uri)
    try:
        assert engine.refresh()
        names = [f"I{i}" for i in range(1, 14)] + [f"C{i}" for i in range(1, 27)]
        records = [{n: v or None for n, v in zip(names, line.rstrip("\n").split("\t")[1:],
                                                 strict=True)}
                   for line in data.read_text().splitlines(keepends=True)[:300]]
        served, _ = engine.score_records(records)
    finally:
        engine.close()
    return latest_version(Storage(str(uri))), np.asarray(served), np.loadtxt(scores)[:300]


@pytest.mark.parametrize("refit", [True, False])
def test_live_versions_end_on_the_model_validation_selected(files, tmp_path, refit):
    """With --valid and --export-to the versions follow the passes, overfit ones too;
    the last one written is the model BEST names (the refit, or the best pass), so a
    server ends on the scores eval and predict give."""
    out, uri = tmp_path / "m", tmp_path / "live"
    metrics = _train(files, out, "--export-to", str(uri), *([] if refit else ["--no-refit"]))
    assert metrics["passes"] > metrics["best_pass"]  # patience ran out: later passes exist
    name, served, offline = _served(uri, out, files[1])
    assert metrics["selected_version"] == name
    np.testing.assert_allclose(served, offline, rtol=1e-5, atol=1e-6)


def test_search_refits_its_best_trial(files, tmp_path):
    train, valid = files
    out = tmp_path / "search"
    assert main(["search", "--train", str(train), "--valid", str(valid), "--out", str(out),
                 "--trials", "2", "--pruner", "none", "--sampler", "random",
                 *TRAIN]) == 0
    best = out / "best"
    metrics = json.loads((best / "metrics.json").read_text())
    refit = metrics["refit"]
    assert refit["epochs"] == metrics["best_pass"] and refit["rows"] == refit["epochs"] * 4000
    assert (best / "BEST").read_text() == refit["checkpoint"] == metrics["checkpoint"]
    assert metrics["selected_checkpoint"] == f"pass-{metrics['best_pass']:06d}"
    assert _eval(best, valid)["logloss"] < metrics["logloss"]  # it has seen valid


def test_default_search_space_follows_the_run_learning_rates():
    from terarec.config import TrainConfig
    from terarec.train.search.space import LR_SPAN, default_space

    base = TrainConfig()
    base.sparse_optimizer.lr, base.dense_optimizer.lr = 0.0125, 0.00025
    space = default_space("deepfm", base)
    assert space["sparse_optimizer.lr"]["low"] == pytest.approx(0.0125 / LR_SPAN)
    assert space["sparse_optimizer.lr"]["high"] == pytest.approx(0.0125 * LR_SPAN)
    assert space["dense_optimizer.lr"]["high"] == pytest.approx(0.00025 * LR_SPAN)
    assert default_space("deepfm")["sparse_optimizer.lr"]["low"] == 0.01  # no base: fixed
