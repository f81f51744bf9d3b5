"""Held-out quality of ``terarec.fit`` given no validation files: the last 1/8 of the
training rows carved as validation rows (the default below 100,000 rows) against
``valid_split=0`` (every row trained for the sized epoch count, as before carving).

The Criteo sample (../shared/data; skipped when absent) splits as in
``real_data_quality.py``: the first 8,000 rows train, the last 2,000 are scored once and
seen by neither side. Prints one JSON line: each side's test AUC and log loss, the
validation rows, the epochs its final model trained and its seconds.

    python benchmarks/carve_validation.py [--model deepfm] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch

import terarec

SAMPLE = Path(__file__).resolve().parents[1] / ".." / "shared" / "data" \
    / "criteo-kaggle-sample" / "train-10k.txt"  # as real_data_quality.py finds it
TRAIN_ROWS = 8000


def run(model: str, seed: int, work: Path) -> dict:
    lines = SAMPLE.read_text().splitlines(keepends=True)
    train, test = work / "train.txt", work / "test.txt"
    train.write_text("".join(lines[:TRAIN_ROWS]))
    test.write_text("".join(lines[TRAIN_ROWS:]))
    result: dict = {}
    for side, extra in (("carved", {}), ("off", {"valid_split": 0})):
        start = time.perf_counter()
        fitted = terarec.fit(train, out=work / side, model=model, seed=seed, threads=1,
                             progress=False, **extra)
        scores = fitted.evaluate(test)
        metrics = json.loads((work / side / "metrics.json").read_text())
        result[side] = {
            "test_auc": round(scores["auc"], 4), "test_logloss": round(scores["logloss"], 4),
            "validation_rows": metrics["validation"].get("rows"),
            "epochs": (metrics.get("refit") or {}).get("epochs", metrics["epochs_trained"]),
            "seconds": round(time.perf_counter() - start, 1)}
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="deepfm")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    line: dict = {"benchmark": "carve_validation", "model": args.model, "seed": args.seed,
                  "split": f"first {TRAIN_ROWS} rows train, the rest test"}
    if not SAMPLE.exists():
        print(json.dumps({**line, "skipped": f"{SAMPLE} is absent"}))
        return 0
    torch.set_num_threads(1)
    load = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        line.update(run(args.model, args.seed, Path(tmp)))
    line["load_avg"] = {"start": [round(x, 2) for x in load],
                        "end": [round(x, 2) for x in os.getloadavg()]}
    print(json.dumps(line))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
