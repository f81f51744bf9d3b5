"""``terarec synth``: write synthetic Criteo-format click logs with a known ground truth.

The train and validation files share one ground-truth model (``--seed``) and differ in
the rows drawn, so a model trained on one can be scored on the other against the best
AUC any model could reach.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from terarec.data.synth import SynthInfo, generate


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("synth", help="write synthetic Criteo-format click logs",
                       description=__doc__)
    p.add_argument("--rows", type=int, required=True, help="training rows")
    p.add_argument("--out", type=Path, required=True, help="training file (TSV)")
    p.add_argument("--valid-rows", type=int, default=0, help="validation rows (default none)")
    p.add_argument("--valid-out", type=Path, help="validation file (TSV)")
    p.add_argument("--seed", type=int, default=0,
                   help="ground-truth model seed; rows use sample seeds 2*seed and 2*seed+1")
    p.add_argument("--exponent", type=float, default=1.1,
                   help="Zipf exponent of categorical values (default 1.1)")
    p.add_argument("--vocab-scale", type=float, default=1.0,
                   help="multiply every field's vocabulary size (default 1.0)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.rows <= 0:
        raise ValueError(f"--rows must be positive, got {args.rows}")
    if args.valid_rows < 0:
        raise ValueError(f"--valid-rows must not be negative, got {args.valid_rows}")
    if (args.valid_rows > 0) != (args.valid_out is not None):
        raise ValueError("--valid-rows and --valid-out go together")
    if args.seed < 0:
        raise ValueError(f"--seed must not be negative, got {args.seed}")
    common = dict(model_seed=args.seed, exponent=args.exponent, vocab_scale=args.vocab_scale)
    jobs = [("train", args.out, args.rows, 2 * args.seed)]
    if args.valid_rows:
        jobs.append(("valid", args.valid_out, args.valid_rows, 2 * args.seed + 1))
    for name, path, rows, sample_seed in jobs:
        start = time.perf_counter()
        info = generate(path, rows, sample_seed=sample_seed, **common)
        _print(name, info, time.perf_counter() - start)
    return 0


def _print(name: str, info: SynthInfo, seconds: float) -> None:
    print(f"{name}: {info.rows:,} rows -> {info.path} ({seconds:.1f} s)\n"
          f"  CTR {100 * info.ctr:.2f} %, best reachable AUC {info.ceiling_auc:.4f} "
          f"(log loss {info.ceiling_logloss:.4f})")
