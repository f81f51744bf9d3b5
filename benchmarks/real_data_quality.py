"""Quality of default ``terarec train`` on the real samples against one-hot logistic
regression, over seeds.

For every sample in ../shared/data (Criteo and Avazu: first 8,000 rows train, the rows
after them test; Adult: train.csv -> test.csv) and every model, ``terarec train`` runs
with default flags (only the format, the seed and ``--valid``) for each seed; AUC and
logloss come from the model's own metrics.json (evaluated on the test rows). The
baseline, measured in the same run on the same split, is scikit-learn's logistic
regression on one-hot categoricals plus signed-log1p, standardised numerics (with missing
flags), its C picked by 3-fold cross-validation on the training rows.

Prints one JSON line. ``search`` is left null: the hook for the multi-trial search's
figures once ``terarec search`` exists.

    python benchmarks/real_data_quality.py [--models deepfm,lr] [--datasets criteo] [--seeds 3]
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
    return out


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


def terarec_default(sample: Sample, model: str, seed: int, work: Path) -> dict:
    from terarec.cli.main import main

    out = work / f"{sample.name}-{model}-{seed}"
    argv = ["train", "--train", str(sample.train), "--valid", str(sample.test), "--out",
            str(out), "--model", model, "--seed", str(seed), "--no-progress",
            *sample.format_args()]
    start = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        code = main(argv)
    if code != 0:
        raise RuntimeError(f"terarec {' '.join(argv)} exited {code}")
    metrics = json.loads((out / "metrics.json").read_text())
    return {"auc": metrics["auc"], "logloss": metrics["logloss"],
            "seconds": time.perf_counter() - start}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--datasets", default="criteo,avazu,adult")
    parser.add_argument("--seeds", type=int, default=3)
    args = parser.parse_args()
    models = [m for m in args.models.split(",") if m]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    result: dict = {"benchmark": "real_data_quality", "seeds": args.seeds,
                    "machine": f"{os.cpu_count()} cores shared with other work (loaded)",
                    "datasets": {}, "search": None}
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
                aucs = [r["auc"] for r in runs]
                entry["models"][model] = {
                    "auc": [round(a, 4) for a in aucs],
                    "logloss": [round(r["logloss"], 4) for r in runs],
                    "auc_mean": round(float(np.mean(aucs)), 4),
                    "auc_spread": round(float(max(aucs) - min(aucs)), 4),
                    "seconds_mean": round(float(np.mean([r["seconds"] for r in runs])), 1)}
                print(f"{sample.name} {model}: {entry['models'][model]}", file=sys.stderr)
            ref = entry["lr_reference"]["auc"]
            if "deepfm" in entry["models"]:
                deepfm = entry["models"]["deepfm"]
                entry["deepfm_beats_lr_every_seed"] = min(deepfm["auc"]) >= ref
                entry["deepfm_spread_ok"] = deepfm["auc_spread"] <= 0.005
            result["datasets"][sample.name] = entry
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
