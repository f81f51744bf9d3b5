"""``terarec autofeature`` and ``terarec train --features`` end to end, and their errors."""

from __future__ import annotations

import csv
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow.csv as pa_csv
import pytest

import terarec.autofeature
from terarec.autofeature.features import FeatureConfig, model_features
from terarec.autofeature.lookup import FeatureLookup
from terarec.cli.main import main
from terarec.data.readers import batch_from_records
from terarec.data.synth_features import generate_planted
from terarec.modeldir import checkpoint_name, read_model_meta
from terarec.train.trainer import Trainer

SRC = Path(__file__).resolve().parents[2] / "src"
SCHEMA_ARGS = ["--format", "csv", "--label", "label", "--numeric", "I1,I2",
               "--categorical", "C1,C2,C3,C4,C5,C6,C7,C8", "--log1p", "I1,I2"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    return generate_planted(root / "train.csv", root / "valid.csv", 15_000, 4000, seed=5)


@pytest.fixture(scope="module")
def selected(data, tmp_path_factory):
    out = tmp_path_factory.mktemp("features") / "features.json"
    code = main(["autofeature", "--train", str(data.train), "--valid", str(data.valid),
                 *SCHEMA_ARGS, "--kinds", "count,cross_count", "--budget", "3",
                 "--memory-limit", "256MB", "--threads", "2", "--out", str(out)])
    assert code == 0
    return out


@pytest.fixture(scope="module")
def model(selected, data, tmp_path_factory):
    out = tmp_path_factory.mktemp("model") / "m"
    code = main(["train", "--features", str(selected), "--train", str(data.train),
                 "--valid", str(data.valid), "--out", str(out), "--model", "lr",
                 "--batch-size", "512", "--threads", "1", "--no-progress",
                 "--no-refit"])  # eval below repeats the selected pass's validation score
    assert code == 0
    return out


def test_autofeature_writes_config_tables_and_gains(selected, data):
    config = FeatureConfig.load(selected)
    assert set(data.planted) <= set(config.selected) and len(config.selected) <= 3
    assert config.base_schema == data.schema
    assert config.tables.directory == selected.parent / "features.tables"
    summary = json.loads(selected.with_name("features.gains.json").read_text())
    assert summary["candidates"] == 8 + 16
    assert summary["gain"] == pytest.approx(summary["auc_with_features"] - summary["auc_raw"])
    assert summary["gain"] > 0.02
    with open(selected.with_name("features.gains.csv")) as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == 24
    assert {r["name"] for r in rows if r["selected"] == "True"} == set(config.selected)
    gains = [float(r["gain"]) for r in rows]
    assert gains == sorted(gains, reverse=True)
    png = selected.with_name("features.gains.png").read_bytes()
    assert png.startswith(b"\x89PNG")


def test_model_carries_its_tables_and_scores_raw_rows_like_records(model, data, selected,
                                                                    tmp_path, capsys):
    features = model_features(model)
    assert features is not None
    assert features.tables.directory == model / "features"
    assert features.selected == FeatureConfig.load(selected).selected
    trainer = Trainer.from_checkpoint(model, name=checkpoint_name(model))  # the one predict uses
    # The model's schema is the feature schema plus the numeric statistics and bucket
    # edges training took.
    unscaled = tuple(dataclasses.replace(f, mean=None, std=None, buckets=None)
                     for f in trainer.schema.fields)
    assert dataclasses.replace(trainer.schema, fields=unscaled) == features.schema
    assert all(f.std is not None for f in trainer.schema.numeric)
    assert [f.name for f in trainer.schema.fields][-len(features.selected):] == \
        list(features.selected)

    # New rows, some with values training never saw: predict reads the raw file.
    raw = pa_csv.read_csv(data.valid, convert_options=pa_csv.ConvertOptions(
        column_types={c: "string" for c in ["label", "I1", "I2", *[f"C{i}" for i in
                                                                     range(1, 9)]]}))
    records = raw.slice(0, 300).to_pylist()
    for i in range(0, 300, 3):
        records[i]["C3"] = f"new-{i}"
        records[i]["C5"] = "unseen"
    new = tmp_path / "new.csv"
    with open(new, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=raw.column_names)
        writer.writeheader()
        writer.writerows(records)
    scores = tmp_path / "scores.txt"
    assert main(["predict", "--model", str(model), "--data", str(new),
                 "--out", str(scores)]) == 0
    from_file = np.loadtxt(scores)

    # The same rows as request records through the in-memory lookup.
    augmented = FeatureLookup(features.tables).apply_records(records)
    assert {augmented[i]["count(C3)"] for i in range(0, 300, 3)} == {"0"}
    from_records = trainer.predict_batches([batch_from_records(augmented, trainer.schema)])
    np.testing.assert_allclose(from_file, from_records, rtol=1e-5, atol=1e-6)

    capsys.readouterr()
    assert main(["eval", "--model", str(model), "--data", str(data.valid),
                 "--out", str(tmp_path / "m.json")]) == 0
    metrics = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    # Evaluating the raw validation file repeats what training measured on its copy.
    trained = json.loads((model / "metrics.json").read_text())
    assert trained["evaluated_on"] == "valid"
    assert metrics["rows"] == 4000
    assert metrics["auc"] == pytest.approx(trained["auc"], abs=1e-9)


def run_error(capsys, *argv):
    capsys.readouterr()
    code = main(list(argv))
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1, err
    assert err.startswith("terarec autofeature: error: ")
    return err


def test_bad_input_is_one_clear_line(data, tmp_path, capsys):
    base = ["autofeature", "--train", str(data.train), "--valid", str(data.valid),
            *SCHEMA_ARGS, "--out", str(tmp_path / "f.json")]
    err = run_error(capsys, *base, "--candidates", "count(C99)")
    assert "count(C99): unknown column 'C99'" in err
    err = run_error(capsys, *base, "--candidates", "max(C1)_by(C2)")
    assert "needs a numeric column, but 'C1' is categorical" in err
    err = run_error(capsys, *base, "--candidates", "median(I1)_by(C2)")
    assert "cannot parse candidate name" in err
    empty = tmp_path / "empty.csv"
    empty.write_text("label,I1,I2,C1,C2,C3,C4,C5,C6,C7,C8\n")
    err = run_error(capsys, "autofeature", "--train", str(empty), "--valid",
                    str(data.valid), *SCHEMA_ARGS, "--candidates", "count(C1)",
                    "--out", str(tmp_path / "f.json"))
    assert "training range is empty" in err
    err = run_error(capsys, "autofeature", "--train", str(tmp_path / "none-*.csv"),
                    "--valid", str(data.valid), *SCHEMA_ARGS, "--out", str(tmp_path / "f.json"))
    assert "no file matches" in err
    lacking = [a if a != "C1,C2,C3,C4,C5,C6,C7,C8" else "C1,C2,C9" for a in SCHEMA_ARGS]
    err = run_error(capsys, "autofeature", "--train", str(data.train), "--valid",
                    str(data.valid), *lacking, "--candidates", "count(C9)",
                    "--out", str(tmp_path / "f.json"))
    assert "C9" in err
    # Gains measured on the rows the tables were computed from.
    err = run_error(capsys, "autofeature", "--train", str(data.train.parent / "*.csv"),
                    "--valid", str(data.valid), *SCHEMA_ARGS, "--out", str(tmp_path / "f.json"))
    assert err.strip().endswith(f"--valid: {data.valid} is also a --train file: validation "
                                "must hold rows training does not see")
    # A row with a column too many: DuckDB's sniffer failed with a page of dialect advice.
    lines = data.train.read_text().splitlines(keepends=True)
    wide = tmp_path / "wide.csv"
    wide.write_text("".join(lines[:40]) + lines[40].rstrip("\n") + ",extra\n"
                    + "".join(lines[41:400]))
    for train, valid in ((wide, data.valid), (data.train, wide)):
        err = run_error(capsys, "autofeature", "--train", str(train), "--valid", str(valid),
                        *SCHEMA_ARGS, "--candidates", "count(C1)", "--out",
                        str(tmp_path / "f.json"))
        assert err.strip().endswith(f"{wide}: line 41: field 'C8': 12 columns, expected 11 "
                                    "(extra values after the last field)"), err
    assert not (tmp_path / "f.json").exists()


@pytest.mark.parametrize("column,value,problem", [
    ("label", "2", "label must be 0 or 1, got '2'"),
    ("I1", "nan", "not a finite number, got 'nan'"),
    ("I2", "1e40", "outside the float32 range (|x| > 3.403e+38), got '1e40'"),
])
@pytest.mark.parametrize("where", ["train", "valid"])
def test_rows_train_refuses_are_refused_before_any_sql(data, tmp_path, capsys, column,
                                                       value, problem, where):
    """DuckDB reads a label of 2, ``nan`` and ``1e40`` as values: a NaN reached the
    sample as a missing value (tables and gains computed on it), the others failed
    naming a temporary sample file and its row instead of the input's line."""
    lines = data.train.read_text().splitlines(keepends=True)[:400]
    header = lines[0].rstrip("\n").replace('"', "").split(",")
    cells = lines[40].rstrip("\n").split(",")
    cells[header.index(column)] = value
    bad = tmp_path / "bad.csv"
    bad.write_text("".join(lines[:40]) + ",".join(cells) + "\n" + "".join(lines[41:]))
    train, valid = (bad, data.valid) if where == "train" else (data.train, bad)
    err = run_error(capsys, "autofeature", "--train", str(train), "--valid", str(valid),
                    *SCHEMA_ARGS, "--candidates", "count(C1)", "avg(I1)_by(C2)",
                    "--out", str(tmp_path / "f.json"))
    assert err.strip().endswith(f"{bad}: line 41: field {column!r}: {problem}"), err
    assert not (tmp_path / "f.json").exists()


FLAG_ERRORS = [
    (["--seed", "-1"], "--seed must be >= 0, got -1"),
    (["--seed", str(1 << 32)], "--seed must be < 2**32"),
    (["--threads", "0"], "--threads must be >= 1, got 0"),
    (["--epochs", "0"], "--epochs must be >= 1, got 0"),
    (["--sample-rows", "0"], "--sample-rows must be >= 1, got 0"),
    (["--budget", "-1"], "--budget must be >= 0, got -1"),
    (["--max-cross-pairs", "-1"], "--max-cross-pairs must be >= 0, got -1"),
    (["--min-gain", "nan"], "--min-gain must be a finite number, got nan"),
    (["--on-bad-row", "skip"], "--on-bad-row skip: autofeature reads its inputs with DuckDB"),
    (["--memory-limit", "abc"], "--memory-limit abc: Parser Error: Memory must have a number"),
    (["--out", "OUT_DIR"], "is a folder; name the feature config file"),
]


@pytest.mark.parametrize("extra,message", FLAG_ERRORS, ids=[" ".join(a) for a, _ in FLAG_ERRORS])
def test_bad_flags_are_refused_naming_the_flag(data, tmp_path, capsys, extra, message):
    """Out of range, a flag failed as a DuckDB parser error or traceback (--seed -1,
    --threads 0, --memory-limit abc), after every candidate was measured (--out a
    folder), or not at all: --epochs 0 measured untrained models, --min-gain nan never
    stopped and --on-bad-row skip was ignored."""
    extra = [str(tmp_path) if a == "OUT_DIR" else a for a in extra]
    argv = ["autofeature", "--train", str(data.train), "--valid", str(data.valid),
            *SCHEMA_ARGS, "--candidates", "count(C3)", "--out", str(tmp_path / "f.json"),
            *extra]
    assert message in run_error(capsys, *argv)
    assert not (tmp_path / "f.json").exists()


def train_error(capsys, *argv):
    capsys.readouterr()
    assert main(["train", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("terarec train: error: ") and "Traceback" not in err
    return err[-1]


def test_train_with_features_refuses_on_bad_row_skip(selected, model, data, tmp_path,
                                                     capsys):
    """The rows are joined with the tables in DuckDB before the reader sees them, and
    DuckDB stops at the first bad row: --on-bad-row skip (flag or config file) was
    ignored, failing on a row it promised to skip. A resumed model's tables too."""
    config = tmp_path / "config.json"
    config.write_text('{"on_bad_row": "skip"}')
    out = tmp_path / "m"
    for setting in (["--on-bad-row", "skip"], ["--config", str(config)]):
        err = train_error(capsys, "--features", str(selected), "--train",
                          str(data.train), "--out", str(out), "--no-progress", *setting)
        assert "--on-bad-row skip (on_bad_row in --config) does not work with " \
               "AutoFeature tables" in err
        assert not out.exists()
    resumed = tmp_path / "resumed"
    shutil.copytree(model, resumed)
    err = train_error(capsys, "--resume", "--train", str(data.train), "--out",
                      str(resumed), "--no-progress", "--on-bad-row", "skip")
    assert "does not work with AutoFeature tables" in err


def test_memory_limit_and_temp_dir_reach_duckdb(data, tmp_path, monkeypatch):
    seen = {}

    class Recording(terarec.autofeature.AutoFeatureEngine):
        def duckdb_config(self):
            config = super().duckdb_config()
            seen.update(config)
            return config

    # the command imports the engine when it runs
    monkeypatch.setattr(terarec.autofeature, "AutoFeatureEngine", Recording)
    assert main(["autofeature", "--train", str(data.train), "--valid", str(data.valid),
                 *SCHEMA_ARGS, "--candidates", "count(C3)", "--memory-limit", "123MB",
                 "--temp-dir", str(tmp_path / "spill"), "--sample-rows", "2000",
                 "--valid-rows", "1000", "--out", str(tmp_path / "f.json")]) == 0
    assert seen["memory_limit"] == "123MB"
    assert seen["temp_directory"] == str(tmp_path / "spill")


def test_search_trains_on_the_tables_and_its_best_model_carries_them(selected, data,
                                                                     tmp_path, capsys):
    """``search --features``: every trial reads the joined rows (the feature columns are
    in its schema), and ``out/best`` holds the tables, so eval on the raw validation file
    repeats the validation AUC that picked it; a search started without tables cannot
    gain them on resume."""
    out = tmp_path / "search"
    common = ["--train", str(data.train), "--valid", str(data.valid), "--out", str(out),
              "--model", "lr", "--batch-size", "512", "--threads", "1", "--no-progress",
              "--epochs", "2", "--select-by", "auc", "--pruner", "none", "--no-refit"]
    assert main(["search", "--features", str(selected), "--trials", "2", *common]) == 0
    best = out / "best"
    features = model_features(best)
    assert features is not None and features.tables.directory == best / "features"
    assert features.selected == FeatureConfig.load(selected).selected
    schema, _ = read_model_meta(best)
    assert [f.name for f in schema.fields][-len(features.selected):] == \
        list(features.selected)
    rows = json.loads((out / "results.json").read_text())["trials"]
    picked = max(r["value"] for r in rows if r["state"] == "complete")
    capsys.readouterr()
    metrics_out = tmp_path / "eval.json"
    assert main(["eval", "--model", str(best), "--data", str(data.valid),
                 "--out", str(metrics_out)]) == 0
    assert json.loads(metrics_out.read_text())["auc"] == pytest.approx(picked, abs=1e-6)

    plain = tmp_path / "plain"
    assert main(["search", "--trials", "1", *SCHEMA_ARGS,
                 *[a if a != str(out) else str(plain) for a in common]]) == 0
    capsys.readouterr()
    assert main(["search", "--features", str(selected), "--trials", "2", "--resume",
                 *[a if a != str(out) else str(plain) for a in common]]) == 2
    assert "was started without --features" in capsys.readouterr().err


def test_resume_with_tables_reads_on_inside_the_file(selected, data, tmp_path, capsys):
    """Checkpoints named the joined copy (a path in a temporary folder, another one each
    run), so a resumed run found no position for the file and trained its rows again."""
    out = tmp_path / "m"
    common = ["--train", str(data.train), "--out", str(out), "--model", "lr",
              "--batch-size", "500", "--pass-rows", "2000", "--threads", "1",
              "--no-progress", "--epochs", "1", "--valid-split", "0"]  # the raw file's rows
    assert main(["train", "--features", str(selected), *common]) == 0
    last = sorted((out / "checkpoints").iterdir())[-1]  # as if killed after the one before
    shutil.rmtree(last)
    kept = sorted((out / "checkpoints").iterdir())[-1].name
    (out / "LATEST").write_text(kept)
    meta = json.loads((out / "checkpoints" / kept / "meta.json").read_text())
    assert list(meta["inputs"]["files"]) == [str(data.train.resolve())]
    assert main(["train", "--resume", *common]) == 0
    capsys.readouterr()
    rows = [r["rows"] for r in json.loads((out / "history.json").read_text())]
    assert sum(rows) == 15_000 and rows[-1] == 15_000 - 2000 * (len(rows) - 1)


@pytest.mark.slow
def test_a_killed_search_with_tables_continues_inside_the_file(selected, data, tmp_path):
    """A trial continued by ``search --resume`` reads on from its row positions in the
    raw file (the joined copy is made again in another temporary folder): one epoch is
    every row once, and its values are those of an uninterrupted search (the trial after
    it draws other values: a resumed sampler is seeded anew)."""
    common = ["search", "--features", str(selected), "--train", str(data.train),
              "--valid", str(data.valid), "--model", "lr", "--batch-size", "500",
              "--pass-rows", "2000", "--threads", "1", "--no-progress", "--epochs", "1",
              "--trials", "2", "--parallel", "1", "--pruner", "none", "--no-refit"]
    whole, out = tmp_path / "whole", tmp_path / "killed"
    assert main([*common, "--out", str(whole)]) == 0
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    proc = subprocess.Popen([sys.executable, "-m", "terarec", *common, "--out", str(out)],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    first = out / "trials" / "trial-000" / "LATEST"
    deadline = time.monotonic() + 240
    while not first.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    assert first.exists(), proc.stderr.read().decode() if proc.poll() else "too slow"
    os.kill(proc.pid, signal.SIGKILL)  # while trial 0 trains
    proc.wait()
    assert main([*common, "--out", str(out), "--resume"]) == 0
    metrics = json.loads((out / "trials" / "trial-000" / "metrics.json").read_text())
    assert metrics["continued_from"].startswith("pass-")
    for number in (0, 1):
        runs = [json.loads((d / "trials" / f"trial-{number:03d}" / "history.json"
                            ).read_text()) for d in (whole, out)]
        assert [h["rows"] for h in runs[1]] == [h["rows"] for h in runs[0]]
        assert sum(h["rows"] for h in runs[1]) == 15_000
        if number == 0:
            assert [h["valid_auc"] for h in runs[1]] == pytest.approx(
                [h["valid_auc"] for h in runs[0]], abs=1e-9)


def test_scoring_a_model_with_tables_refuses_on_bad_row_skip(model, data, tmp_path, capsys):
    """The join with the model's tables stops at the first bad row, before the reader
    could skip it: eval and predict say so rather than fail on a row they promised to
    skip."""
    for command in ("eval", "predict"):
        capsys.readouterr()
        assert main([command, "--model", str(model), "--data", str(data.valid),
                     "--on-bad-row", "skip", "--out", str(tmp_path / command)]) == 2
        err = capsys.readouterr().err
        assert f"--on-bad-row skip: {model} was trained with AutoFeature tables" in err
        assert not (tmp_path / command).exists()
