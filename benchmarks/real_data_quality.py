"""Quality of default ``terarec train`` on the real samples against one-hot logistic
regression, over seeds.

For every sample in ../shared/data (Criteo and Avazu: first 8,000 rows train, the rows
after them test; Adult: train.csv -> test.csv) and every model, ``terarec train`` runs
with default flags (only the format, the seed and ``--valid``) for each seed. The last
``VALID_FRACTION`` of the training rows is held out as ``--valid`` (early stopping and
best-pass selection see only those), terarec trains on the rest, and AUC / logloss are
``terarec eval`` on the test rows, which no selection ever sees. The baseline, measured in
the same run, is scikit-learn's logistic regression on one-hot categoricals plus
signed-log1p, standardised numerics (with missing flags), fitted on all training rows (the
same rows terarec trains and selects on) with its C picked by 3-fold cross-validation on
them (scikit-learn: the ``test`` extra, ``pip install -e ".[test]"``).

On these sizes default ``train`` refits: once validation has picked the epoch count, a
fresh model trains that long on the fit and validation rows together (``--refit``, on
below 100,000 rows), so both sides end up fitted on the same 8,000 rows.

``search``: ``terarec search`` with a fixed small budget (``--search-trials`` trials of
``--search-models``, the default space, sampler and pruner) on the same fit / valid
rows, its best trial scored on the test rows, for the first ``--search-seeds`` seeds.

Prints one JSON line (``load_avg``: the machine's load at the start and the end).

    python benchmarks/real_data_quality.py [--models deepfm,lr] [--datasets criteo] [--seeds 3]
        [--search-models deepfm] [--search-trials 8] [--search-seeds 1]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np

DATA = Path(__file__).resolve().parents[1] / ".." / "shared" / "data"
MODELS = ("lr", "fm", "widedeep", "deepfm", "dcnv2", "dlrm")
TRAIN_ROWS = 8000
CS = (0.01, 0.03, 0.1, 0.3, 1.0)
VALID_FRACTION = 0.125


@dataclass
class Sample:
    """One dataset split: files plus the columns both sides read."""

    name: str
    train: Path
    test: Path
    label: str
    numeric: list[str]
    categorical: list[str]
    criteo: bool = False
    fit: Path | None = None
    valid: Path | None = None

    def format_args(self) -> list[str]:
        if self.criteo:
            return []
        return ["--format", "csv", "--label", self.label, "--numeric", ",".join(self.numeric),
                "--categorical", ",".join(self.categorical)]


def _split_lines(src: Path, work: Path, name: str, header: bool) -> tuple[Path, Path]:
    lines = src.read_text().splitlines(keepends=True)
    head, body = (lines[:1], lines[1:]) if header else ([], lines)
    train, test = work / f"{name}-train{src.suffix}", work / f"{name}-test{src.suffix}"
    train.write_text("".join(head + body[:TRAIN_ROWS]))
    test.write_text("".join(head + body[TRAIN_ROWS:]))
    return train, test


def _hold_out(sample: Sample, work: Path) -> Sample:
    """``sample`` with its training rows split into ``fit`` (the first rows) and ``valid``
    (the last ``VALID_FRACTION``), written under ``work``."""
    lines = sample.train.read_text().splitlines(keepends=True)
    head, body = ([], lines) if sample.criteo else (lines[:1], lines[1:])
    cut = len(body) - max(1, int(len(body) * VALID_FRACTION))
    suffix = sample.train.suffix
    sample.fit = work / f"{sample.name}-fit{suffix}"
    sample.valid = work / f"{sample.name}-valid{suffix}"
    sample.fit.write_text("".join(head + body[:cut]))
    sample.valid.write_text("".join(head + body[cut:]))
    return sample


def samples(work: Path, wanted: set[str]) -> list[Sample]:
    out = []
    criteo = DATA / "criteo-kaggle-sample" / "train-10k.txt"
    if "criteo" in wanted and criteo.exists():
        train, test = _split_lines(criteo, work, "criteo", header=False)
        out.append(Sample("criteo", train, test, "label", [f"I{i}" for i in range(1, 14)],
                          [f"C{i}" for i in range(1, 27)], criteo=True))
    avazu = DATA / "avazu-sample" / "train-10k.csv"
    if "avazu" in wanted and avazu.exists():
        train, test = _split_lines(avazu, work, "avazu", header=True)
        columns = avazu.open().readline().strip().split(",")
        out.append(Sample("avazu", train, test, "click", ["hour"],
                          [c for c in columns if c not in ("id", "click", "hour")]))
    adult = DATA / "adult"
    if "adult" in wanted and (adult / "train.csv").exists():
        numeric = ["age", "fnlwgt", "educational-num", "capital-gain", "capital-loss",
                   "hours-per-week"]
        columns = (adult / "train.csv").open().readline().strip().split(",")
        out.append(Sample("adult", adult / "train.csv", adult / "test.csv", "label", numeric,
                          [c for c in columns if c not in numeric and c != "label"]))
    return [_hold_out(sample, work) for sample in out]


def _columns(sample: Sample, path: Path) -> dict[str, np.ndarray]:
    import pyarrow as pa
    import pyarrow.csv as pa_csv

    names = [sample.label, *sample.numeric, *sample.categorical] if sample.criteo else None
    read = pa_csv.ReadOptions(column_names=names) if names else pa_csv.ReadOptions()
    parse = pa_csv.ParseOptions(delimiter="\t" if sample.criteo else ",", quote_char=False)
    table = pa_csv.read_csv(path, read_options=read, parse_options=parse)
    table = table.cast(pa.schema([pa.field(n, pa.string()) for n in table.column_names]))
    return {n: np.array(table.column(n).fill_null("").to_pylist(), dtype=object)
            for n in table.column_names}


def lr_reference(sample: Sample) -> dict:
    """One-hot logistic regression, C by 3-fold CV on the training rows."""
    import scipy.sparse as sp
    from sklearn.linear_model import LogisticRegressionCV
    from sklearn.metrics import log_loss, roc_auc_score
    from sklearn.preprocessing import OneHotEncoder

    train, test = _columns(sample, sample.train), _columns(sample, sample.test)

    def numeric(cols: dict[str, np.ndarray]) -> np.ndarray:
        parts = []
        for name in sample.numeric:
            raw = cols[name]
            missing = raw == ""
            x = np.where(missing, "0", raw).astype(np.float64)
            parts += [np.sign(x) * np.log1p(np.abs(x)), missing.astype(np.float64)]
        return np.stack(parts, 1)

    encoder = OneHotEncoder(handle_unknown="ignore")
    cats = lambda cols: np.stack([cols[c].astype(str) for c in sample.categorical], 1)  # noqa: E731
    n_train, n_test = numeric(train), numeric(test)
    mean, std = n_train.mean(0), n_train.std(0) + 1e-12
    x_train = sp.hstack([encoder.fit_transform(cats(train)), (n_train - mean) / std]).tocsr()
    x_test = sp.hstack([encoder.transform(cats(test)), (n_test - mean) / std]).tocsr()
    y_train = train[sample.label].astype(int)
    y_test = test[sample.label].astype(int)
    model = LogisticRegressionCV(Cs=list(CS), cv=3, scoring="neg_log_loss", max_iter=3000)
    with warnings.catch_warnings():  # scikit-learn's notice about its future attributes
        warnings.simplefilter("ignore", FutureWarning)
        p = model.fit(x_train, y_train).predict_proba(x_test)[:, 1]
    return {"auc": float(roc_auc_score(y_test, p)), "logloss": float(log_loss(y_test, p)),
            "C": float(model.C_[0])}


def _terarec(argv: list[str]) -> None:
    from terarec.cli.main import main

    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        code = main(argv)
    if code != 0:
        raise RuntimeError(f"terarec {' '.join(argv)} exited {code}")


def terarec_default(sample: Sample, model: str, seed: int, work: Path) -> dict:
    """Default ``terarec train`` on the fit rows, selected on the held-out valid rows,
    scored by ``terarec eval`` on the test rows."""
    out = work / f"{sample.name}-{model}-{seed}"
    start = time.perf_counter()
    _terarec(["train", "--train", str(sample.fit), "--valid", str(sample.valid), "--out",
              str(out), "--model", model, "--seed", str(seed), "--no-progress",
              *sample.format_args()])
    seconds = time.perf_counter() - start
    scored = out / "test_metrics.json"
    _terarec(["eval", "--model", str(out), "--data", str(sample.test), "--out", str(scored)])
    metrics = json.loads(scored.read_text())
    return {"auc": metrics["auc"], "logloss": metrics["logloss"], "seconds": seconds}


def terarec_search(sample: Sample, model: str, seed: int, trials: int, work: Path) -> dict:
    """``terarec search`` on the fit rows, selected on the valid rows; its best trial
    scored by ``terarec eval`` on the test rows."""
    out = work / f"{sample.name}-search-{model}-{seed}"
    start = time.perf_counter()
    _terarec(["search", "--train", str(sample.fit), "--valid", str(sample.valid), "--out",
              str(out), "--model", model, "--seed", str(seed), "--trials", str(trials),
              "--no-progress", *sample.format_args()])
    seconds = time.perf_counter() - start
    scored = out / "test_metrics.json"
    _terarec(["eval", "--model", str(out / "best"), "--data", str(sample.test), "--out",
              str(scored)])
    metrics = json.loads(scored.read_text())
    return {"auc": metrics["auc"], "logloss": metrics["logloss"], "seconds": seconds}


def _summary(runs: list[dict]) -> dict:
    aucs = [r["auc"] for r in runs]
    return {"auc": [round(a, 4) for a in aucs],
            "logloss": [round(r["logloss"], 4) for r in runs],
            "auc_mean": round(float(np.mean(aucs)), 4),
            "auc_spread": round(float(max(aucs) - min(aucs)), 4),
            "seconds_mean": round(float(np.mean([r["seconds"] for r in runs])), 1)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--datasets", default="criteo,avazu,adult")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--search-models", default="deepfm",
                        help="models to search (empty: no search)")
    parser.add_argument("--search-trials", type=int, default=8)
    parser.add_argument("--search-seeds", type=int, default=1)
    args = parser.parse_args()
    models = [m for m in args.models.split(",") if m]
    searched = [m for m in args.search_models.split(",") if m]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    load_start = [round(x, 2) for x in os.getloadavg()]
    result: dict = {"benchmark": "real_data_quality", "seeds": args.seeds,
                    "machine": f"{os.cpu_count()} cores shared with other work",
                    "datasets": {}, "search": {}}
    with tempfile.TemporaryDirectory(prefix="terarec-quality-") as tmp:
        work = Path(tmp)
        found = samples(work, set(args.datasets.split(",")))
        if not found:
            print(json.dumps({**result, "error": f"no samples under {DATA}"}))
            return 1
        for sample in found:
            entry: dict = {"lr_reference": lr_reference(sample), "models": {}}
            for model in models:
                runs = [terarec_default(sample, model, seed, work)
                        for seed in range(args.seeds)]
                entry["models"][model] = _summary(runs)
                print(f"{sample.name} {model}: {entry['models'][model]}", file=sys.stderr)
            ref = entry["lr_reference"]["auc"]
            for model in searched:
                found_runs = [terarec_search(sample, model, seed, args.search_trials, work)
                              for seed in range(min(args.seeds, args.search_seeds))]
                best = {"trials": args.search_trials, **_summary(found_runs)}
                best["beats_lr_plus_0.005"] = min(best["auc"]) >= ref + 0.005
                result["search"].setdefault(sample.name, {})[model] = best
                print(f"{sample.name} search {model}: {best}", file=sys.stderr)
            if "deepfm" in entry["models"]:
                deepfm = entry["models"]["deepfm"]
                entry["deepfm_beats_lr_every_seed"] = min(deepfm["auc"]) >= ref
                entry["deepfm_spread_ok"] = deepfm["auc_spread"] <= 0.005
            result["datasets"][sample.name] = entry
    result["load_avg"] = {"start": load_start, "end": [round(x, 2) for x in os.getloadavg()]}
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
