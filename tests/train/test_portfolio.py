"""Settings chosen by validation (``train.portfolio``): a planted better setting is
chosen, the default is kept unless a challenger beats it beyond the validation AUC's
standard error, the race stays within its budget, ``--choose off`` trains what it did
before, and metrics.json records every candidate."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from terarec.cli.main import main
from terarec.config import TrainConfig
from terarec.data.numeric import with_numeric_stats
from terarec.data.synth import generate
from terarec.distributed.context import DistContext, resolve_device
from terarec.train.passes import iter_file_batches
from terarec.train.portfolio import (
    Candidate,
    Member,
    auc_standard_error,
    choose_settings,
    pick,
    portfolio,
    rungs,
)
from terarec.types import FeatureSchema

CPU = DistContext.single(resolve_device("cpu"))
# (the bucket prior given: its own race is tested in test_chosen_start.py)
FLAGS = ["--no-progress", "--threads", "1", "--seed", "3", "--model", "lr", "--bucket-l2", "0"]


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("portfolio")
    generate(root / "train.tsv", 3000, model_seed=1, sample_seed=2)
    generate(root / "valid.tsv", 1000, model_seed=1, sample_seed=3)
    return root / "train.tsv", root / "valid.tsv"


def _candidate(name: str, auc: float | None) -> Candidate:
    return Candidate(Member(name, {}), passes=1, valid_auc=auc)


def test_the_default_is_kept_unless_a_challenger_beats_it_beyond_the_standard_error() -> None:
    default, better = _candidate("default", 0.700), _candidate("better", 0.710)
    # 500 validation rows: the AUC's standard error (~0.025) hides a 0.01 gain
    chosen, se = pick([default, better], 120, 380)
    assert se == pytest.approx(auc_standard_error(0.7, 120, 380))
    assert 0.01 < se < 0.05 and chosen is default
    # 200,000 rows: the same gain is beyond the noise (~0.0013)
    chosen, se = pick([default, better], 48_000, 152_000)
    assert se is not None and se < 0.002 and chosen is better
    # of several challengers beyond the noise, the best; one without a finite AUC is not
    best = _candidate("best", 0.73)
    chosen, _ = pick([default, better, _candidate("nan", math.nan), best], 48_000, 152_000)
    assert chosen is best
    assert pick([default, _candidate("failed", None)], 48_000, 152_000)[0] is default


def test_standard_error_shrinks_with_rows_and_is_zero_at_a_perfect_auc() -> None:
    assert auc_standard_error(0.75, 100, 300) > auc_standard_error(0.75, 1000, 3000)
    assert auc_standard_error(1.0, 100, 300) == 0.0
    assert auc_standard_error(0.75, 0, 300) == math.inf


def test_rungs_halve_within_the_budget() -> None:
    assert rungs(7, 70) == [3, 8, 19]  # 7, 4, 2 live: 70 // 21, 70 // 12, 70 // 6 more
    assert rungs(1, 10) == [10]
    assert rungs(6, 2) == [1, 2, 3]  # at least one pass a round (the budget stops them)


def test_members_leave_given_keys_alone_and_skip_models_that_do_not_change() -> None:
    config = TrainConfig()
    names = [m.name for m in portfolio(config, set(), 2, 10_000)]
    assert names[0] == "default" and {"sparse-x3", "deep-x8", "patience-x3",
                                      "batch-x4", "wide", "dropout"} <= set(names)
    assert "admit-all" not in names  # the fixed admission admits every key already
    config.store.admit_min_count = 2
    assert "admit-all" in {m.name for m in portfolio(config, set(), 2, 10_000)}
    given = {m.name for m in portfolio(config, {"sparse_optimizer.lr", "patience"}, 2,
                                       10_000)}
    assert not given & {"sparse-x3", "fast", "patience-x3", "batch-x4"}
    assert {"deep-x8", "wide"} <= given
    # the epoch upper bound follows a member's batch size and patience
    batch = next(m for m in portfolio(config, set(), 2, 10_000) if m.name == "batch-x4")
    assert batch.params["batch_size"] == 4 * config.batch_size
    assert batch.params["epochs"] > TrainConfig().epochs


def _setup(files) -> tuple[FeatureSchema, TrainConfig, list]:
    train, valid = files
    schema = with_numeric_stats(FeatureSchema.criteo(), [train])
    config = TrainConfig()
    config.model.name = "lr"
    config.batch_size, config.pass_rows, config.threads, config.seed = 250, 1000, 1, 4
    config.epochs = 3
    batches = list(iter_file_batches([valid], schema, config.batch_size))
    return schema, config, batches


def test_a_planted_better_setting_is_chosen_within_the_budget(files, tmp_path) -> None:
    """The default learns at a thousandth of a useful rate: the member with the useful
    rate wins by far more than the noise; a worse one is raced and not chosen."""
    schema, config, batches = _setup(files)
    config.sparse_optimizer.lr = 1e-4
    members = [Member("default", {}), Member("slower", {"sparse_optimizer.lr": 1e-5}),
               Member("useful", {"sparse_optimizer.lr": 0.1})]
    choice = choose_settings(schema, config, members, [files[0]], batches, tmp_path / "c",
                             select_by="logloss", patience=2,
                             ctx=CPU)
    assert choice.chosen.member.name == "useful"
    by_name = {c.member.name: c for c in choice.candidates}
    assert choice.auc_standard_error is not None
    assert by_name["useful"].valid_auc > by_name["default"].valid_auc \
        + choice.auc_standard_error
    # budget: the challengers' passes and the default's, at most 3x the default's
    assert choice.default_passes == by_name["default"].passes >= 3
    assert choice.passes == sum(c.passes for c in choice.candidates)
    assert choice.passes <= choice.budget * choice.default_passes
    assert not (tmp_path / "c").exists()
    summary = choice.summary()
    assert summary["budget"]["used_x_default_run"] <= 3.0
    assert [c["name"] for c in summary["candidates"]] == ["default", "slower", "useful"]


def test_a_tighter_budget_trains_challengers_less(files, tmp_path) -> None:
    schema, config, batches = _setup(files)
    members = [Member("default", {}), Member("a", {"sparse_optimizer.lr": 0.2}),
               Member("b", {"sparse_optimizer.lr": 0.01})]
    choice = choose_settings(schema, config, members, [files[0]], batches, tmp_path / "c",
                             select_by="auc", patience=5, ctx=CPU, budget=1.5)
    d = choice.default_passes
    assert choice.passes <= 1.5 * d
    if d // 2 < 2:  # too few passes left for both challengers: none raced, and said so
        assert len(choice.candidates) == 1 and "notes" in choice.summary()
        return
    assert sum(c.passes for c in choice.candidates[1:]) <= d // 2
    assert all(c.stop_reason == "pruned" for c in choice.candidates[1:])


def test_a_longer_patience_goes_on_from_the_default_run(files, tmp_path) -> None:
    """The member that only waits longer is the default's run trained on: the default's
    figures are what it reaches alone, and the longer run stays within the budget."""
    schema, config, batches = _setup(files)
    config.epochs = 6
    default = Member("default", {})
    alone = choose_settings(schema, config, [default], [files[0]], batches, tmp_path / "a",
                            select_by="logloss", patience=1, ctx=CPU)
    longer = Member("patience-x3", {"epochs": 20}, patience=3)
    both = choose_settings(schema, config, [default, longer], [files[0]], batches,
                           tmp_path / "b", select_by="logloss", patience=1, ctx=CPU)
    first, wait = both.candidates
    assert first.passes == alone.candidates[0].passes == both.default_passes
    assert first.best_pass == alone.candidates[0].best_pass
    assert first.valid_auc == alone.candidates[0].valid_auc
    assert wait.member.name == "patience-x3" and wait.passes >= first.passes
    assert both.passes == wait.passes <= 3 * both.default_passes


def _train(files, out: Path, *extra: str) -> dict:
    train, valid = files
    assert main(["train", "--train", str(train), "--valid", str(valid), "--out", str(out),
                 "--patience", "1", *FLAGS, *extra]) == 0
    return json.loads((out / "metrics.json").read_text())


def _weights(out: Path) -> dict[str, bytes]:
    return {str(p.relative_to(out)): p.read_bytes()
            for p in sorted((out / "checkpoints").rglob("*.safetensors"))}


def test_choose_auto_records_candidates_and_off_trains_the_sized_default(
        files, tmp_path, capsys) -> None:
    assert "chosen_settings" not in _train(files, tmp_path / "plain")  # opt-in
    auto = _train(files, tmp_path / "auto", "--choose", "auto")
    chosen = auto["chosen_settings"]
    assert chosen["candidates"][0]["name"] == "default"
    for c in chosen["candidates"]:
        assert c["passes"] >= 1 and c["valid_auc"] is not None and "params" in c
    budget = chosen["budget"]
    assert budget["passes"] <= budget["limit_x_default_run"] * budget["default_passes"]
    assert budget["seconds"] > 0 and chosen["auc_standard_error"] > 0
    assert "settings chosen by validation" in capsys.readouterr().err
    assert not (tmp_path / "auto" / "choosing").exists()
    page = (tmp_path / "auto" / "report" / "report.html").read_text()
    assert "Settings chosen by validation" in page and "sparse-x3" in page
    off = _train(files, tmp_path / "off", "--choose", "off")
    assert "chosen_settings" not in off
    # 1,000 validation rows: no challenger beats the default beyond the noise here, so
    # both runs train the same model, byte for byte
    assert chosen["chosen"] == "default"
    assert _weights(tmp_path / "auto") == _weights(tmp_path / "off")
    assert _weights(tmp_path / "off")
    assert auto["best_value"] == off["best_value"]


def test_choose_needs_validation_rows(files, tmp_path, capsys) -> None:
    train, _ = files
    code = main(["train", "--train", str(train), "--out", str(tmp_path / "m"), "--choose",
                 "auto", "--valid-split", "0", *FLAGS])
    assert code != 0
    assert "--choose auto needs --valid" in capsys.readouterr().err


def test_fit_takes_choose(files, tmp_path) -> None:
    from terarec.api.fit import fit

    train, valid = files
    with pytest.raises(ValueError, match="--choose maybe: expected one of auto, off"):
        fit(train, valid, out=tmp_path / "bad", model="lr", choose="maybe")
    model = fit(train, valid, out=tmp_path / "off", model="lr", choose="off", epochs=1,
                threads=1, progress=False)
    metrics = json.loads((tmp_path / "off" / "metrics.json").read_text())
    assert "chosen_settings" not in metrics and model is not None
