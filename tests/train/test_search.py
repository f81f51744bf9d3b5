"""``terarec search``: trials trained together equal separate ``train`` runs, pruned
trials lose their rows, the budget is split, outputs are written and the best trial's
directory exports and predicts."""

from __future__ import annotations

import csv
import gc
import json
import weakref
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from terarec.cli.main import main
from terarec.config import ModelConfig, TrainConfig
from terarec.data.numeric import with_numeric_stats
from terarec.data.synth import generate
from terarec.embedding.shared import SharedRowsStore
from terarec.modeldir import read_model_meta
from terarec.models.registry import build_model
from terarec.train.cohort import apply_params
from terarec.train.defaults import estimate_rows
from terarec.train.passes import iter_file_batches
from terarec.train.search import SearchConfig, run_search
from terarec.train.search.samplers import first_rung
from terarec.train.search.space import check_space, default_space, grid_space, load_space
from terarec.types import FeatureSchema

COMMON = ["--batch-size", "500", "--pass-rows", "2000", "--threads", "1", "--no-progress",
          "--seed", "4", "--epochs", "2", "--patience", "2"]
# Two trials that differ in embedding width, learning rates, dropout and batch size.
TRIALS = [
    {"model.embedding_dim": 4, "sparse_optimizer.lr": 0.05, "dense_optimizer.lr": 0.002,
     "model.dropout": 0.2, "batch_size": 500},
    {"model.embedding_dim": 8, "sparse_optimizer.lr": 0.1, "dense_optimizer.lr": 0.001,
     "model.dropout": 0.0, "batch_size": 250},
]
FLAGS = {"model.embedding_dim": "--embedding-dim", "sparse_optimizer.lr": "--sparse-lr",
         "dense_optimizer.lr": "--dense-lr", "batch_size": "--batch-size"}


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("search")
    generate(root / "train.tsv", 8000, model_seed=2, sample_seed=5)
    generate(root / "valid.tsv", 2000, model_seed=2, sample_seed=6)
    return root / "train.tsv", root / "valid.tsv"


@pytest.fixture(scope="module")
def searched(files, tmp_path_factory) -> Path:
    train, valid = files
    out = tmp_path_factory.mktemp("run") / "search"
    # The two trials' values are enqueued (``fixed``), the space holds both values of each.
    # ``train`` standardises numerics with statistics of the training rows: so do the trials.
    schema = with_numeric_stats(FeatureSchema.criteo(), [train])
    config = TrainConfig()
    config.batch_size, config.pass_rows, config.threads, config.seed = 500, 2000, 1, 4
    config.epochs = 2
    batches = list(iter_file_batches([valid], schema, 500))
    space = check_space({k: sorted({t[k] for t in TRIALS}) for k in TRIALS[0]}, config)
    settings = SearchConfig(base=config, trials=2, pruner="none", sampler="random",
                            fixed=TRIALS, space=space, patience=2,
                            rows=estimate_rows([train]))  # patience counts epochs, as train's
    result = run_search(settings, schema, [train], batches, out)
    from terarec.train.search.results import write_results, write_search_report

    write_results(result, out)
    write_search_report(result, out)
    return out


def _single(files, out: Path, params: dict,
            extra: tuple[str, ...] = ("--admit-min-count", "1")) -> list[dict]:
    """``train`` with ``params`` as flags; ``extra``: store flags (by default those of
    the fixture's TrainConfig, which admits every key)."""
    train, valid = files
    flags = [*COMMON, "--model", "deepfm", *extra]
    for key, value in params.items():
        if key in FLAGS:
            flags += [FLAGS[key], str(value)]
    if params.get("model.dropout"):
        cfg = out.parent / f"{out.name}.json"
        cfg.write_text(json.dumps({"model": {"dropout": params["model.dropout"]},
                                   "epochs": 2}))
        flags += ["--config", str(cfg)]
    assert main(["train", "--train", str(train), "--valid", str(valid), "--out", str(out),
                 *flags]) == 0
    return json.loads((out / "history.json").read_text())


def test_k2_search_equals_two_single_train_runs(files, searched, tmp_path):
    results = json.loads((searched / "results.json").read_text())
    by_trial = {r["trial"]: r for r in results["trials"]}
    for number, params in enumerate(TRIALS):
        single = _single(files, tmp_path / f"single{number}", params)
        trial = json.loads((searched / "trials" / f"trial-{number:03d}" /
                            "history.json").read_text())
        assert [h["valid_auc"] for h in trial] == pytest.approx(
            [h["valid_auc"] for h in single], abs=1e-9)
        assert [h["train_loss"] for h in trial] == pytest.approx(
            [h["train_loss"] for h in single], abs=1e-9)
        assert by_trial[number]["state"] == "complete"
    best = results["best_trial"]
    mine = load_file(str(next((searched / "best" / "checkpoints").glob(
        "pass-*/dense.safetensors"))))
    single_dir = tmp_path / f"single{best}"
    name = (single_dir / "BEST").read_text()
    theirs = load_file(str(single_dir / "checkpoints" / name / "dense.safetensors"))
    assert mine.keys() == theirs.keys()
    for key in mine:
        assert (mine[key] == theirs[key]).all(), key


def test_results_report_and_best_directory(files, searched, tmp_path):
    _, valid = files
    results = json.loads((searched / "results.json").read_text())
    assert len(results["trials"]) == 2 and results["trials"][0]["trial"] == \
        results["best_trial"]
    with open(searched / "results.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert [int(r["trial"]) for r in rows] == [r["trial"] for r in results["trials"]]
    assert "params.model.embedding_dim" in rows[0]
    page = (searched / "report.html").read_text()
    assert "trials.png" in page and "importance.png" in page
    assert (searched / "trials.png").stat().st_size > 1000
    # the best trial is an ordinary model directory: eval, predict and export take it
    best = searched / "best"
    # holding the one checkpoint it was picked by (its later passes are not copied)
    picked = f"pass-{results['trials'][0]['best_pass']:06d}"
    assert [c.name for c in (best / "checkpoints").iterdir()] == [picked]
    assert (best / "BEST").read_text().strip() == (best / "LATEST").read_text().strip() \
        == picked
    assert not list((searched / "trials").glob("trial-*/checkpoints"))
    out = tmp_path / "eval.json"
    assert main(["eval", "--model", str(best), "--data", str(valid), "--out", str(out)]) == 0
    value = results["trials"][0]["value"]
    assert json.loads(out.read_text())["logloss"] == pytest.approx(value, rel=1e-6)
    scores = tmp_path / "scores.txt"
    assert main(["predict", "--model", str(best), "--data", str(valid),
                 "--out", str(scores)]) == 0
    assert len(scores.read_text().split()) == 2000
    assert main(["export", "--model", str(best), "--out", str(tmp_path / "exp")]) == 0
    assert list((tmp_path / "exp").glob("v*/manifest.json"))


def test_unpruned_fixed_trials_train_to_their_own_stop(files, tmp_path):
    """The first ``unpruned`` fixed trials (``train``'s own runs in a default search) are
    never pruned: the same trials that halving prunes otherwise train on."""
    train, valid = files
    schema = with_numeric_stats(FeatureSchema.criteo(), [train])
    config = TrainConfig()
    config.batch_size, config.pass_rows, config.threads, config.seed = 500, 2000, 1, 4
    config.epochs = 1
    batches = list(iter_file_batches([valid], schema, 500))
    space = {"sparse_optimizer.lr": {"type": "float", "low": 0.001, "high": 0.5, "log": True}}
    lrs = [{"sparse_optimizer.lr": v} for v in (0.5, 0.001, 0.2, 0.002)]

    def states(unpruned: int, out: str) -> list[str]:
        settings = SearchConfig(base=config, trials=4, sampler="random", pruner="halving",
                                patience=None, space=space, fixed=lrs, unpruned=unpruned)
        result = run_search(settings, schema, [train], batches, tmp_path / out)
        return [t.state for t in sorted(result.trials, key=lambda t: t.number)]

    assert "pruned" in states(0, "halved")
    assert states(4, "kept") == ["complete"] * 4
    with pytest.raises(ValueError, match="unpruned 5"):
        SearchConfig(base=config, trials=4, space=space, fixed=lrs, unpruned=5)


def test_pruned_trials_rows_are_freed_and_budget_resplit(files, tmp_path):
    train, valid = files
    # ``train`` standardises numerics with statistics of the training rows: so do the trials.
    schema = with_numeric_stats(FeatureSchema.criteo(), [train])
    config = TrainConfig()
    config.batch_size, config.pass_rows, config.threads, config.seed = 500, 2000, 1, 4
    config.epochs, config.store.memory_budget = 1, "32MB"
    batches = list(iter_file_batches([valid], schema, 500))
    seen: dict[int, list] = {}
    refs: dict[int, weakref.ref] = {}

    def boundary(trials) -> None:
        for t in trials:
            store = t.run.trainer.store
            refs.setdefault(t.number, weakref.ref(store))
            seen.setdefault(t.number, []).append(
                (t.state, len(store), getattr(store, "budget", None)))

    settings = SearchConfig(base=config, trials=4, sampler="random", pruner="halving",
                            patience=None,
                            space={"sparse_optimizer.lr": {"type": "float", "low": 0.001,
                                                           "high": 0.5, "log": True}})
    result = run_search(settings, schema, [train], batches, tmp_path / "s",
                        on_boundary=boundary)
    pruned = [t for t in result.trials if t.state == "pruned"]
    assert pruned, "successive halving prunes some of 4 trials by the 3rd pass"
    budget = 32 << 20
    for t in result.trials:
        states = seen[t.number]
        assert t.config.store.memory_budget == budget // 4  # split across 4 at the start
        if t.state == "pruned":
            assert len(t.run.trainer.store) == 0
            assert not (t.model_dir / "store").exists()  # its disk tier is gone too
            at = next(i for i, s in enumerate(states) if s[0] == "pruned")
            assert all(keys == 0 for _, keys, _ in states[at:])
            assert len(t.history) == at + 1  # no pass trained after it was pruned
    # after a pruning, the live trials share the whole budget
    for states in seen.values():
        for i, (state, _, b) in enumerate(states):
            live = sum(seen[n][i][0] == "running" for n in seen if i < len(seen[n]))
            if state == "running" and b is not None and live:
                assert b == budget // live
    # out/best is a model directory of its own: the run's budget, not a trial's share
    _, best_config = read_model_meta(result.best_dir)
    assert best_config.store.memory_budget in ("32MB", budget)
    assert best_config.store.disk_path is None
    gc.collect()
    later = [t for t in pruned if seen[t.number][0][0] == "running"]
    assert all(refs[t.number]() is None for t in later), "pruned rows still referenced"


def _setup(files, epochs: int, admit_min_count: int
           ) -> tuple[FeatureSchema, TrainConfig, list]:
    """The schema (numerics standardised by the training rows, as ``train`` does), the
    base configuration and the validation batches the in-process searches use."""
    train, valid = files
    schema = with_numeric_stats(FeatureSchema.criteo(), [train])
    config = TrainConfig()
    config.batch_size, config.pass_rows, config.threads, config.seed = 500, 2000, 1, 4
    config.epochs, config.store.admit_min_count = epochs, admit_min_count
    return schema, config, list(iter_file_batches([valid], schema, 500))


def test_a_diverged_trial_stops_and_the_others_train_on(files, tmp_path):
    """A trial whose weights go non-finite mid-search (here poisoned after its first pass)
    stops as ``diverged`` with its best pass kept; no checkpoint of a non-finite model is
    written, and the other trial trains to the end as it would alone."""
    train, _ = files
    schema, config, batches = _setup(files, epochs=2, admit_min_count=1)
    fixed = [{"model.embedding_dim": 4}, {"model.embedding_dim": 8}]
    space = check_space({"model.embedding_dim": [4, 8]}, config)

    def poison(trials) -> None:
        t = trials[0]
        if t.state == "running" and len(t.trainer.history) == 1:
            with torch.no_grad():
                for weight in t.trainer.model.parameters():
                    weight.fill_(float("nan"))

    def search(out: Path, on_boundary=None):
        settings = SearchConfig(base=config, trials=2, pruner="none", sampler="random",
                                fixed=fixed, space=space, patience=None)
        return run_search(settings, schema, [train], batches, out, on_boundary=on_boundary)

    whole = {t.number: t for t in search(tmp_path / "whole").trials}
    result = search(tmp_path / "poisoned", on_boundary=poison)
    bad, good = sorted(result.trials, key=lambda t: t.number)
    assert bad.stop_reason == "diverged" and bad.state == "complete"
    assert len(bad.history) == 2 and bad.selection.best_pass == 1  # its first pass
    assert bad.selection.best_value == whole[0].history[0]["valid_logloss"]
    assert good.stop_reason == "epochs_exhausted"
    assert [h["valid_logloss"] for h in good.history] == pytest.approx(
        [h["valid_logloss"] for h in whole[1].history], abs=1e-12)
    rows = json.loads((tmp_path / "poisoned" / "trials" / "trial-000" / "history.json"
                       ).read_text())
    assert rows[-1]["stop_reason"] == "diverged"


def test_space_errors_name_the_parameter(tmp_path, capsys):
    config = TrainConfig()
    with pytest.raises(ValueError, match="model.embeding_dim: no such config field"):
        check_space({"model.embeding_dim": [4, 8]}, config)
    with pytest.raises(ValueError, match="sparse_optimizer.lr: log scale needs low > 0"):
        check_space({"sparse_optimizer.lr": {"type": "float", "low": 0, "high": 1,
                                             "log": True}}, config)
    with pytest.raises(ValueError, match="grid sampler: dense_optimizer.lr"):
        grid_space(check_space({"dense_optimizer.lr": {"type": "float", "low": 1e-4,
                                                       "high": 1e-2}}, config))
    bad = tmp_path / "space.json"
    bad.write_text('{"batch_size": {"type": "int", "low": 512}}')
    data, valid = tmp_path / "d.tsv", tmp_path / "v.tsv"
    generate(data, 200, model_seed=0, sample_seed=1)
    generate(valid, 100, model_seed=0, sample_seed=2)
    assert main(["search", "--train", str(data), "--valid", str(valid),
                 "--out", str(tmp_path / "o"), "--space", str(bad)]) == 2
    assert "space.json: batch_size: int needs a finite number 'high'" in capsys.readouterr().err
    assert apply_params(config, {"model.embedding_dim": 32}).model.embedding_dim == 32


SPACE_VALUE_ERRORS = [
    ({"model.name": ["deepfm", "bogus"]},  # was found only when a trial drew it
     "model.name: choice 'bogus': model.name: unknown model 'bogus'"),
    ({"model.embedding_dim": [4, "8"]},
     "model.embedding_dim: choice '8': model.embedding_dim must be an integer"),
    ({"model.dropout": [0.0, 1.5]}, "model.dropout: choice 1.5: model.dropout: 1.5 must be < 1"),
    ({"batch_size": {"type": "float", "low": 256, "high": 1024}},
     "batch_size: a value inside the range 640.768: batch_size must be an integer"),
    ({"sparse_optimizer.lr": {"type": "float", "low": 0.01, "high": float("inf")}},
     "sparse_optimizer.lr: float needs a finite number 'high', got inf"),
    ({"sparse_optimizer.lr": {"type": "float", "low": 0.01, "high": 0.1, "lgo": True}},
     "sparse_optimizer.lr: unknown key(s) ['lgo'] for type float"),
    ({"sparse_optimizer.lr": {"type": "float", "low": 0.01, "high": 0.1, "step": 0}},
     "sparse_optimizer.lr: step must be a number > 0, got 0"),
    ({"batch_size": {"type": "int", "low": 256.5, "high": 1024}},
     "batch_size: int needs integer low, high and step"),
    ({"model": [1, 2]}, "model: a section, not a field; name one of its fields: model.name"),
    # a parameter no trial reads: its trials trained alike (``train`` refuses the key)
    ({"model.cross_layers": [1, 2]}, "model.cross_layers: only model dcnv2 reads it, this "
                                     "search's is deepfm"),
    ({"sparse_optimizer.beta1": [0.8, 0.9]}, "sparse_optimizer.beta1: only sparse optimizer "
                                             "adam reads it, this search's is adagrad"),
    ({"model.name": ["lr", "fm"], "model.dropout": [0.0, 0.1]},
     "model.dropout: only model widedeep / deepfm / dcnv2 / dlrm / dssm / din / seqpool / "
     "sharedbottom / mmoe / esmm reads it, this search's are fm, lr"),
]


@pytest.mark.parametrize("data,message", SPACE_VALUE_ERRORS,
                         ids=[next(iter(d)) + str(i) for i, (d, _) in
                              enumerate(SPACE_VALUE_ERRORS)])
def test_space_values_are_checked_like_a_config_file(tmp_path, data, message):
    """Every value a trial can get is validated when the space is read: a bad choice, a
    float range on an integer field or an infinite bound failed mid-search (after the
    data was read and the study journal written) without naming the space file, or with
    a traceback from optuna."""
    path = tmp_path / "space.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError) as err:
        load_space(path, TrainConfig())
    assert str(err.value).startswith(f"{path}: {message}")


@pytest.mark.parametrize("name,text,message", [
    ("space.json", '{"model.embedding_dim": [4, 8], "model.embedding_dim": [16]}',
     "model.embedding_dim: key given twice in one object; keep one"),
    ("space.json", '{"batch_size": {"type": "int", "low": 256, "high": 1024, "low": 512}}',
     "batch_size.low: key given twice in one object; keep one"),
])
def test_a_key_given_twice_in_a_space_file_is_refused(tmp_path, name, text, message):
    """The parsers keep the last of a repeated key: the first was silently dropped from
    the space (a config file refuses the same)."""
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ValueError) as err:
        load_space(path, TrainConfig())
    assert str(err.value) == f"{path}: {message}"


def test_an_unreadable_or_broken_space_file_is_one_line_naming_it(tmp_path):
    with pytest.raises(ValueError, match=f"^{tmp_path}: cannot read search space: Is a "
                       "directory$"):
        load_space(tmp_path, TrainConfig())
    bad = tmp_path / "space.json"
    bad.write_text('{"model.embedding_dim": [4, 8\n')
    with pytest.raises(ValueError) as err:
        load_space(bad, TrainConfig())
    assert str(err.value) == f"{bad}: not valid JSON (line 2: Expecting ',' delimiter)"


@pytest.mark.parametrize("name", ["space.yaml", "space.yml"])
def test_a_yaml_space_is_refused_as_such_and_json_in_it_read(tmp_path, name):
    """A search space is JSON, as a config file is: YAML is refused naming the file
    rather than failing as "expected value at line 1 column 1"."""
    path = tmp_path / name
    path.write_text("model.embedding_dim: [4, 8]\n")
    with pytest.raises(ValueError) as err:
        load_space(path, TrainConfig())
    assert str(err.value).startswith(f"{path}: a search space is JSON, not YAML: write the "
                                     "same keys as a JSON object")
    path.write_text('{"model.embedding_dim": [4, 8]}')
    assert load_space(path, TrainConfig())["model.embedding_dim"]["choices"] == [4, 8]


@pytest.mark.parametrize(("flags", "message"), [
    (["--trials", "2", "--parallel", "0"], "--parallel 0: must be >= 1 (leave it out for all)"),
    (["--trials", "2", "--parallel", "-1"], "--parallel -1: must be >= 1 (leave it out for all)"),
    (["--trials", "0"], "--trials 0: must be >= 1"),
    (["--checkpoint-every", "0"], "--checkpoint-every 0: must be >= 1"),
    (["--prune-after", "0"], "--prune-after 0: must be >= 1")])
def test_trials_or_parallel_below_one_is_refused(files, tmp_path, capsys, flags, message):
    """--parallel 0 silently trained every trial at once; -1 failed with "run_passes needs
    at least one trial". The message named the arguments, not the flags."""
    train, valid = files
    out = tmp_path / "s"
    assert main(["search", "--train", str(train), "--valid", str(valid), "--out", str(out),
                 *COMMON, *flags]) == 2
    assert capsys.readouterr().err.strip().endswith(f"terarec search: error: {message}")
    assert not (out / "study.journal").exists()


def test_a_width_from_the_space_keeps_dlrms_bottom_mlp_ending_at_it():
    """DLRM dots its bottom MLP's output with the rows: every width of its default space
    must build (it failed with 4 and 8 against the (64, 16) bottom MLP)."""
    base = TrainConfig(model=ModelConfig(name="dlrm"))
    for width in default_space("dlrm")["model.embedding_dim"]["choices"]:
        config = apply_params(base, {"model.embedding_dim": width})
        assert config.model.bottom_mlp == (64, width)
        build_model(FeatureSchema.criteo(), config.model)
    given = apply_params(base, {"model.embedding_dim": 8, "model.bottom_mlp": [32, 8]})
    assert given.model.bottom_mlp == (32, 8)  # a bottom MLP from the space is its own
    deepfm = apply_params(TrainConfig(), {"model.embedding_dim": 8})
    assert deepfm.model.bottom_mlp == TrainConfig().model.bottom_mlp  # not dlrm: untouched


def test_grid_sampler_from_a_space_file_tries_each_point_once(files, tmp_path):
    train, valid = files
    space = tmp_path / "grid.json"
    space.write_text('{"model.embedding_dim": [4, 8], "sparse_optimizer.lr": [0.05, 0.1]}')
    out = tmp_path / "grid"
    assert main(["search", "--train", str(train), "--valid", str(valid), "--out", str(out),
                 "--batch-size", "500", "--pass-rows", "4000", "--threads", "1",
                 "--no-progress", "--epochs", "1", "--trials", "6", "--sampler", "grid",
                 "--pruner", "none", "--space", str(space)]) == 0
    rows = json.loads((out / "results.json").read_text())["trials"]
    points = sorted((r["params.model.embedding_dim"], r["params.sparse_optimizer.lr"])
                    for r in rows)
    assert points == [(4, 0.05), (4, 0.1), (8, 0.05), (8, 0.1)]  # 6 asked, 4 points
    assert all(r["state"] == "complete" for r in rows)


def test_trials_share_one_key_index_and_pruned_views_are_dropped(files, tmp_path):
    train, _ = files
    schema, config, batches = _setup(files, epochs=1, admit_min_count=2)
    sides: list[set[int]] = []
    live_bytes: list[tuple[int, int, int]] = []

    def boundary(trials) -> None:
        live = [t for t in trials if t.state == "running"]
        stores = [t.run.trainer.store for t in live]
        assert all(isinstance(s, SharedRowsStore) for s in stores)
        sides.append({id(s.shared) for s in stores})
        if stores:
            # K views: K x (values + optimizer state); the index, counts and candidates once
            own = sum(s.nbytes for s in stores)
            side = stores[0].shared.nbytes
            live_bytes.append((own, side, len(stores)))
        for t in trials:
            if t.state == "pruned":
                assert not isinstance(t.run.trainer.store, SharedRowsStore)
                assert len(t.run.trainer.store) == 0

    settings = SearchConfig(base=config, trials=4, sampler="random", pruner="halving",
                            patience=None,
                            space=check_space({"model.embedding_dim": [4, 8, 16]}, config))
    result = run_search(settings, schema, [train], batches, tmp_path / "s",
                        on_boundary=boundary)
    assert any(t.state == "pruned" for t in result.trials)
    assert all(len(s) <= 1 for s in sides) and sides[0]
    own, side, k = live_bytes[0]
    assert k >= 2 and side > 0 and own > 0
    keys = result.trials[0].history[0]["store_keys"]
    assert side >= keys * 16  # the index: one bucket (16 B) per key at most half full


@pytest.mark.slow
def test_k2_search_with_admission_and_eviction_equals_two_single_runs(files, tmp_path):
    """The shared key index admits (a key needs 2 shows) and evicts (unseen for 1 pass)
    once for both trials: each still trains as it would alone."""
    train, valid = files
    schema = with_numeric_stats(FeatureSchema.criteo(), [train])
    config = TrainConfig()
    config.batch_size, config.pass_rows, config.threads, config.seed = 500, 2000, 1, 4
    config.epochs, config.store.admit_min_count, config.store.evict_after_passes = 2, 2, 1
    batches = list(iter_file_batches([valid], schema, 500))
    space = check_space({k: sorted({t[k] for t in TRIALS}) for k in TRIALS[0]}, config)
    out = tmp_path / "search"
    settings = SearchConfig(base=config, trials=2, pruner="none", sampler="random",
                            fixed=TRIALS, space=space, patience=2,
                            rows=estimate_rows([train]))  # patience counts epochs, as train's
    result = run_search(settings, schema, [train], batches, out)
    assert all(t.state == "complete" for t in result.trials)
    for number, params in enumerate(TRIALS):
        single = _single(files, tmp_path / f"single{number}", params,
                         ("--admit-min-count", "2", "--evict-after-passes", "1"))
        trial = json.loads((out / "trials" / f"trial-{number:03d}" /
                            "history.json").read_text())
        assert any(h["evicted_keys"] for h in single)
        # new_keys: what inspect shows per pass; the later trial counted none (the first
        # trial's pull admits the shared keys for both).
        for key in ("valid_auc", "train_loss", "admitted_keys", "evicted_keys",
                    "store_keys", "new_keys", "rejected_keys"):
            assert [h[key] for h in trial] == [h[key] for h in single], key


def test_a_trials_rng_state_restores_its_stream():
    """What the pass loop swaps in around a trial's pass: restoring a captured state
    draws the same numbers again (on CUDA the device's generator is captured too)."""
    import torch

    from terarec.train.loop import RngState

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    state = RngState.capture(device)
    assert (state.cuda is None) == (device.type == "cpu")
    first = torch.rand(4, device=device), torch.rand(4)
    state.restore(device)
    again = torch.rand(4, device=device), torch.rand(4)
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))


def test_the_first_rung_is_sized_to_a_hundred_steps():
    config = TrainConfig()
    config.batch_size, config.pass_rows = 256, 200_000
    assert first_rung(None, config) == 1  # rows unknown
    assert first_rung(8000, config) == 4  # an epoch of 32 steps a pass
    config.batch_size = 4096
    assert first_rung(10**9, config) == 3  # 200,000-row passes of 49 steps
    config.pass_rows = 10**6
    assert first_rung(10**9, config) == 1


def test_no_trial_is_pruned_before_the_first_rung(files, tmp_path):
    schema, config, batches = _setup(files, epochs=3, admit_min_count=1)
    space = {"sparse_optimizer.lr": {"type": "float", "low": 0.001, "high": 0.5, "log": True}}
    settings = SearchConfig(base=config, trials=4, sampler="random", pruner="halving",
                            patience=None, space=space, first_rung=3)
    result = run_search(settings, schema, [files[0]], batches, tmp_path / "s")
    pruned = [t for t in result.trials if t.state == "pruned"]
    assert pruned, "halving prunes some of 4 trials once they reach the rung"
    assert all(len(t.history) >= 3 for t in pruned)
    saved = json.loads((tmp_path / "s" / "search.json").read_text())
    assert saved["first_rung"] == 3
    with pytest.raises(ValueError, match=r"first_rung 0: must be an integer >= 1"):
        SearchConfig(base=config, trials=2, space=space, first_rung=0)


def _checkpoint_digests(out: Path) -> dict[str, tuple]:
    """Every checkpoint of the search's best directory: its files' digests and the random
    state it recorded, by name; and the ``BEST`` pointer."""
    root = out / "best" / "checkpoints"
    found: dict[str, tuple] = {"BEST": ((out / "best" / "BEST").read_text(),)}
    for ck in sorted(root.glob("pass-*")):
        meta = json.loads((ck / "meta.json").read_text())
        found[ck.name] = (meta["sha256"], meta["rng"], meta["pass_id"])
    return found


def test_commits_written_in_the_background_equal_commits_written_in_place(
        files, tmp_path, monkeypatch):
    """In one process a trial's commit is written on a background thread while the other
    trials train their pass: the checkpoints are those written in place, file for file
    (the random state recorded is the trial's own, taken when its pass ended)."""
    import threading

    import terarec.train.search.trials as trials
    import terarec.train.search.waves as waves

    train, _ = files
    schema, config, batches = _setup(files, epochs=2, admit_min_count=1)
    space = check_space({"model.embedding_dim": [4, 8]}, config)
    fixed = [{"model.embedding_dim": 4}, {"model.embedding_dim": 8}]
    threads: set[str] = set()
    save = trials.save_checkpoint

    def recording(*args, **kwargs):
        threads.add(threading.current_thread().name)
        return save(*args, **kwargs)

    monkeypatch.setattr(trials, "save_checkpoint", recording)
    settings = SearchConfig(base=config, trials=2, sampler="random", pruner="none",
                            space=space, fixed=fixed)
    background = run_search(settings, schema, [train], batches, tmp_path / "bg")
    assert threads and all(name.startswith("terarec-commit") for name in threads)

    class InPlace(waves.Commits):
        def __init__(self, background: bool) -> None:
            super().__init__(background=False)

    threads.clear()
    monkeypatch.setattr(waves, "Commits", InPlace)
    in_place = run_search(settings, schema, [train], batches, tmp_path / "ip")
    assert threads == {threading.current_thread().name}
    assert background.best.number == in_place.best.number
    assert [t.history[-1]["valid_auc"] for t in background.trials] == \
        [t.history[-1]["valid_auc"] for t in in_place.trials]
    assert _checkpoint_digests(tmp_path / "bg") == _checkpoint_digests(tmp_path / "ip")


def test_a_commit_that_fails_in_the_background_stops_the_search(files, tmp_path,
                                                                 monkeypatch):
    """A commit written on the background thread that fails (here a full disk at the
    third commit) raises its error from the search, and no later pass is journaled as
    committed: the next boundary waits for the commits first."""
    import errno

    import terarec.train.search.trials as trials

    train, _ = files
    schema, config, batches = _setup(files, epochs=2, admit_min_count=1)
    space = check_space({"model.embedding_dim": [4, 8]}, config)
    calls: list[int] = []
    boundaries: list[int] = []
    save = trials.save_checkpoint

    def failing(model_dir, trainer, **kwargs):
        calls.append(trainer.pass_id)
        if len(calls) == 3:
            raise OSError(errno.ENOSPC, "no space left on device")
        return save(model_dir, trainer, **kwargs)

    monkeypatch.setattr(trials, "save_checkpoint", failing)
    with pytest.raises(OSError, match="no space left"):
        run_search(SearchConfig(base=config, trials=2, sampler="random", pruner="none",
                                space=space, fixed=[{"model.embedding_dim": 4},
                                                    {"model.embedding_dim": 8}]),
                   schema, [train], batches, tmp_path / "s",
                   on_boundary=lambda trials: boundaries.append(len(calls)))
    assert len(calls) == 3  # the failing commit was the last one written
    assert boundaries == [2]  # the second round's boundary did not pass it
