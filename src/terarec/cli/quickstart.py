"""``terarec quickstart``: the whole loop on one machine in a few minutes.

Synthesises Criteo-format click logs with a planted ground-truth model, trains DeepFM
pass by pass over the collisionless store, evaluates against the best reachable AUC,
and writes an HTML report with plots.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from terarec.config import TrainConfig, from_dict
from terarec.data.numeric import with_numeric_stats
from terarec.data.readers import ReadStats
from terarec.data.synth import generate
from terarec.io import atomic_write_text, file_above
from terarec.models.registry import model_class
from terarec.train.checkpoint import save_checkpoint
from terarec.train.passes import iter_file_batches
from terarec.train.trainer import Trainer
from terarec.types import FeatureSchema


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


def _config(args: argparse.Namespace) -> TrainConfig:
    """The run's training config, checked with the flags before anything is synthesised
    (a million rows take minutes): an error names the flag."""
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
        return from_dict(TrainConfig, {"seed": args.seed, "pass_rows": 100_000,
                                       "model": {"name": args.model, "embedding_dim": 16}})
    except ValueError as exc:
        raise ValueError(f"--seed: {exc}") from None


def run(args: argparse.Namespace) -> int:
    config = _config(args)
    work: Path = args.workdir
    data_dir, model_dir = work / "data", work / "model"
    data_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    print(f"[1/4] synthesising {args.rows:,} + {args.valid_rows:,} rows into {data_dir}")
    train_info = generate(data_dir / "train.tsv", args.rows, model_seed=args.seed,
                          sample_seed=args.seed * 2 + 1)
    valid_info = generate(data_dir / "valid.tsv", args.valid_rows, model_seed=args.seed,
                          sample_seed=args.seed * 2 + 2)
    print(f"      CTR {train_info.ctr:.3f}; best reachable validation AUC "
          f"{valid_info.ceiling_auc:.4f} (the true model's)")

    schema = with_numeric_stats(FeatureSchema.criteo(), [data_dir / "train.tsv"])
    trainer = Trainer(schema, config)
    valid = list(iter_file_batches([data_dir / "valid.tsv"], schema, config.batch_size))
    print(f"[2/4] training {args.model} pass by pass ({config.pass_rows:,} rows a pass)")
    stats = ReadStats()
    history = trainer.fit([data_dir / "train.tsv"], valid, progress=not args.no_progress,
                          stats=stats)
    save_checkpoint(model_dir, trainer)

    print("[3/4] evaluating on the validation set")
    metrics = trainer.evaluate(valid)
    rows = sum(h["rows"] for h in history)
    busy = sum(h["staging_s"] + h["train_s"] + h["write_back_s"] for h in history)
    staging = sum(h["staging_s"] + h["write_back_s"] for h in history)
    summary = {
        "model": args.model, "auc": metrics["auc"], "logloss": metrics["logloss"],
        "ceiling_auc": valid_info.ceiling_auc, "ceiling_logloss": valid_info.ceiling_logloss,
        "rows": rows, "samples_per_s": rows / busy, "staging_share": staging / busy,
        "store_keys": len(trainer.store), "passes": trainer.pass_id,
        "model_dir": str(model_dir), "seconds": time.perf_counter() - t0,
    }
    atomic_write_text(model_dir / "metrics.json", json.dumps(summary, indent=2))
    atomic_write_text(model_dir / "history.json", json.dumps(history, indent=2))
    print("[4/4] writing the report")
    from terarec.report import write_report  # matplotlib: only the commands that plot load it

    report = write_report(work / "report", history, summary, title=f"terarec quickstart: "
                          f"{args.model} on synthetic click logs")
    print(f"\nAUC {metrics['auc']:.4f} (ceiling {valid_info.ceiling_auc:.4f}), "
          f"logloss {metrics['logloss']:.4f}, {summary['samples_per_s']:,.0f} samples/s, "
          f"{len(trainer.store):,} keys in the store")
    print(f"data:   {data_dir}\nmodel:  {model_dir}\nreport: {report}")
    print(f"next:   terarec eval --model {model_dir} --data {data_dir / 'valid.tsv'}")
    return 0
