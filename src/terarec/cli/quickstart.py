"""``terarec quickstart``: the whole loop on one machine in about a minute.

Synthesises Criteo-format click logs with a planted ground-truth model, then runs
``terarec train`` on them as a user would (its data-sized defaults, validation picking
the best pass), and compares the validation AUC with the best reachable one; ``train``
writes the HTML report with plots.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

from terarec.io import file_above


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("quickstart", help="synthesise data, train, evaluate, report",
                       description=__doc__)
    p.add_argument("--workdir", type=Path, default=Path("terarec-quickstart"),
                   help="where data, model and report go (default ./terarec-quickstart)")
    p.add_argument("--rows", type=int, default=1_000_000, help="training rows")
    p.add_argument("--valid-rows", type=int, default=100_000, help="validation rows")
    p.add_argument("--model", default="deepfm", help="model name (default deepfm)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=run)


def _check(args: argparse.Namespace) -> None:
    """The flags, checked before anything is synthesised (a million rows take a while):
    an error names the flag."""
    from terarec.config import TrainConfig, from_dict
    from terarec.models.registry import model_class

    for flag, value in (("--rows", args.rows), ("--valid-rows", args.valid_rows)):
        if value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    blocked = args.workdir if args.workdir.is_file() else file_above(args.workdir)
    if blocked is not None:
        raise ValueError(f"--workdir {args.workdir}: {blocked} is a file, not a folder")
    try:
        model_class(args.model)
    except ValueError as exc:
        raise ValueError(f"--model: {exc}") from None
    try:  # the model is known: only the seed can be out of range
        from_dict(TrainConfig, {"seed": args.seed, "model": {"name": args.model}})
    except ValueError as exc:
        raise ValueError(f"--seed: {exc}") from None


def run(args: argparse.Namespace) -> int:
    from terarec.cli.main import main
    from terarec.data.synth import generate

    _check(args)
    work: Path = args.workdir
    data_dir, model_dir = work / "data", work / "model"
    data_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    print(f"[1/3] synthesising {args.rows:,} + {args.valid_rows:,} rows into {data_dir}")
    train, valid = data_dir / "train.tsv", data_dir / "valid.tsv"
    train_info = generate(train, args.rows, model_seed=args.seed, sample_seed=args.seed * 2 + 1)
    valid_info = generate(valid, args.valid_rows, model_seed=args.seed,
                          sample_seed=args.seed * 2 + 2)
    print(f"      CTR {train_info.ctr:.3f}; best reachable validation AUC "
          f"{valid_info.ceiling_auc:.4f} (the true model's)")
    if model_dir.exists():  # quickstart's own folder: each run trains afresh
        shutil.rmtree(model_dir)
    # The validation rows stay held out (no refit on them): their AUC is compared with
    # the ceiling below.
    argv = ["train", "--train", str(train), "--valid", str(valid), "--out", str(model_dir),
            "--model", args.model, "--seed", str(args.seed), "--no-refit",
            *(["--no-progress"] if args.no_progress else [])]
    print(f"[2/3] terarec {' '.join(argv)}")
    code = main(argv)  # the command itself: its checks, its errors (one line, exit 2)
    if code:
        return code
    metrics = json.loads((model_dir / "metrics.json").read_text())
    print("[3/3] against the planted model")
    print(f"\nAUC {metrics['auc']:.4f} (ceiling {valid_info.ceiling_auc:.4f}), logloss "
          f"{metrics['logloss']:.4f} (ceiling {valid_info.ceiling_logloss:.4f}), "
          f"{metrics['samples_per_s']:,.0f} samples/s, {time.perf_counter() - t0:.0f} s "
          "in all")
    report = model_dir / "report" / "report.html"
    print(f"data:   {data_dir}\nmodel:  {model_dir}\nreport: {report}")
    print(f"next:   terarec eval --model {model_dir} --data {valid}")
    return 0
