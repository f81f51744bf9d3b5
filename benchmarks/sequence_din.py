"""DIN over a planted behaviour sequence against its references, in one run.

Data: ``terarec synth --history`` rows (``label,user,item,hist``): the click
probability depends on whether the user's history holds an item of the candidate's
topic (``terarec.data.synth_history``), with its Bayes ceiling AUC on the validation
rows. Three models train on the same rows and are scored on the same validation rows:

- ``auc_din``: ``din`` with ``hist`` a sequence field (``--sequence hist:L``) sharing
  ``item``'s table, the candidate attending over it;
- ``auc_no_sequence``: ``deepfm`` over ``user`` and ``item`` only;
- ``auc_sum_pooled``: ``deepfm`` with ``hist`` a multi-valued field, sum-pooled, on
  ``item``'s table.

Throughput: ``deepfm`` trained with ``hist`` a sequence field of length 50 against the
same model without it (``sps_ratio_sequence50``, the median training samples per
second over the passes after the first), on rows whose histories reach 50.

Prints one JSON line. ``python benchmarks/sequence_din.py [--rows 60000] [--epochs 8]``
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import terarec
from terarec.data.synth_history import HistorySettings, generate_history

# Every model trains with these: small batches and larger initial rows and learning
# rates than the defaults, so the item rows learn the planted similarity within the
# few epochs a CPU run affords.
TRAINING: dict[str, Any] = dict(batch_size=256, store={"init_std": 0.1},
                                sparse_optimizer={"lr": 0.1},
                                dense_optimizer={"lr": 0.003})


def _fit(train: Path, valid: Path, out: Path, model: str, categorical: str,
         epochs: int, **extra: Any) -> tuple[float, float]:
    """(validation AUC, training samples per second) of one model."""
    m = terarec.fit(train, valid, out=out, model=model, format="csv", label="label",
                    categorical=categorical, progress=False, refit=False, epochs=epochs,
                    select_by="auc", **TRAINING, **extra)
    auc = float(m.evaluate(valid)["auc"])
    sps = [float(h["samples_per_s"]) for h in m.history if "samples_per_s" in h]
    steady = sps[1:] or sps
    return auc, sorted(steady)[len(steady) // 2] if steady else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rows", type=int, default=60_000)
    ap.add_argument("--valid-rows", type=int, default=20_000)
    ap.add_argument("--epochs", type=int, default=8)
    ap.add_argument("--max-len", type=int, default=20)
    ap.add_argument("--speed-rows", type=int, default=20_000,
                    help="rows of the throughput runs (histories up to 50)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    settings = HistorySettings(max_history=args.max_len)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        train, valid = root / "train.csv", root / "valid.csv"
        start = time.perf_counter()
        generate_history(train, args.rows, seed=args.seed, sample_seed=0, settings=settings)
        info = generate_history(valid, args.valid_rows, seed=args.seed, sample_seed=1,
                                settings=settings)
        common = dict(epochs=args.epochs)
        seq = f"hist:{args.max_len}"
        auc_din, _ = _fit(train, valid, root / "din", "din", "user,item",
                          sequences=seq, share_tables="hist=item", **common)
        auc_none, _ = _fit(train, valid, root / "none", "deepfm", "user,item", **common)
        auc_sum, _ = _fit(train, valid, root / "sum", "deepfm", "user,item,hist",
                          multi_valued="hist", share_tables="hist=item", **common)
        # throughput: histories up to 50 long, the same model with and without them
        long = HistorySettings(max_history=50)
        fast, fast_valid = root / "train50.csv", root / "valid50.csv"
        generate_history(fast, args.speed_rows, seed=args.seed, settings=long)
        generate_history(fast_valid, args.speed_rows // 4, seed=args.seed, sample_seed=1,
                         settings=long)
        speed = dict(epochs=3)
        _, sps_none = _fit(fast, fast_valid, root / "plain", "deepfm", "user,item", **speed)
        _, sps_seq = _fit(fast, fast_valid, root / "seq50", "deepfm", "user,item",
                          sequences="hist:50", share_tables="hist=item", **speed)
    print(json.dumps({
        "benchmark": "sequence_din", "rows": args.rows, "valid_rows": args.valid_rows,
        "max_len": args.max_len, "epochs": args.epochs,
        "auc_din": round(auc_din, 4), "auc_no_sequence": round(auc_none, 4),
        "auc_sum_pooled": round(auc_sum, 4), "auc_ceiling": round(info.ceiling_auc, 4),
        "din_minus_best_reference": round(auc_din - max(auc_none, auc_sum), 4),
        "ceiling_minus_din": round(info.ceiling_auc - auc_din, 4),
        "sps_no_sequence": round(sps_none), "sps_sequence50": round(sps_seq),
        "sps_ratio_sequence50": round(sps_seq / sps_none, 3),
        "seconds": round(time.perf_counter() - start, 1),
        "load_avg": round(os.getloadavg()[0], 2)}))


if __name__ == "__main__":
    main()
