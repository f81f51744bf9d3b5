"""The Python API: ``terarec.fit`` runs the recipe ``terarec train`` runs (bit for bit),
``terarec.load`` -> ``Model`` scores files and in-memory tables, exports, and a model
class of the user's own trains, resumes, exports and serves like a built-in."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.csv as pacsv
import pytest

import terarec
from terarec.cli.main import main as cli_main
from terarec.data.synth import generate

HERE = Path(__file__).resolve().parent
SMALL = {"pass_rows": 1000, "batch_size": 250, "threads": 1}
SMALL_FLAGS = ["--pass-rows", "1000", "--batch-size", "250", "--threads", "1",
               "--no-progress"]
NAMES = ["label"] + [f"I{i}" for i in range(1, 14)] + [f"C{i}" for i in range(1, 27)]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("api")
    generate(root / "train.tsv", 3000, model_seed=0, sample_seed=1, vocab_scale=0.01)
    generate(root / "valid.tsv", 800, model_seed=0, sample_seed=2, vocab_scale=0.01)
    return root / "train.tsv", root / "valid.tsv"


def _tensor_files(model_dir: Path) -> dict[str, bytes]:
    """Every checkpoint's weights, optimizer state and sparse rows, by relative path."""
    return {str(p.relative_to(model_dir)): p.read_bytes()
            for p in sorted((model_dir / "checkpoints").rglob("*"))
            if p.is_file() and p.name != "meta.json"}


def test_fit_and_the_command_line_write_the_same_model(data, tmp_path):
    train, valid = data
    assert cli_main(["train", "--train", str(train), "--valid", str(valid), "--out",
                     str(tmp_path / "cli"), "--model", "fm", "--seed", "3", *SMALL_FLAGS]) == 0
    model = terarec.fit(train, valid, out=tmp_path / "api", model="fm", seed=3,
                        progress=False, **SMALL)
    cli, api = _tensor_files(tmp_path / "cli"), _tensor_files(tmp_path / "api")
    assert cli and cli.keys() == api.keys()
    assert all(cli[k] == api[k] for k in cli), [k for k in cli if cli[k] != api[k]]
    for name in ("BEST", "LATEST", "train_config.json", "schema.json"):
        assert (tmp_path / "cli" / name).read_bytes() == (tmp_path / "api" / name).read_bytes()
    cli_metrics = json.loads((tmp_path / "cli" / "metrics.json").read_text())
    assert model.metrics["auc"] == cli_metrics["auc"]
    assert model.metrics["best_pass"] == cli_metrics["best_pass"]
    assert (tmp_path / "api" / "report" / "report.html").is_file()
    assert [h["pass_id"] for h in model.history] == \
        [h["pass_id"] for h in json.loads((tmp_path / "cli" / "history.json").read_text())]


@pytest.fixture(scope="module")
def lr_model(data, tmp_path_factory) -> terarec.Model:
    train, valid = data
    return terarec.fit(train, valid, out=tmp_path_factory.mktemp("lr") / "m", model="lr",
                       progress=False, **SMALL)


def test_predict_takes_files_tables_and_dicts_and_matches_the_command_line(
        lr_model, data, tmp_path):
    _, valid = data
    scores = tmp_path / "scores.txt"
    assert cli_main(["predict", "--model", str(lr_model.path), "--data", str(valid),
                     "--out", str(scores)]) == 0
    from_file = lr_model.predict(valid)
    np.testing.assert_allclose(from_file, np.loadtxt(scores), atol=1e-8)
    table = pacsv.read_csv(valid, read_options=pacsv.ReadOptions(column_names=NAMES),
                           parse_options=pacsv.ParseOptions(delimiter="\t"),
                           convert_options=pacsv.ConvertOptions(
                               column_types={n: "string" for n in NAMES[14:]}))
    np.testing.assert_allclose(lr_model.predict(table), from_file, rtol=1e-6, atol=1e-7)
    columns = {n: table.column(n).to_pylist() for n in NAMES}
    np.testing.assert_allclose(lr_model.predict(columns), from_file, rtol=1e-6, atol=1e-7)
    assert lr_model.predict([valid, valid]).shape == (2 * len(from_file),)


def test_evaluate_matches_eval(lr_model, data, tmp_path):
    _, valid = data
    out = tmp_path / "eval.json"
    assert cli_main(["eval", "--model", str(lr_model.path), "--data", str(valid), "--out",
                     str(out)]) == 0
    got, want = lr_model.evaluate(valid), json.loads(out.read_text())
    assert got["rows"] == want["rows"] == 800
    assert got["auc"] == pytest.approx(want["auc"], abs=1e-12)
    assert got["logloss"] == pytest.approx(want["logloss"], abs=1e-12)


def test_predict_skips_bad_rows_in_place(lr_model, data, tmp_path):
    _, valid = data
    lines = valid.read_text().splitlines(keepends=True)[:10]
    lines[3] = "0\tnot-a-number" + "\t" * 38 + "\n"
    bad = tmp_path / "bad.tsv"
    bad.write_text("".join(lines))
    with pytest.raises(ValueError, match="bad.tsv"):
        lr_model.predict(bad)
    scores = lr_model.predict(bad, on_bad_row="skip")
    assert scores.shape == (10,) and np.isnan(scores[3]) and np.isfinite(np.delete(scores, 3)).all()


def test_load_names_what_is_wrong(tmp_path, lr_model):
    with pytest.raises((FileNotFoundError, ValueError)):
        terarec.load(tmp_path / "nothing-here")
    assert terarec.load(lr_model.path, "latest").config.model.name == "lr"
    with pytest.raises(Exception, match="no checkpoint pass-000099"):
        terarec.load(lr_model.path, "pass-99")


def _served(export: Path, data: Path, rows: int) -> np.ndarray:
    """The scores a server engine on ``export`` gives the first ``rows`` rows of ``data``
    (a Criteo file), sent as raw feature values."""
    from terarec.serving.engine import ServingEngine

    records = [dict(zip(NAMES[1:], (v or None for v in line.split("\t")[1:]), strict=True))
               for line in data.read_text().splitlines()[:rows]]
    engine = ServingEngine(str(export), cache_dir=export.parent / f"cache-{export.name}")
    try:
        assert engine.refresh()
        return np.asarray(engine.score_records(records)[0])
    finally:
        engine.close()


def test_export_writes_a_version_a_server_scores_as_predict(lr_model, data, tmp_path):
    _, valid = data
    written = lr_model.export(str(tmp_path / "exp"), bits=16)
    assert written["uri"] == str(tmp_path / "exp")
    assert (tmp_path / "exp" / "LATEST").read_text().strip() == "v000001"
    np.testing.assert_allclose(_served(tmp_path / "exp", valid, 200),
                               lr_model.predict(valid)[:200], atol=2e-3)


def test_fit_refuses_unknown_settings_and_bad_values(data, tmp_path):
    train, _ = data
    with pytest.raises(TypeError, match=r"batchsize \(did you mean batch_size\?\)"):
        terarec.fit(train, out=tmp_path / "a", batchsize=10)
    with pytest.raises(ValueError, match="store.precision"):
        terarec.fit(train, out=tmp_path / "b", store={"precision": "int3"})
    with pytest.raises(ValueError, match="cross_layers"):  # only dcnv2 reads it
        terarec.fit(train, out=tmp_path / "c", model={"name": "deepfm", "cross_layers": 7})
    assert not (tmp_path / "a").exists() and not (tmp_path / "c").exists()


def test_a_config_object_counts_its_changed_values_as_given(data, tmp_path):
    """Sized defaults leave alone what a TrainConfig sets (batch size 300 here)."""
    train, _ = data
    config = terarec.TrainConfig(batch_size=300, pass_rows=1000, threads=1, epochs=1)
    model = terarec.fit(train, out=tmp_path / "m", config=config, model="lr", progress=False,
                        valid_split=0)  # (validation rows would make epochs a bound)
    assert model.config.batch_size == 300 and model.config.epochs == 1


# -- a model of the user's own -----------------------------------------------------------
CUSTOM = "fieldattention:FieldAttention"


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(HERE), *filter(None, [os.environ.get("PYTHONPATH")])])}


def test_a_model_class_of_ones_own_trains_resumes_exports_and_serves(data, tmp_path,
                                                                     monkeypatch):
    monkeypatch.syspath_prepend(str(HERE))
    from fieldattention import FieldAttention

    train, valid = data
    model = terarec.fit(train, valid, out=tmp_path / "m", model=FieldAttention, epochs=2,
                        refit=False, progress=False, **SMALL)
    assert model.config.model.name == CUSTOM
    assert json.loads((tmp_path / "m" / "train_config.json").read_text())["model"]["name"] \
        == CUSTOM
    assert model.metrics["auc"] > 0.55
    # the command line trains the same class by import path, and resumes it (every row,
    # every epoch: no validation rows carved, so no patience to stop the second)
    assert cli_main(["train", "--train", str(train), "--out", str(tmp_path / "c"),
                     "--model", CUSTOM, "--epochs", "1", "--valid-split", "0",
                     *SMALL_FLAGS]) == 0
    first = terarec.load(tmp_path / "c", "latest").metrics["passes"]
    assert cli_main(["train", "--train", str(train), "--out", str(tmp_path / "c"),
                     "--model", CUSTOM, "--epochs", "2", "--resume", "--valid-split", "0",
                     *SMALL_FLAGS]) == 0
    assert terarec.load(tmp_path / "c").metrics["passes"] == 2 * first
    model.export(str(tmp_path / "exp"))
    np.testing.assert_allclose(_served(tmp_path / "exp", valid, 100),
                               model.predict(valid)[:100], rtol=1e-4, atol=1e-5)


def test_a_model_path_that_does_not_import_is_one_line(data, tmp_path, capsys):
    train, _ = data
    assert cli_main(["train", "--train", str(train), "--out", str(tmp_path / "m"),
                     "--model", "no_such_module_here:Net", *SMALL_FLAGS]) == 2
    err = capsys.readouterr().err
    assert "cannot import module 'no_such_module_here'" in err and "Traceback" not in err
    assert cli_main(["train", "--train", str(train), "--out", str(tmp_path / "m"),
                     "--model", "not a path:", *SMALL_FLAGS]) == 2
    assert "package.module:ClassName" in capsys.readouterr().err


@pytest.mark.dist
def test_a_model_of_ones_own_trains_on_two_torchrun_ranks(data, tmp_path):
    train, valid = data
    out = tmp_path / "m"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc_per_node", "2", "-m", "terarec", "train", "--train", str(train),
           "--out", str(out), "--model", CUSTOM, "--epochs", "1", *SMALL_FLAGS]
    done = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["world_size"] == 2 and metrics["model"] == CUSTOM
    sys.path.insert(0, str(HERE))
    try:
        scores = terarec.load(out).predict(valid)
    finally:
        sys.path.remove(str(HERE))
    assert scores.shape == (800,) and np.isfinite(scores).all()


def test_search_from_python_finds_what_the_command_line_finds(data, tmp_path):
    train, valid = data
    space = {"sparse_optimizer.lr": [0.01, 0.05], "model.embedding_dim": [4, 8]}
    space_file = tmp_path / "space.json"
    space_file.write_text(json.dumps(space))
    outcome = terarec.search(train, valid, out=tmp_path / "api", trials=3, space=space,
                             sampler="grid", model="fm", seed=1, progress=False, **SMALL)
    assert cli_main(["search", "--train", str(train), "--valid", str(valid), "--out",
                     str(tmp_path / "cli"), "--trials", "3", "--space", str(space_file),
                     "--sampler", "grid", "--model", "fm", "--seed", "1",
                     *SMALL_FLAGS]) == 0
    cli = json.loads((tmp_path / "cli" / "results.json").read_text())
    assert len(outcome.trials) == 3
    assert outcome.best is not None and outcome.best.path == tmp_path / "api" / "best"
    cli_best = next(t for t in cli["trials"] if t["trial"] == cli["best_trial"])
    api_best = next(t for t in outcome.trials if t["trial"] == cli["best_trial"])
    untimed = [k for k in cli_best if k != "seconds"]
    assert [api_best[k] for k in untimed] == [cli_best[k] for k in untimed]
    assert outcome.best_params == {k[len("params."):]: v for k, v in cli_best.items()
                                   if k.startswith("params.")}
    assert outcome.best.predict(valid).shape == (800,)


def test_scores_on_rows_the_model_trained_on_are_called_in_sample(data, tmp_path, capsys):
    """Below 100,000 rows the model is refit on train + valid: scoring valid again is
    in-sample, said in one line by eval and by Model.evaluate; unseen rows are not."""
    train, valid = data
    lr_model = terarec.fit(train, valid, out=tmp_path / "m", model="lr", batch_size=250,
                           threads=1, epochs=3, progress=False)
    assert lr_model.metrics["refit"]["checkpoint"]
    with pytest.warns(UserWarning, match="in-sample"):
        assert lr_model.evaluate(valid)["in_sample"] == [str(valid)]
    copy = tmp_path / "renamed.tsv"  # the same rows under another name
    copy.write_bytes(train.read_bytes())
    assert lr_model.trained_on([copy]) == [str(copy)]
    fresh = tmp_path / "test.tsv"
    generate(fresh, 500, model_seed=0, sample_seed=9, vocab_scale=0.01)
    assert lr_model.evaluate(fresh)["in_sample"] == []
    assert cli_main(["eval", "--model", str(lr_model.path), "--data", str(valid), "--out",
                     str(tmp_path / "e.json")]) == 0
    err = capsys.readouterr().err
    assert err.count("in-sample") == 1 and str(valid) in err


def test_metrics_say_how_many_epochs_ran_against_the_bound(lr_model):
    metrics = lr_model.metrics
    assert metrics["epochs_limit"] == lr_model.config.epochs
    assert 1 <= metrics["epochs_trained"] <= metrics["epochs_limit"]
    assert metrics["epochs_trained"] == max(h["epoch"] for h in lr_model.history) + 1


def test_a_parquet_file_is_read_as_parquet_by_its_extension(lr_model, data, tmp_path):
    """A model trained on TSV scores a Parquet copy of its rows named .parquet without a
    --format flag (it was read as text: "not text (byte 0x00 ...)")."""
    import pyarrow.parquet as pq

    _, valid = data
    table = pacsv.read_csv(valid, read_options=pacsv.ReadOptions(column_names=NAMES),
                           parse_options=pacsv.ParseOptions(delimiter="\t"),
                           convert_options=pacsv.ConvertOptions(
                               column_types={n: "string" for n in NAMES[14:]}))
    pq.write_table(table, tmp_path / "valid.parquet")
    out = tmp_path / "eval.json"
    assert cli_main(["eval", "--model", str(lr_model.path), "--data",
                     str(tmp_path / "valid.parquet"), "--out", str(out)]) == 0
    assert json.loads(out.read_text())["auc"] == pytest.approx(
        lr_model.evaluate(valid)["auc"], abs=1e-6)


def test_search_results_are_sorted_best_first_then_by_value(data, tmp_path):
    train, valid = data
    outcome = terarec.search(train, valid, out=tmp_path / "s", trials=4, model="lr",
                             space={"sparse_optimizer.lr": [0.001, 0.01, 0.05, 0.2]},
                             sampler="grid", progress=False, epochs=2, **SMALL)
    rows = json.loads((tmp_path / "s" / "results.json").read_text())["trials"]
    assert rows[0]["trial"] == outcome.result.best.number
    values = [r["value"] for r in rows if r["value"] is not None]
    assert values == sorted(values)  # logloss: lower first
    csv_trials = [line.split(",")[0] for line in
                  (tmp_path / "s" / "results.csv").read_text().splitlines()[1:]]
    assert csv_trials == [str(r["trial"]) for r in rows]
