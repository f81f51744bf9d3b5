"""Quality on held-out rows: default DeepFM and ``search`` against references trained on
the same rows, on the real samples and on every planted truth.

Data sets (``--datasets``, all by default):

- the samples in ../shared/data: Criteo and Avazu (first 8,000 rows train, the rows after
  them test), Adult (train.csv train, test.csv test); skipped when absent;
- every synthetic truth of ``terarec synth`` (fm, deep, cross, linear, mixed): ``--rows``
  training rows (default 50,000; ``--rows-large`` adds a 500,000-row run of each) drawn
  from ground-truth seed 0, and ``--test-rows`` fresh test rows from the same truth; the
  test rows' Bayes ceiling AUC is reported beside the models.

Split, the same for every model: the last ``VALID_FRACTION`` (1/8) of the training rows
are the validation rows, the rest the fit rows; the test rows are scored once at the end
and nothing selects or trains on them. Every model selects its settings or stopping point
on the validation rows and, below ``REFIT_BELOW`` training rows (where ``terarec.fit``
refits), is then refit on fit + validation rows, so the final models of every side are
trained on the same rows.

Models:

- ``default``: ``terarec.fit(fit, valid, seed=s)`` (DeepFM), nothing else given,
  for ``--seeds`` seeds (AUC per seed, mean, spread);
- ``search``: ``terarec.search(..., trials=--search-trials)`` (its default space, TPE,
  halving), best trial scored; seed 0, budget (trials, seconds) stated;
- ``lr``: scikit-learn logistic regression on one-hot categoricals plus signed-log1p,
  standardised numerics with missing flags, C from ``LR_CS`` by validation log loss;
- ``mlp``: a torch MLP on the same one-hot rows (values seen once in training share one
  bucket per field): first layer of ``width`` units over the one-hot and numeric inputs,
  a second of ``width``, a logit; Adam; the grid ``MLP_GRID`` of width x rate, each
  early-stopped on validation log loss (patience 2, at most ``MLP_EPOCHS`` epochs);
- ``hgb``: ``HistGradientBoostingClassifier`` on the raw numerics and each categorical's
  254 most frequent values (native categorical splits), early-stopped on the validation
  rows (where the data has numerics: all these data sets do).

Targets per data set: default at or above the best of LR and MLP in every seed; search
at or above the best reference + 0.005 and not below the default of its own seed (0);
DeepFM's seed spread <= 0.005. Prints one JSON line (``load_avg`` at start and end) on stdout and a
table on stderr. ``--quick``: small rows, one seed, two trials, one MLP setting.

    python benchmarks/real_data_quality.py [--datasets criteo,fm] [--seeds 2]
        [--search-trials 4] [--rows 50000] [--rows-large] [--quick] [--jobs 2]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

DATA = Path(__file__).resolve().parents[1] / ".." / "shared" / "data"
SHARED = ("criteo", "avazu", "adult")
TRUTHS = ("fm", "deep", "cross", "linear", "mixed")
TRAIN_ROWS = 8000            # Criteo / Avazu: training rows, the rest of the file tests
VALID_FRACTION = 0.125
REFIT_BELOW = 100_000        # terarec.fit refits on train + valid below this many rows
LARGE_ROWS = 500_000
LR_CS = (0.01, 0.03, 0.1, 0.3, 1.0)
MLP_GRID = ((64, 1e-3), (64, 3e-3), (256, 1e-3), (256, 3e-3))
MLP_EPOCHS = 15
MLP_BATCH = 512
HGB_BINS = 255               # scikit-learn's limit for native categorical values


@dataclass
class Sample:
    """One data set: the fit / valid / test files and the columns every side reads."""

    name: str
    fit: Path
    valid: Path
    test: Path
    label: str
    numeric: list[str]
    categorical: list[str]
    criteo: bool = False
    ceiling_auc: float | None = None
    rows: dict[str, int] = field(default_factory=dict)

    def data_settings(self) -> dict[str, Any]:
        """``terarec.fit`` keywords describing the files (none for Criteo's format)."""
        if self.criteo:
            return {}
        return {"format": "csv", "label": self.label, "numeric": self.numeric,
                "categorical": self.categorical}

    @property
    def train_rows(self) -> int:
        return self.rows["fit"] + self.rows["valid"]

    @property
    def refit(self) -> bool:
        return self.train_rows < REFIT_BELOW


def _lines(path: Path, header: bool) -> tuple[list[str], list[str]]:
    lines = path.read_text().splitlines(keepends=True)
    return (lines[:1], lines[1:]) if header else ([], lines)


def _write_split(name: str, head: list[str], train: list[str], test: list[str], work: Path,
                 suffix: str) -> tuple[Path, Path, Path, dict[str, int]]:
    """fit / valid (the last ``VALID_FRACTION`` of ``train``) / test files under ``work``."""
    cut = len(train) - max(1, int(len(train) * VALID_FRACTION))
    paths = tuple(work / f"{name}-{part}{suffix}" for part in ("fit", "valid", "test"))
    for path, body in zip(paths, (train[:cut], train[cut:], test), strict=True):
        path.write_text("".join(head + body))
    return (*paths, {"fit": cut, "valid": len(train) - cut, "test": len(test)})


def shared_sample(name: str, work: Path) -> Sample | None:
    """One of ../shared/data's samples split under ``work``; None when it is absent."""
    if name == "criteo":
        src = DATA / "criteo-kaggle-sample" / "train-10k.txt"
        if not src.exists():
            return None
        head, body = _lines(src, header=False)
        *paths, rows = _write_split(name, head, body[:TRAIN_ROWS], body[TRAIN_ROWS:], work,
                                    ".txt")
        return Sample(name, *paths, "label", [f"I{i}" for i in range(1, 14)],
                      [f"C{i}" for i in range(1, 27)], criteo=True, rows=rows)
    if name == "avazu":
        src = DATA / "avazu-sample" / "train-10k.csv"
        if not src.exists():
            return None
        head, body = _lines(src, header=True)
        *paths, rows = _write_split(name, head, body[:TRAIN_ROWS], body[TRAIN_ROWS:], work,
                                    ".csv")
        columns = head[0].strip().split(",")
        return Sample(name, *paths, "click", ["hour"],
                      [c for c in columns if c not in ("id", "click", "hour")], rows=rows)
    if name == "adult":
        src = DATA / "adult"
        if not (src / "train.csv").exists():
            return None
        head, body = _lines(src / "train.csv", header=True)
        numeric = ["age", "fnlwgt", "educational-num", "capital-gain", "capital-loss",
                   "hours-per-week"]
        *paths, rows = _write_split(name, head, body, _lines(src / "test.csv", True)[1],
                                    work, ".csv")
        columns = head[0].strip().split(",")
        return Sample(name, *paths, "label", numeric,
                      [c for c in columns if c not in numeric and c != "label"], rows=rows)
    raise ValueError(f"unknown shared sample {name!r}; known: {', '.join(SHARED)}")


def truth_sample(truth: str, rows: int, test_rows: int, work: Path) -> Sample:
    """``rows`` training rows and ``test_rows`` test rows of planted truth ``truth``
    (ground-truth seed 0; training rows sample seed 0, test rows sample seed 1)."""
    from terarec.data.synth import generate

    name = f"{truth}-{rows}"
    train, test = work / f"{name}-all.txt", work / f"{name}-test-src.txt"
    generate(train, rows, model_seed=0, sample_seed=0, truth=truth)
    info = generate(test, test_rows, model_seed=0, sample_seed=1, truth=truth)
    *paths, split = _write_split(name, [], _lines(train, False)[1], _lines(test, False)[1],
                                 work, ".txt")
    return Sample(name, *paths, "label", [f"I{i}" for i in range(1, 14)],
                  [f"C{i}" for i in range(1, 27)], criteo=True,
                  ceiling_auc=round(info.ceiling_auc, 4), rows=split)


# --------------------------------------------------------------------------- encoding


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


@dataclass
class Encoded:
    """Every row of a sample (fit, then valid, then test) as the references read them:
    per-field value codes, raw numerics (NaN = missing) and labels."""

    codes: np.ndarray        # int64 [rows, fields], a code per distinct value per field
    numeric: np.ndarray      # float64 [rows, numerics]
    labels: np.ndarray       # int64 [rows]
    parts: dict[str, slice]  # fit / valid / test / train (fit + valid) row ranges

    @classmethod
    def of(cls, sample: Sample) -> Encoded:
        cols = [_columns(sample, p) for p in (sample.fit, sample.valid, sample.test)]
        n = [len(c[sample.label]) for c in cols]
        parts = {"fit": slice(0, n[0]), "valid": slice(n[0], n[0] + n[1]),
                 "test": slice(n[0] + n[1], sum(n)), "train": slice(0, n[0] + n[1])}
        joined = {k: np.concatenate([c[k] for c in cols]) for k in cols[0]}
        codes = np.stack([np.unique(joined[c].astype(str), return_inverse=True)[1]
                          for c in sample.categorical], 1).astype(np.int64)
        numeric = np.stack([np.where(joined[c] == "", "nan", joined[c]).astype(np.float64)
                            for c in sample.numeric], 1)
        return cls(codes, numeric, joined[sample.label].astype(np.int64), parts)

    def onehot(self, rows: slice, min_count: int) -> tuple[np.ndarray, int]:
        """Column indices ``[all rows, fields]`` of a one-hot encoding whose vocabulary is
        the values seen ``min_count`` times in ``rows``; other values share their field's
        last column. Returns the indices and the column count."""
        out = np.empty_like(self.codes)
        offset = 0
        for f in range(self.codes.shape[1]):
            counts = np.bincount(self.codes[rows, f], minlength=int(self.codes[:, f].max()) + 1)
            kept = counts >= min_count
            index = np.full(counts.size, int(kept.sum()), dtype=np.int64)
            index[kept] = np.arange(int(kept.sum()))
            out[:, f] = offset + index[self.codes[:, f]]
            offset += int(kept.sum()) + 1
        return out, offset

    def dense(self, rows: slice) -> np.ndarray:
        """Signed log1p numerics standardised on ``rows``, plus a missing flag each."""
        missing = np.isnan(self.numeric)
        x = np.where(missing, 0.0, self.numeric)
        x = np.sign(x) * np.log1p(np.abs(x))
        mean, std = x[rows].mean(0), x[rows].std(0) + 1e-12
        return np.concatenate([(x - mean) / std, missing.astype(np.float64)], 1)


def _scores(y: np.ndarray, p: np.ndarray) -> dict[str, float]:
    from sklearn.metrics import log_loss, roc_auc_score

    p = np.clip(p, 1e-7, 1 - 1e-7)
    return {"auc": float(roc_auc_score(y, p)), "logloss": float(log_loss(y, p, labels=[0, 1]))}


def _final(enc: Encoded, sample: Sample) -> slice:
    """The rows a reference's final model trains on: terarec's (fit + valid on a refit)."""
    return enc.parts["train"] if sample.refit else enc.parts["fit"]


def lr_reference(sample: Sample, enc: Encoded) -> dict[str, Any]:
    """One-hot logistic regression, C by validation log loss, refit like terarec."""
    import scipy.sparse as sp
    from sklearn.linear_model import LogisticRegression

    def design(rows: slice) -> sp.csr_matrix:
        cols, width = enc.onehot(rows, min_count=1)
        n, f = cols.shape
        onehot = sp.csr_matrix((np.ones(n * f), cols.ravel(), np.arange(0, n * f + 1, f)),
                               shape=(n, width))
        return sp.hstack([onehot, enc.dense(rows)]).tocsr()

    def fitted(x: sp.csr_matrix, rows: slice, c: float) -> LogisticRegression:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # convergence notices at the smallest C
            return LogisticRegression(C=c, max_iter=2000).fit(x[rows], enc.labels[rows])

    start = time.perf_counter()
    x = design(enc.parts["fit"])
    valid = {c: _scores(enc.labels[enc.parts["valid"]],
                        fitted(x, enc.parts["fit"], c).predict_proba(x[enc.parts["valid"]])[:, 1])
             for c in LR_CS}
    best = min(LR_CS, key=lambda c: valid[c]["logloss"])
    rows = _final(enc, sample)
    x = design(rows)
    p = fitted(x, rows, best).predict_proba(x[enc.parts["test"]])[:, 1]
    return {**_scores(enc.labels[enc.parts["test"]], p), "C": best,
            "trained_rows": rows.stop - rows.start,
            "seconds": round(time.perf_counter() - start, 1)}


def _mlp_train(x_cat: np.ndarray, x_num: np.ndarray, y: np.ndarray, columns: int,
               width: int, rate: float, epochs: int, seed: int,
               valid: tuple[np.ndarray, np.ndarray, np.ndarray] | None
               ) -> tuple[Callable[[np.ndarray, np.ndarray], np.ndarray], list[float]]:
    """Train the one-hot MLP; return its scorer and the validation log loss per epoch
    (stopping after 2 epochs without improvement when ``valid`` is given)."""
    import torch
    from torch import nn

    torch.manual_seed(seed)
    fields = x_cat.shape[1]
    first = nn.EmbeddingBag(columns, width, mode="sum", sparse=True)
    bound = (fields + x_num.shape[1]) ** -0.5  # a linear layer's init over the active inputs
    nn.init.uniform_(first.weight, -bound, bound)
    numeric = nn.Linear(x_num.shape[1], width)
    top = nn.Sequential(nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 1))
    dense_params = [*numeric.parameters(), *top.parameters()]
    optimizers = [torch.optim.SparseAdam(list(first.parameters()), lr=rate),
                  torch.optim.Adam(dense_params, lr=rate)]
    loss_fn = nn.BCEWithLogitsLoss()

    def logits(cat: torch.Tensor, num: torch.Tensor) -> torch.Tensor:
        return top(first(cat) + numeric(num)).squeeze(1)

    def score(cat: np.ndarray, num: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            out = [torch.sigmoid(logits(torch.from_numpy(cat[i:i + 8192]),
                                        torch.from_numpy(num[i:i + 8192]).float())).numpy()
                   for i in range(0, len(cat), 8192)]
        return np.concatenate(out).astype(np.float64)

    gen = np.random.default_rng(seed)
    history: list[float] = []
    for _ in range(epochs):
        order = gen.permutation(len(y))
        for i in range(0, len(y), MLP_BATCH):
            batch = order[i:i + MLP_BATCH]
            loss = loss_fn(logits(torch.from_numpy(x_cat[batch]),
                                  torch.from_numpy(x_num[batch]).float()),
                           torch.from_numpy(y[batch]).float())
            for opt in optimizers:
                opt.zero_grad()
            loss.backward()
            for opt in optimizers:
                opt.step()
        if valid is not None:
            history.append(_scores(valid[2], score(valid[0], valid[1]))["logloss"])
            if len(history) - 1 - int(np.argmin(history)) >= 2:
                break
    return score, history


def mlp_reference(sample: Sample, enc: Encoded, grid: tuple[tuple[int, float], ...] = MLP_GRID,
                  epochs: int = MLP_EPOCHS) -> dict[str, Any]:
    """The one-hot MLP: ``grid`` (width, rate) and the epoch count chosen on the
    validation rows, then trained again like terarec (refit on fit + valid)."""
    import torch

    torch.set_num_threads(1)
    start = time.perf_counter()
    fit, valid, test = enc.parts["fit"], enc.parts["valid"], enc.parts["test"]
    cat, columns = enc.onehot(fit, min_count=2)
    num = enc.dense(fit)
    tried = []
    for width, rate in grid:
        _, history = _mlp_train(cat[fit], num[fit], enc.labels[fit], columns, width, rate,
                                epochs, 0, (cat[valid], num[valid], enc.labels[valid]))
        tried.append((min(history), width, rate, int(np.argmin(history)) + 1))
    best_loss, width, rate, best_epochs = min(tried)
    rows = _final(enc, sample)
    cat, columns = enc.onehot(rows, min_count=2)
    num = enc.dense(rows)
    score, _ = _mlp_train(cat[rows], num[rows], enc.labels[rows], columns, width, rate,
                          best_epochs, 0, None)
    return {**_scores(enc.labels[test], score(cat[test], num[test])), "width": width,
            "rate": rate, "epochs": best_epochs, "valid_logloss": round(best_loss, 4),
            "trained_rows": rows.stop - rows.start,
            "seconds": round(time.perf_counter() - start, 1)}


def hgb_reference(sample: Sample, enc: Encoded) -> dict[str, Any] | None:
    """Histogram gradient boosting on raw numerics and each field's 254 most frequent
    values (the rest missing), its iteration count early-stopped on the validation rows;
    None without numerics."""
    from sklearn.ensemble import HistGradientBoostingClassifier

    if not sample.numeric:
        return None
    start = time.perf_counter()
    fit, valid, test = enc.parts["fit"], enc.parts["valid"], enc.parts["test"]

    def design(rows: slice) -> np.ndarray:
        cats = np.full(enc.codes.shape, np.nan)
        for f in range(enc.codes.shape[1]):
            counts = np.bincount(enc.codes[rows, f], minlength=int(enc.codes[:, f].max()) + 1)
            top = np.argsort(-counts, kind="stable")[:HGB_BINS - 1]
            top = top[counts[top] > 0]
            index = np.full(counts.size, np.nan)
            index[top] = np.arange(top.size)
            cats[:, f] = index[enc.codes[:, f]]
        return np.concatenate([enc.numeric, cats], 1)

    is_cat = [False] * enc.numeric.shape[1] + [True] * enc.codes.shape[1]
    x = design(fit)
    probe = HistGradientBoostingClassifier(max_iter=1000, learning_rate=0.1,
                                           categorical_features=is_cat, early_stopping=True,
                                           n_iter_no_change=20, random_state=0)
    probe.fit(x[fit], enc.labels[fit], X_val=x[valid], y_val=enc.labels[valid])
    iterations = int(probe.n_iter_)
    rows = _final(enc, sample)
    x = design(rows)
    model = HistGradientBoostingClassifier(max_iter=iterations, learning_rate=0.1,
                                           categorical_features=is_cat, early_stopping=False,
                                           random_state=0).fit(x[rows], enc.labels[rows])
    return {**_scores(enc.labels[test], model.predict_proba(x[test])[:, 1]),
            "iterations": iterations, "trained_rows": rows.stop - rows.start,
            "seconds": round(time.perf_counter() - start, 1)}


# --------------------------------------------------------------------------- terarec


def terarec_default(sample: Sample, seed: int, work: Path) -> dict[str, Any]:
    """``terarec.fit`` with nothing but the data description and the seed, selected on
    the valid rows, scored on the test rows."""
    import terarec

    start = time.perf_counter()
    model = terarec.fit(sample.fit, sample.valid, out=work / f"{sample.name}-default-{seed}",
                        seed=seed, progress=False, **sample.data_settings())
    seconds = time.perf_counter() - start
    scored = model.evaluate(sample.test)
    refit = model.metrics.get("refit") or {}
    chosen = {c["key"]: c["chosen"] for c in model.metrics.get("chosen_by_validation") or []}
    return {"auc": scored["auc"], "logloss": scored["logloss"], "seconds": seconds,
            "chosen": chosen,
            "epochs": model.metrics.get("epochs_trained"),
            "trained_rows": sample.train_rows if refit else sample.rows["fit"]}


def terarec_search(sample: Sample, trials: int, work: Path) -> dict[str, Any]:
    """``terarec.search`` (``trials`` DeepFM trials, default space, TPE, halving) on the
    fit rows, selected on the valid rows; its best (refit) model scored on the test rows."""
    import terarec

    start = time.perf_counter()
    outcome = terarec.search(sample.fit, sample.valid, out=work / f"{sample.name}-search",
                             trials=trials, seed=0, progress=False,
                             **sample.data_settings())
    seconds = time.perf_counter() - start
    if outcome.best is None:
        raise RuntimeError(f"{sample.name}: no search trial scored")
    scored = outcome.best.evaluate(sample.test)
    return {"auc": round(scored["auc"], 4), "logloss": round(scored["logloss"], 4),
            "trials": trials, "seconds": round(seconds, 1)}


# --------------------------------------------------------------------------- one data set


@dataclass
class Plan:
    """What to run on each data set."""

    seeds: int
    search_trials: int
    mlp_grid: tuple[tuple[int, float], ...] = MLP_GRID
    mlp_epochs: int = MLP_EPOCHS


def evaluate_sample(sample: Sample, plan: Plan, work: Path) -> dict[str, Any]:
    """Every model on one data set, and whether the targets hold."""
    import torch

    torch.set_num_threads(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # evaluate's notice on in-sample rows: none here
        enc = Encoded.of(sample)
        refs: dict[str, Any] = {"lr": lr_reference(sample, enc),
                                "mlp": mlp_reference(sample, enc, plan.mlp_grid, plan.mlp_epochs)}
        hgb = hgb_reference(sample, enc)
        if hgb is not None:
            refs["hgb"] = hgb
        runs = [terarec_default(sample, seed, work) for seed in range(plan.seeds)]
        found = terarec_search(sample, plan.search_trials, work) if plan.search_trials else None
    for ref in refs.values():
        ref["auc"], ref["logloss"] = round(ref["auc"], 4), round(ref["logloss"], 4)
    aucs = [r["auc"] for r in runs]
    default = {"auc": [round(a, 4) for a in aucs],
               "logloss": [round(r["logloss"], 4) for r in runs],
               "auc_mean": round(float(np.mean(aucs)), 4),
               "auc_spread": round(float(max(aucs) - min(aucs)), 4),
               "epochs": [r["epochs"] for r in runs],
               "chosen": [r["chosen"] for r in runs],
               "trained_rows": runs[0]["trained_rows"],
               "seconds_mean": round(float(np.mean([r["seconds"] for r in runs])), 1)}
    linear_or_mlp = max(refs["lr"]["auc"], refs["mlp"]["auc"])
    best_ref = max(r["auc"] for r in refs.values())
    targets: dict[str, Any] = {
        "default_minus_best_lr_mlp": round(min(aucs) - linear_or_mlp, 4),
        "default_ge_lr_mlp": min(aucs) >= linear_or_mlp,
        "spread_le_0.005": default["auc_spread"] <= 0.005}
    if found is not None:
        targets |= {"search_minus_best_ref": round(found["auc"] - best_ref, 4),
                    "search_ge_ref_plus_0.005": found["auc"] >= best_ref + 0.005,
                    # The search runs seed 0, so it is held to the default of seed 0: a
                    # search that keeps the default then ties it instead of losing to
                    # the other seeds' noise.
                    "search_minus_default_seed0": round(found["auc"] - aucs[0], 4),
                    "search_ge_default": found["auc"] >= aucs[0]}
    entry: dict[str, Any] = {"rows": sample.rows, "refit": sample.refit}
    if sample.ceiling_auc is not None:
        entry["ceiling_auc"] = sample.ceiling_auc
    return {**entry, "default": default, "search": found, "references": refs,
            "targets": targets}


def _evaluate_named(name: str, rows: int, test_rows: int, plan: Plan, work: str
                    ) -> tuple[str, dict[str, Any] | None]:
    """Build and evaluate one data set by name (a process pool's unit of work)."""
    folder = Path(work)
    sample = (shared_sample(name, folder) if name in SHARED
              else truth_sample(name, rows, test_rows, folder))
    if sample is None:
        return name, None
    result = evaluate_sample(sample, plan, folder)
    refs = " ".join(f"{k} {v['auc']:.4f}" for k, v in result["references"].items())
    search = f" search {result['search']['auc']:.4f}" if result["search"] else ""
    print(f"{sample.name}: default {result['default']['auc']}{search} {refs}",
          file=sys.stderr, flush=True)
    return sample.name, result


def _table(datasets: dict[str, dict[str, Any]]) -> str:
    head = (f"{'data set':<14}{'fit/valid/test':>22}{'ceiling':>9}{'default':>16}"
            f"{'search':>9}{'LR':>8}{'MLP':>8}{'HGB':>8}  targets (default>=LR,MLP; "
            "search>=ref+.005; search>=default; spread)")
    lines = [head, "-" * len(head)]
    for name, d in datasets.items():
        rows = "/".join(f"{d['rows'][k]:,}" for k in ("fit", "valid", "test"))
        default = f"{d['default']['auc_mean']:.4f}±{d['default']['auc_spread'] / 2:.4f}"
        refs = d["references"]
        cells = [f"{refs[k]['auc']:.4f}" if k in refs else "-" for k in ("lr", "mlp", "hgb")]
        search = f"{d['search']['auc']:.4f}" if d["search"] else "-"
        t = d["targets"]
        marks = " ".join("yes" if t.get(k) else ("-" if k not in t else "NO")
                         for k in ("default_ge_lr_mlp", "search_ge_ref_plus_0.005",
                                   "search_ge_default", "spread_le_0.005"))
        ceiling = f"{d['ceiling_auc']:.4f}" if "ceiling_auc" in d else "-"
        lines.append(f"{name:<14}{rows:>22}{ceiling:>9}{default:>16}{search:>9}"
                     + "".join(f"{c:>8}" for c in cells) + f"  {marks}")
    return "\n".join(lines)


def run(datasets: list[str], rows: list[int], test_rows: int, plan: Plan, jobs: int,
        work: Path) -> dict[str, dict[str, Any]]:
    """Evaluate every data set (the truths once per entry of ``rows``), ``jobs`` at a time."""
    units = [(name, 0) for name in datasets if name in SHARED]
    units += [(name, n) for n in rows for name in datasets if name in TRUTHS]
    args = [(name, n, test_rows, plan, str(work)) for name, n in units]
    if jobs <= 1:
        done = [_evaluate_named(*a) for a in args]
    else:
        import multiprocessing

        with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            done = list(pool.map(_evaluate_named, *zip(*args, strict=True)))
    return {name: result for name, result in done if result is not None}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--datasets", default=",".join(SHARED + TRUTHS))
    parser.add_argument("--seeds", type=int, default=2, help="seeds of default DeepFM")
    parser.add_argument("--search-trials", type=int, default=4, help="0: no search")
    parser.add_argument("--rows", type=int, default=50_000, help="training rows per truth")
    parser.add_argument("--rows-large", action="store_true",
                        help=f"also every truth at {LARGE_ROWS:,} training rows")
    parser.add_argument("--test-rows", type=int, default=20_000, help="test rows per truth")
    parser.add_argument("--jobs", type=int, default=2, help="data sets evaluated at once")
    parser.add_argument("--quick", action="store_true",
                        help="5,000 truth rows, one seed, two trials, one MLP setting")
    args = parser.parse_args(argv)
    names = [n for n in args.datasets.split(",") if n]
    unknown = sorted(set(names) - set(SHARED + TRUTHS))
    if unknown:
        parser.error(f"--datasets: unknown {', '.join(unknown)}; known: "
                     f"{', '.join(SHARED + TRUTHS)}")
    plan = Plan(args.seeds, args.search_trials)
    rows = [args.rows] + ([LARGE_ROWS] if args.rows_large else [])
    if args.quick:
        plan = Plan(1, min(args.search_trials, 2), MLP_GRID[:1], 4)
        rows = [min(args.rows, 5000)]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    load_start = [round(x, 2) for x in os.getloadavg()]
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="terarec-quality-") as tmp:
        datasets = run(names, rows, args.test_rows, plan, args.jobs, Path(tmp))
    result: dict[str, Any] = {
        "benchmark": "real_data_quality", "seeds": plan.seeds,
        "search": {"trials": plan.search_trials, "model": "deepfm", "seed": 0},
        "split": f"last {VALID_FRACTION:g} of training rows validate; refit on train+valid "
                 f"below {REFIT_BELOW:,} rows; test rows never selected or trained on",
        "machine": f"{os.cpu_count()} cores shared with other work", "jobs": args.jobs,
        "datasets": datasets}
    if not datasets:
        print(json.dumps({**result, "error": f"no data sets (samples looked for in {DATA})"}))
        return 1
    print(_table(datasets), file=sys.stderr)
    result["seconds"] = round(time.perf_counter() - start, 1)
    result["load_avg"] = {"start": load_start, "end": [round(x, 2) for x in os.getloadavg()]}
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
