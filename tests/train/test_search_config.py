"""``SearchConfig`` and ``run_search``: a search's settings are checked when made, each
error naming its field, and the library call is the command's search."""

from __future__ import annotations

import json

import pytest

from terarec.cli.main import main
from terarec.config import TrainConfig, from_dict
from terarec.data.numeric import with_numeric_stats
from terarec.data.synth import generate
from terarec.train.passes import iter_file_batches
from terarec.train.search import SearchConfig, SearchResult, run_search
from terarec.types import FeatureSchema


@pytest.mark.parametrize(("settings", "message"), [
    ({"trials": 0}, "trials 0: must be an integer >= 1"),
    ({"trials": True}, "trials True: must be an integer >= 1"),
    ({"parallel": 0}, "parallel 0: must be an integer >= 1"),
    ({"first_rung": 0}, "first_rung 0: must be an integer >= 1"),
    ({"checkpoint_every": -1}, "checkpoint_every -1: must be an integer >= 1"),
    ({"patience": 0}, "patience 0: must be an integer >= 1"),
    ({"rows": -1}, "rows -1: must be an integer >= 0"),
    ({"seed": -1}, "seed -1: must be an integer >= 0"),
    ({"sampler": "cmaes"}, "sampler 'cmaes': expected one of random, tpe, grid"),
    ({"pruner": "early"}, "pruner 'early': expected one of none, halving"),
    ({"select_by": "f1"}, "select_by 'f1': expected one of auc, logloss"),
    ({"resume": "yes"}, "resume 'yes': must be true or false"),
    ({"base": {"batch_size": 8}}, "base: expected a TrainConfig, got dict"),
    ({"space": {"model.embeding_dim": [4, 8]}},
     "space: model.embeding_dim: no such config field"),
    ({"space": {"model.dropout": [0.0, 1.5]}}, "space: model.dropout: choice 1.5"),
    ({"space": {}}, "space: expected a non-empty mapping"),
    ({"sampler": "grid", "space": {"sparse_optimizer.lr": {"type": "float", "low": 0.01,
                                                           "high": 0.1}}},
     "space: grid sampler: sparse_optimizer.lr is a float range"),
    ({"fixed": [4]}, r"fixed\[0\]: expected a mapping"),
])
def test_bad_settings_name_their_field(settings, message):
    with pytest.raises(ValueError, match=message):
        SearchConfig(**settings)


def test_a_space_is_checked_and_kept_as_specs():
    config = SearchConfig(space={"model.embedding_dim": [4, 8]}, fixed=[{"a": 1}])
    assert config.space == {"model.embedding_dim": {"type": "categorical",
                                                    "choices": [4, 8]}}
    assert config.fixed == ({"a": 1},)
    assert "sparse_optimizer.lr" in SearchConfig().search_space  # the model's default


def test_run_search_from_python_is_the_command_search(tmp_path):
    """The same data, settings and seed: ``run_search`` gives the command's best trial,
    values and validation value."""
    train, valid = tmp_path / "train.tsv", tmp_path / "valid.tsv"
    generate(train, 2000, model_seed=1, sample_seed=2)
    generate(valid, 500, model_seed=1, sample_seed=3)
    space = tmp_path / "space.json"
    space.write_text(json.dumps({"sparse_optimizer.lr": {"type": "float", "low": 0.01,
                                                         "high": 0.3, "log": True}}))
    out = tmp_path / "cli"
    assert main(["search", "--train", str(train), "--valid", str(valid), "--out", str(out),
                 "--trials", "3", "--sampler", "random", "--pruner", "none",
                 "--space", str(space), "--model", "lr", "--seed", "3", "--epochs", "2",
                 "--patience", "1", "--threads", "1", "--no-progress", "--no-refit"]) == 0
    results = json.loads((out / "results.json").read_text())
    saved = json.loads((out / "search.json").read_text())
    best = next(t for t in results["trials"] if t["trial"] == results["best_trial"])

    base = from_dict(TrainConfig, saved["config"])  # the sized defaults the command used
    schema = with_numeric_stats(FeatureSchema.criteo(), [train])
    batches = list(iter_file_batches([valid], schema, base.batch_size))
    config = SearchConfig(base=base, space=json.loads(space.read_text()), trials=3,
                          sampler="random", pruner="none", seed=3, patience=1,
                          first_rung=saved.get("first_rung", 1))
    result = run_search(config, schema, [train], batches, tmp_path / "py")
    assert isinstance(result, SearchResult)
    assert result.best is not None and result.best.number == results["best_trial"]
    assert result.best_params == {k.removeprefix("params."): v for k, v in best.items()
                                  if k.startswith("params.")}
    assert result.best_value == pytest.approx(best["value"], rel=1e-12)
    assert result.best_dir == tmp_path / "py" / "best"
    assert (result.best_dir / "metrics.json").exists()
    assert [r["value"] for r in result.rows()] == pytest.approx(
        [r["value"] for r in sorted(results["trials"], key=lambda r: r["trial"])],
        rel=1e-12)


def test_run_search_needs_validation_rows(tmp_path):
    with pytest.raises(ValueError, match="needs a validation set"):
        run_search(SearchConfig(), FeatureSchema.criteo(), [], [], tmp_path)
