"""The search directory's lock is held through the best trial's refit (a second
``search --resume`` beside it rewrote ``best/``), and resuming a finished search keeps
its refit ``best/`` instead of training it again."""

from __future__ import annotations

import importlib
import json

import pytest

import terarec
from terarec.data.synth import generate

# the module (``terarec.api.search`` the attribute is the function)
api_search = importlib.import_module("terarec.api.search")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("refit-lock")
    generate(root / "train.tsv", 1500, model_seed=3, sample_seed=1)
    generate(root / "valid.tsv", 500, model_seed=3, sample_seed=2)
    return root / "train.tsv", root / "valid.tsv"


def _search(files, out, **extra):
    train, valid = files
    return terarec.search(train, valid, out=out, trials=2, sampler="random", pruner="none",
                          space={"model.embedding_dim": [2, 4]}, refit=True, model="lr",
                          epochs=1, batch_size=250, pass_rows=500, threads=1,
                          progress=False, **extra)


def test_the_lock_covers_the_refit_and_a_finished_search_is_not_refit_again(
        files, tmp_path, monkeypatch):
    out = tmp_path / "s"
    real = api_search.refit_best
    refused: list[str] = []

    def refit_with_a_rival(*args, **kwargs):
        with pytest.raises(ValueError, match="in use by another process") as exc:
            _search(files, out, resume=True)  # what a second `search --resume` runs
        refused.append(str(exc.value))
        return real(*args, **kwargs)

    monkeypatch.setattr(api_search, "refit_best", refit_with_a_rival)
    first = _search(files, out)
    assert len(refused) == 1 and ".lock" in refused[0]
    metrics = json.loads((out / "best" / "metrics.json").read_text())
    assert metrics["refit"] and metrics["trial"] == first.result.best.number
    before = {p.relative_to(out / "best"): p.read_bytes()
              for p in (out / "best").rglob("*") if p.is_file()}

    calls: list[object] = []
    monkeypatch.setattr(api_search, "refit_best", lambda *a, **k: calls.append(a))
    again = _search(files, out, resume=True)
    assert calls == []  # the finished search's refit is kept, not done again
    assert again.best is not None and again.best_params == first.best_params
    after = {p.relative_to(out / "best"): p.read_bytes()
             for p in (out / "best").rglob("*") if p.is_file()}
    assert after == before
    assert again.best.metrics["refit"] == metrics["refit"]
