"""AutoFeature end to end: does selection find the features that matter, and what do they buy?

1. Planted data (``terarec.data.synth_features``): labels depend on the training count of
   C3's value and on whether the (C5, C7) pair is a popular one. ``terarec autofeature``
   with its default candidates (counts, cross counts, group-by aggregates) must select
   ``count(C3)`` and ``cross_count(C5,C7)``; the validation AUC gain over the raw features
   is reported together with the AUC of the true model.
2. The Criteo Kaggle sample (``../shared/data/criteo-kaggle-sample/train-10k.txt``; first
   8,000 rows train, last 2,000 validate; skipped when absent): the gain as measured,
   whatever it is.

Both go through the command line exactly as a user would run it, and the AUCs are those
of the selection model (LR on every sampled row). Prints one JSON line per data set.
Usage: ``python benchmarks/autofeature.py [--rows N] [--keep DIR]``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import tempfile
import time
from pathlib import Path

from terarec.cli.main import main
from terarec.data.synth_features import generate_planted

CRITEO_SAMPLE = (Path(__file__).resolve().parents[1] / ".." / "shared" / "data"
                 / "criteo-kaggle-sample" / "train-10k.txt")
PLANTED_SCHEMA = ["--format", "csv", "--label", "label", "--numeric", "I1,I2",
                  "--categorical", "C1,C2,C3,C4,C5,C6,C7,C8", "--log1p", "I1,I2"]


def autofeature(train: Path, valid: Path, out: Path, schema_args: list[str],
                extra: list[str]) -> dict:
    """Run ``terarec autofeature`` quietly; return the summary it saved."""
    log = io.StringIO()
    start = time.perf_counter()
    with contextlib.redirect_stdout(log):
        code = main(["autofeature", "--train", str(train), "--valid", str(valid),
                     *schema_args, "--out", str(out), *extra])
    if code != 0:
        raise SystemExit(f"terarec autofeature failed ({code}):\n{log.getvalue()}")
    summary = json.loads(out.with_name(out.stem + ".gains.json").read_text())
    summary["seconds"] = round(time.perf_counter() - start, 1)
    return summary


def report(name: str, summary: dict, **extra: object) -> None:
    line = {"data": name, "candidates": summary["candidates"],
            "selected": summary["selected"], "auc_raw": round(summary["auc_raw"], 4),
            "auc_with_features": round(summary["auc_with_features"], 4),
            "gain": round(summary["gain"], 4), **extra,
            "evaluations": summary["evaluations"], "seconds": summary["seconds"]}
    print(json.dumps(line), flush=True)


def main_(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=50_000, help="planted training rows")
    parser.add_argument("--keep", type=Path, help="keep the outputs in this directory")
    parser.add_argument("--memory-limit", default="1GB")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="autofeature-bench-") as tmp:
        root = args.keep or Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        common = ["--memory-limit", args.memory_limit]

        data = generate_planted(root / "planted-train.csv", root / "planted-valid.csv",
                                args.rows, args.rows // 4, seed=0)
        summary = autofeature(data.train, data.valid, root / "planted" / "features.json",
                              PLANTED_SCHEMA, common)
        report("planted", summary,
               found_planted=set(data.planted) <= set(summary["selected"]),
               planted=list(data.planted), ceiling_auc=round(data.ceiling_auc, 4))

        if not CRITEO_SAMPLE.exists():
            print(json.dumps({"data": "criteo-kaggle-sample", "skipped": f"{CRITEO_SAMPLE} "
                              "is absent"}))
            return
        lines = CRITEO_SAMPLE.read_text().splitlines(keepends=True)
        train, valid = root / "criteo-train.txt", root / "criteo-valid.txt"
        train.write_text("".join(lines[:8000]))
        valid.write_text("".join(lines[8000:]))
        summary = autofeature(train, valid, root / "criteo" / "features.json",
                              ["--format", "criteo"], common)
        report("criteo-kaggle-sample", summary, train_rows=8000, valid_rows=len(lines) - 8000)


if __name__ == "__main__":
    main_()
