"""Adagrad's start on small data chosen by validation: both starts trained side by side,
the one with the better validation value kept, and what each reached in metrics.json;
then the bucket prior against its absence with the chosen start; then, for the default
model, its first-order part alone against it; on larger data, the default model against its
first-order part at two starts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from terarec.cli.main import main
from terarec.config import TrainConfig
from terarec.data.synth import generate
from terarec.train import defaults
from terarec.train.cohort import apply_params
from terarec.train.defaults import (
    ACCUMULATOR_KEY,
    BUCKET_L2_KEY,
    DENSE_LR_KEY,
    FIRST_ORDER_STARTS,
    MODEL_KEY,
    SMALL_DATA_ACCUMULATOR_CHOICES,
    SMALL_DATA_BUCKET_L2_CHOICES,
    SMALL_DATA_MODEL_CHOICES,
    first_order_choices,
)

FLAGS = ["--no-progress", "--threads", "1", "--seed", "3", "--model", "lr"]


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("start")
    generate(root / "train.tsv", 1500, model_seed=1, sample_seed=2)
    generate(root / "valid.tsv", 500, model_seed=1, sample_seed=3)
    return root / "train.tsv", root / "valid.tsv"


def _train(files, out: Path, *extra: str, valid: bool = True) -> dict:
    train, held_out = files
    argv = ["train", "--train", str(train), "--out", str(out), *FLAGS, *extra]
    assert main([*argv, "--valid", str(held_out), "--patience", "1"] if valid else argv) == 0
    return json.loads((out / "metrics.json").read_text())


def test_the_start_with_the_better_validation_value_is_kept(files, tmp_path, capsys) -> None:
    metrics = _train(files, tmp_path / "m")
    choice, prior = metrics["chosen_by_validation"]
    assert choice["key"] == ACCUMULATOR_KEY
    tried = {v["value"]: v["best"] for v in choice["validation"]}
    assert sorted(tried) == sorted(SMALL_DATA_ACCUMULATOR_CHOICES)
    assert choice["chosen"] == min(tried, key=lambda v: tried[v])  # logloss: lower wins
    # The bucket prior raced with the chosen start; its absence is that start's run.
    assert prior["key"] == BUCKET_L2_KEY
    strengths = {v["value"]: v["best"] for v in prior["validation"]}
    assert sorted(strengths) == sorted(SMALL_DATA_BUCKET_L2_CHOICES)
    assert strengths[0.0] == tried[choice["chosen"]]
    assert strengths[1.0] != strengths[0.0]  # the prior changes what is learnt
    assert prior["chosen"] == min(strengths, key=lambda v: strengths[v])
    # The model trained is the chosen settings', from the same seed: the same best value.
    assert metrics["best_value"] == pytest.approx(strengths[prior["chosen"]], rel=1e-9)
    config = json.loads((tmp_path / "m" / "train_config.json").read_text())
    assert config["sparse_optimizer"]["initial_accumulator"] == choice["chosen"]
    assert config["sparse_optimizer"]["bucket_l2"] == prior["chosen"]
    assert not (tmp_path / "m" / "choosing").exists()  # the trials' folder is gone
    err = capsys.readouterr().err
    assert f"{ACCUMULATOR_KEY} chosen by validation logloss" in err
    assert f"{BUCKET_L2_KEY} chosen by validation logloss" in err
    # a given strength is not the data's to choose
    given = _train(files, tmp_path / "given", "--bucket-l2", "0.5")
    assert [c["key"] for c in given["chosen_by_validation"]] == [ACCUMULATOR_KEY]
    config = json.loads((tmp_path / "given" / "train_config.json").read_text())
    assert config["sparse_optimizer"]["bucket_l2"] == 0.5


def test_the_default_model_races_its_first_order_part(files, tmp_path, capsys) -> None:
    """Given no model, the default's run with the chosen start and prior stands for it;
    ``lr`` (its first-order part alone) trains beside it with the same values and the
    better validation value is the model trained; anything of the model given keeps it."""
    train, held_out = files
    base = ["train", "--train", str(train), "--valid", str(held_out), "--patience", "1",
            "--no-progress", "--threads", "1", "--seed", "3"]
    assert main([*base, "--out", str(tmp_path / "m")]) == 0
    metrics = json.loads((tmp_path / "m" / "metrics.json").read_text())
    *_, prior, model = metrics["chosen_by_validation"]
    assert prior["key"] == BUCKET_L2_KEY and model["key"] == MODEL_KEY
    reached = {v["value"]: v["best"] for v in model["validation"]}
    assert list(reached) == list(SMALL_DATA_MODEL_CHOICES)
    assert reached["deepfm"] == min(v["best"] for v in prior["validation"])
    assert reached["lr"] != reached["deepfm"]
    assert model["chosen"] == min(reached, key=lambda v: reached[v])
    assert metrics["best_value"] == pytest.approx(reached[model["chosen"]], rel=1e-9)
    config = json.loads((tmp_path / "m" / "train_config.json").read_text())
    assert config["model"]["name"] == model["chosen"]
    assert f"{MODEL_KEY} chosen by validation logloss (deepfm: " in capsys.readouterr().err
    # a width given is a DeepFM asked for (a name given is tested with --model lr above)
    assert main([*base, "--out", str(tmp_path / "w"), "--embedding-dim", "8"]) == 0
    chosen = json.loads((tmp_path / "w" / "metrics.json").read_text())["chosen_by_validation"]
    assert MODEL_KEY not in [c["key"] for c in chosen]
    assert json.loads((tmp_path / "w" / "train_config.json").read_text())["model"]["name"] \
        == "deepfm"


def test_no_choice_when_the_start_is_given_or_there_is_no_validation(files, tmp_path) -> None:
    given = _train(files, tmp_path / "given", "--sparse-initial-accumulator", "0")
    assert "chosen_by_validation" not in given
    config = json.loads((tmp_path / "given" / "train_config.json").read_text())
    assert config["sparse_optimizer"]["initial_accumulator"] == 0.0
    alone = _train(files, tmp_path / "alone", "--epochs", "1", valid=False)
    assert "chosen_by_validation" not in alone
    fixed = _train(files, tmp_path / "fixed", "--batch-size", "512")  # the fixed start
    assert "chosen_by_validation" not in fixed


def _search(files, out: Path, *extra: str, trials: int = 3) -> dict:
    train, held_out = files
    assert main(["search", "--train", str(train), "--valid", str(held_out), "--out", str(out),
                 "--trials", str(trials), "--sampler", "random", "--pruner", "none",
                 "--patience", "1",
                 "--no-refit", *FLAGS, *extra]) == 0
    return json.loads((out / "search.json").read_text())


def _search_default_model(files, out: Path, trials: int) -> dict:
    """A search given no model (``FLAGS`` give ``lr``): its search.json."""
    train, held_out = files
    assert main(["search", "--train", str(train), "--valid", str(held_out),
                 "--out", str(out), "--trials", str(trials), "--sampler", "random",
                 "--pruner", "none", "--patience", "1", "--no-refit", "--no-progress",
                 "--threads", "1", "--seed", "3"]) == 0
    return json.loads((out / "search.json").read_text())


def test_search_tries_both_starts_where_train_would_choose(files, tmp_path) -> None:
    """The default space holds the start where ``train`` would choose it, so a search's
    trials can reach what ``train`` reaches; a given start or batch leaves it out."""
    space = _search(files, tmp_path / "s")["space"]
    assert space[ACCUMULATOR_KEY]["choices"] == list(SMALL_DATA_ACCUMULATOR_CHOICES)
    assert space[BUCKET_L2_KEY]["choices"] == list(SMALL_DATA_BUCKET_L2_CHOICES)
    results = json.loads((tmp_path / "s" / "results.json").read_text())
    starts = {t[f"params.{ACCUMULATOR_KEY}"] for t in results["trials"]}
    assert starts == set(SMALL_DATA_ACCUMULATOR_CHOICES)
    # the first trials are what ``train`` runs, with each start
    config = json.loads((tmp_path / "s" / "search.json").read_text())["config"]
    first = sorted((t for t in results["trials"] if t["trial"] < 2), key=lambda t: t["trial"])
    assert [t[f"params.{ACCUMULATOR_KEY}"] for t in first] == \
        list(SMALL_DATA_ACCUMULATOR_CHOICES)
    for t in first:
        assert t[f"params.{BUCKET_L2_KEY}"] == 0.0  # then the prior with each start
        assert t["params.sparse_optimizer.lr"] == config["sparse_optimizer"]["lr"]
        assert t["params.dense_optimizer.lr"] == config["dense_optimizer"]["lr"]
    for extra in (["--sparse-initial-accumulator", "0.01"], ["--batch-size", "512"]):
        out = tmp_path / extra[0].strip("-")
        assert ACCUMULATOR_KEY not in _search(files, out, *extra, trials=1)["space"]


def test_search_races_lr_beside_the_default_model_as_train_does(files, tmp_path) -> None:
    """Given no model, the space holds ``lr`` beside DeepFM with a dense-rate range that
    holds each one's own sized rate, and the first trials pair each start with both
    models, ``lr`` at its own rate, as ``train``'s race does."""
    from terarec.train.defaults import model_choices

    search = _search_default_model(files, tmp_path / "s", trials=2)
    space = search["space"]
    assert space[MODEL_KEY]["choices"] == list(SMALL_DATA_MODEL_CHOICES)
    rates = model_choices(SMALL_DATA_ACCUMULATOR_CHOICES, set(), "deepfm",
                          search["config"].get("estimated_rows", 1500))
    assert rates is not None
    for rate in (r[DENSE_LR_KEY] for r in rates.values()):
        assert space[DENSE_LR_KEY]["low"] < rate < space[DENSE_LR_KEY]["high"]
    results = json.loads((tmp_path / "s" / "results.json").read_text())
    first = sorted(results["trials"], key=lambda t: t["trial"])
    assert [t[f"params.{MODEL_KEY}"] for t in first] == ["deepfm", "lr"]
    assert first[0][f"params.{ACCUMULATOR_KEY}"] == first[1][f"params.{ACCUMULATOR_KEY}"]
    assert first[1][f"params.{DENSE_LR_KEY}"] == pytest.approx(
        search["config"]["dense_optimizer"]["lr"] * 8)  # DeepFM's is an eighth of lr's
    assert all(t["state"] == "complete" and t["value"] is not None for t in first)
    assert first[0]["value"] != first[1]["value"]  # two models trained, not one twice


def test_larger_data_races_the_first_order_part_at_two_starts(files, tmp_path, capsys,
                                                              monkeypatch) -> None:
    """From SMALL_DATA_ROWS rows on (lowered here so the test's rows count as larger
    data) the default model as sized races ``lr`` at each of FIRST_ORDER_STARTS; the
    best validation value is the model trained, with its start and dense rate."""
    monkeypatch.setattr(defaults, "SMALL_DATA_ROWS", 1000)
    train, held_out = files
    base = ["train", "--train", str(train), "--valid", str(held_out), "--patience", "1",
            "--no-progress", "--threads", "1", "--seed", "3"]
    assert main([*base, "--out", str(tmp_path / "m")]) == 0
    metrics = json.loads((tmp_path / "m" / "metrics.json").read_text())
    [choice] = metrics["chosen_by_validation"]
    assert choice["key"] == MODEL_KEY
    reached = {v["value"]: v["best"] for v in choice["validation"]}
    names = ["deepfm", *(f"lr (start {s:g})" for s in FIRST_ORDER_STARTS)]
    assert list(reached) == names
    assert len(set(reached.values())) == 3  # the start changes what lr learns
    assert choice["chosen"] == min(reached, key=lambda v: reached[v])
    assert metrics["best_value"] == pytest.approx(reached[choice["chosen"]], rel=1e-9)
    config = json.loads((tmp_path / "m" / "train_config.json").read_text())
    members = first_order_choices({"estimated_rows": 1500, DENSE_LR_KEY: 1.0}, set(),
                                  TrainConfig())
    assert members is not None and list(members) == names
    want = members[choice["chosen"]]
    assert config["model"]["name"] == want.get(MODEL_KEY, "deepfm")
    if choice["chosen"] != "deepfm":
        assert config["sparse_optimizer"]["initial_accumulator"] == want[ACCUMULATOR_KEY]
        assert config["dense_optimizer"]["lr"] == want[DENSE_LR_KEY]
    assert not (tmp_path / "m" / "choosing").exists()
    assert f"{MODEL_KEY} chosen by validation logloss (deepfm: " in capsys.readouterr().err
    # a model given trains it alone
    assert main([*base, "--out", str(tmp_path / "given"), "--model", "deepfm"]) == 0
    assert "chosen_by_validation" not in json.loads(
        (tmp_path / "given" / "metrics.json").read_text())


@pytest.mark.parametrize("sized, given, config", [
    ({"estimated_rows": 99, DENSE_LR_KEY: 1.0}, set(), TrainConfig()),  # small data's race
    ({"estimated_rows": 10**8, DENSE_LR_KEY: 1.0}, set(), TrainConfig()),  # above the bound
    ({"estimated_rows": 10**6}, set(), TrainConfig()),  # a schedule given
    ({"estimated_rows": 10**6, DENSE_LR_KEY: 1.0}, {ACCUMULATOR_KEY}, TrainConfig()),
    ({"estimated_rows": 10**6, DENSE_LR_KEY: 1.0}, {"model.dropout"}, TrainConfig()),
    ({"estimated_rows": 10**6, DENSE_LR_KEY: 1.0}, set(),
     apply_params(TrainConfig(), {"sparse_optimizer.name": "sgd"})),
])
def test_no_first_order_race_where_the_data_does_not_choose(sized, given, config) -> None:
    assert first_order_choices(sized, given, config) is None


def test_search_on_larger_data_starts_with_trains_race(files, tmp_path, monkeypatch) -> None:
    """On larger data (the bound lowered as above) the default space holds ``lr`` and
    the starts, and the first trials are ``train``'s race: DeepFM as sized, then ``lr``
    at each start with its own rate."""
    monkeypatch.setattr(defaults, "SMALL_DATA_ROWS", 1000)
    search = _search(files, tmp_path / "s", "--model", "deepfm", trials=1)
    assert MODEL_KEY not in search["space"]  # a model given is the search's model
    search = _search_default_model(files, tmp_path / "d", trials=3)
    space, config = search["space"], search["config"]
    assert space[MODEL_KEY]["choices"] == ["deepfm", "lr"]
    start = config["sparse_optimizer"]["initial_accumulator"]
    assert space[ACCUMULATOR_KEY]["choices"] == list(dict.fromkeys([start, *FIRST_ORDER_STARTS]))
    results = json.loads((tmp_path / "d" / "results.json").read_text())
    first = sorted(results["trials"], key=lambda t: t["trial"])
    assert [(t[f"params.{MODEL_KEY}"], t[f"params.{ACCUMULATOR_KEY}"]) for t in first] == \
        [("deepfm", start), *(("lr", s) for s in FIRST_ORDER_STARTS)]
    assert first[1][f"params.{DENSE_LR_KEY}"] == pytest.approx(
        config["dense_optimizer"]["lr"] * 8)
    assert len({t["value"] for t in first}) == 3
