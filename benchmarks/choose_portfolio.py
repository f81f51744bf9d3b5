"""Held-out quality of ``terarec train`` with the settings portfolio on (``--choose
auto``) and off, against one-hot logistic regression, on planted truths and the shared
samples.

Synthetic truths (``terarec synth --truth T --rows N``): the first 80 % of the rows
train, the next 10 % validate (selection, early stopping and the portfolio see only
them), the last 10 % are scored with ``terarec eval``. The shared samples split as in
``real_data_quality.py`` (Criteo / Avazu: the first 8,000 rows, the last eighth of them
validating; Adult: train.csv -> test.csv). Logistic regression (scikit-learn, C by
3-fold CV) fits the training and validation rows together, as ``train`` refits on them
below 100,000 rows.

Prints one JSON line: per data set, LR's and each mode's test AUC, the member chosen
and the race's budget used (x the default run's passes) and seconds. Where ``auto``
keeps the default, its model is ``off``'s byte for byte and ``off`` is not trained
again.

    python benchmarks/choose_portfolio.py [--truths fm,deep] [--datasets criteo]
        [--rows 50000] [--model deepfm] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from real_data_quality import Sample, _terarec, lr_reference, samples  # noqa: E402

TRUTHS = ("fm", "deep", "cross", "linear", "mixed")


def synthetic(truth: str, rows: int, seed: int, work: Path) -> Sample:
    """A planted truth's rows split 80 / 10 / 10 into fit, valid and test files (and
    fit + valid as ``train``, LR's rows)."""
    whole = work / f"{truth}.tsv"
    _terarec(["synth", "--rows", str(rows), "--out", str(whole), "--truth", truth,
              "--seed", str(seed)])
    lines = whole.read_text().splitlines(keepends=True)
    a, b = int(len(lines) * 0.8), int(len(lines) * 0.9)
    parts = {"fit": lines[:a], "valid": lines[a:b], "test": lines[b:], "train": lines[:b]}
    for name, part in parts.items():
        (work / f"{truth}-{name}.tsv").write_text("".join(part))
    return Sample(truth, work / f"{truth}-train.tsv", work / f"{truth}-test.tsv", "label",
                  [f"I{i}" for i in range(1, 14)], [f"C{i}" for i in range(1, 27)],
                  criteo=True, fit=work / f"{truth}-fit.tsv",
                  valid=work / f"{truth}-valid.tsv")


def train_and_score(sample: Sample, model: str, seed: int, choose: str,
                    work: Path) -> dict:
    """``terarec train`` on the fit rows, validated on the valid rows, ``eval`` on test."""
    assert sample.fit is not None and sample.valid is not None
    out = work / f"{sample.name}-{model}-{choose}-{seed}"
    start = time.perf_counter()
    _terarec(["train", "--train", str(sample.fit), "--valid", str(sample.valid), "--out",
              str(out), "--model", model, "--seed", str(seed), "--no-progress",
              "--choose", choose, *sample.format_args()])
    seconds = time.perf_counter() - start
    scored = out / "test_metrics.json"
    _terarec(["eval", "--model", str(out), "--data", str(sample.test), "--out", str(scored)])
    metrics = json.loads(scored.read_text())
    result = {"auc": round(metrics["auc"], 4), "seconds": round(seconds, 1)}
    chosen = json.loads((out / "metrics.json").read_text()).get("chosen_settings")
    if chosen is not None:
        result.update(chosen=chosen["chosen"],
                      budget_used=chosen["budget"]["used_x_default_run"],
                      race_seconds=chosen["budget"]["seconds"],
                      valid_auc={c["name"]: None if c["valid_auc"] is None
                                 else round(c["valid_auc"], 4)
                                 for c in chosen["candidates"]})
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--truths", default=",".join(TRUTHS))
    p.add_argument("--datasets", default="criteo,avazu,adult")
    p.add_argument("--rows", type=int, default=50_000)
    p.add_argument("--model", default="deepfm")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    out: dict = {"benchmark": "choose_portfolio", "model": args.model, "seed": args.seed,
                 "rows": args.rows, "results": {}}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        wanted = [t for t in args.truths.split(",") if t]
        data = [synthetic(t, args.rows, args.seed, work) for t in wanted]
        data += samples(work, {d for d in args.datasets.split(",") if d})
        for sample in data:
            row = {"lr": round(lr_reference(sample)["auc"], 4)}
            row["auto"] = train_and_score(sample, args.model, args.seed, "auto", work)
            if row["auto"].get("chosen") == "default":
                # the default kept: the run is --choose off's, byte for byte
                # (tests/train/test_portfolio.py), so it is not trained again
                row["off"] = {"auc": row["auto"]["auc"], "same_model_as_auto": True}
            else:
                row["off"] = train_and_score(sample, args.model, args.seed, "off", work)
            row["auto_minus_lr"] = round(row["auto"]["auc"] - row["lr"], 4)
            row["off_minus_lr"] = round(row["off"]["auc"] - row["lr"], 4)
            out["results"][sample.name] = row
            print(json.dumps({sample.name: row}), file=sys.stderr, flush=True)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
