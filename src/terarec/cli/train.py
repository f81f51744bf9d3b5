"""``terarec train``: train pass by pass, checkpoint at pass boundaries, write metrics.

The flags become a ``TrainJob`` and ``terarec.api.training.run_training`` runs it, the
recipe ``terarec.fit`` runs too."""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from terarec.cli.common import (
    add_training_args,
    report_skipped,
    train_job_from_args,
)
from terarec.cli.main import UserError
from terarec.cli.storage_args import add_storage_args
from terarec.config import DENSE_COMMS, DenseCommConfig
from terarec.io import finite_json

if TYPE_CHECKING:
    from terarec.train.trainer import Trainer

POLL_SECONDS = 1.0  # --follow: how often SOURCE is listed by default


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train a model", description=__doc__)
    p.add_argument("--train", nargs="+", type=Path, help="training file(s)")
    p.add_argument("--follow", metavar="SOURCE",
                   help="instead of --train: a folder or fsspec URI (s3://bucket/logs/) "
                   "whose files are trained in name order as they land, each scored before "
                   "it is trained (docs/continuous.md); runs until SIGTERM, --stop-after or "
                   "--stop-idle")
    # None: not given (refused without --follow, where nothing is listed)
    p.add_argument("--poll-seconds", type=float, default=None,
                   help=f"--follow: how often SOURCE is listed (default {POLL_SECONDS:g})")
    p.add_argument("--stop-after", type=int, metavar="FILES",
                   help="--follow: stop once this many files are trained (earlier runs "
                   "into --out included)")
    p.add_argument("--stop-idle", type=float, metavar="SECONDS",
                   help="--follow: stop once no new file has landed for this long")
    # "+": a bare --valid (an empty shell variable, say) trained without validation, silently
    p.add_argument("--valid", nargs="+", default=[], type=Path,
                   help="validation file(s) (without them, below 100,000 training rows the "
                   "last 1/8 of --train validates: --valid-split)")
    p.add_argument("--valid-split", type=float, default=None, metavar="FRACTION",
                   help="without --valid: validate on the last FRACTION of the --train "
                   "rows (in [0, 0.5]), select by them and refit on all rows as with "
                   "--valid (default: 0.125 below 100,000 training rows, else none; 0 "
                   "turns it off; metrics.json's validation says which rows)")
    p.add_argument("--refit", action=argparse.BooleanOptionalAction, default=None,
                   help="with --valid: once validation has picked the best epoch count, "
                   "train a fresh model that long on --train and --valid together and "
                   "write it as the model (default: on below 100,000 training rows)")
    p.add_argument("--choose", choices=("auto", "off"), default=None,
                   help="with --valid: race a small portfolio of learning rates, batch "
                   "size, patience, width and dropout against the data-sized default on "
                   "the validation rows, keeping the default unless a setting beats its "
                   "validation AUC by more than the standard error, within 3x the "
                   "default run's passes (docs/training.md; default: off)")
    p.add_argument("--out", required=True, type=Path, help="model directory")
    p.add_argument("--resume", action="store_true",
                   help="continue after the last committed pass in --out")
    p.add_argument("--checkpoint-every", type=int, default=1,
                   help="commit a checkpoint every N passes (default 1)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--features", type=Path,
                   help="feature config from `terarec autofeature`: its tables are copied "
                   "into the model and joined onto every input row (raw files are read "
                   "with the config's schema; --format may name another container)")
    add_training_args(p)
    add_export_args(p)
    add_distributed_args(p)
    p.set_defaults(func=run)


def add_export_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("export for serving")
    g.add_argument("--export-to", metavar="URI",
                   help="write a full version after the first pass, then deltas here "
                   "(every pass unless --delta-every / --delta-minutes say otherwise)")
    g.add_argument("--delta-every", type=int, metavar="N", help="a delta every N passes")
    g.add_argument("--delta-minutes", type=float, metavar="M",
                   help="a delta at the first pass end M minutes after the previous export "
                   "(with --follow also while waiting for files)")
    g.add_argument("--full-every-hours", type=float, metavar="H",
                   help="a full version (instead of a delta) once H hours have passed since "
                   "the previous full one")
    g.add_argument("--full-at", metavar="HH:MM",
                   help="a full version (instead of a delta) at the first pass end after "
                   "this local time each day (off-peak)")
    g.add_argument("--publish-to", metavar="redis://HOST:PORT",
                   help="also publish each exported version to this Redis Cluster "
                        "(`terarec publish`; docs/serving-cluster.md)")
    g.add_argument("--publish-namespace", default="terarec",
                   help="the model's key prefix in that cluster (default terarec)")
    add_storage_args(g)


def add_distributed_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("distributed (under torchrun)")
    g.add_argument("--dense-comm", choices=DENSE_COMMS, default="none",
                   help="dense gradient exchange: none (all-reduce), fp16, or dgc "
                        "(Deep Gradient Compression)")
    # None (not given) takes DenseCommConfig's default; given without --dense-comm dgc,
    # a DGC flag is refused rather than ignored.
    g.add_argument("--dgc-ratio", type=float,
                   help="DGC: share of the dense update's entries sent per step "
                        "(default 0.001)")
    g.add_argument("--dgc-momentum", type=float,
                   help="DGC: momentum of the local momentum correction (default 0.9)")
    g.add_argument("--dgc-warmup-steps", type=int,
                   help="DGC: steps over which sparsity rises from 75%% to its target")


# The DGC flags: attribute, the range a value must fall in, and that range in words.
_DGC_FLAGS: tuple[tuple[str, Callable[[float], bool], str], ...] = (
    ("dgc_ratio", lambda v: 0.0 < v <= 1.0, "in (0, 1]"),
    ("dgc_momentum", lambda v: 0.0 <= v < 1.0, "in [0, 1)"),
    ("dgc_warmup_steps", lambda v: v >= 0, ">= 0"))


def dense_comm_from_args(args: argparse.Namespace) -> DenseCommConfig:
    """The dense exchange the flags ask for; a DGC knob given without ``--dense-comm dgc``
    or out of its range is a UserError naming the flag."""
    given: dict[str, Any] = {}
    for attr, ok, span in _DGC_FLAGS:
        value, flag = getattr(args, attr), "--" + attr.replace("_", "-")
        if value is None:
            continue
        if args.dense_comm != "dgc":
            raise UserError(f"{flag} applies only with --dense-comm dgc (got --dense-comm "
                            f"{args.dense_comm})")
        if not ok(value):
            raise UserError(f"{flag} must be {span}, got {value}")
        given[attr] = value
    return DenseCommConfig(mode=args.dense_comm, **given)


def run(args: argparse.Namespace, on_commit: Callable[[Trainer], None] | None = None) -> int:
    """Train, alone or as one torchrun rank (the same code). ``on_commit``: called on
    every rank after each committed checkpoint."""
    from terarec.api.training import run_training

    if args.dense_comm != "none":
        from terarec.distributed.context import launched_by_torchrun

        if not launched_by_torchrun():  # one process has no dense gradients to exchange
            raise UserError(f"--dense-comm {args.dense_comm} needs several ranks: launch "
                            "with torchrun --nproc_per_node N -m terarec train ...")
    if args.follow is None:
        for flag in ("stop_after", "stop_idle", "poll_seconds"):
            if getattr(args, flag) is not None:
                raise UserError(f"--{flag.replace('_', '-')} needs --follow")
    _log_events()
    outcome = run_training(train_job_from_args(args, dense_comm_from_args(args)), on_commit)
    if outcome.is_main:
        metrics = outcome.metrics
        report_skipped(outcome.stats)
        _say_undefined_auc(metrics)
        # several labels: each task's figures after their weighted mean
        tasks = tuple(k for k in metrics if k.startswith(("auc_", "logloss_"))
                      and f"{'logloss' if k.startswith('auc_') else 'auc'}_"
                          f"{k.split('_', 1)[1]}" in metrics)
        if args.follow is not None:
            shown: tuple[str, ...] = ("auc", "logloss", *tasks, "rows", "files_trained",
                                      "passes", "stop_reason")
            print(finite_json({k: metrics.get(k) for k in shown}))
        else:
            shown = ("auc", "logloss", *tasks, "rows", "samples_per_s", "epochs_trained",
                     "epochs_limit") + (("world_size",) if outcome.world > 1 else ())
            print(finite_json({k: metrics[k] for k in shown if k in metrics}))
        print(f"model written to {args.out}; report: {args.out / 'report' / 'report.html'}")
    if args.follow is not None and outcome.world > 1:
        # A rank's read-ahead thread may still wait in a collective of its own group for
        # a listing or pass its peers stopped before reading; every rank is done (the
        # run ended at a barrier): leave without unwinding it (locks go with the process).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0


def _say_undefined_auc(metrics: dict) -> None:
    """A validation AUC over rows of one class is undefined: said, and written as null."""
    auc = metrics.get("auc")
    if isinstance(auc, float) and not math.isfinite(auc):
        print("AUC is undefined: every validation label is the same class; written as null",
              file=sys.stderr)


def _log_events() -> None:
    """terarec's INFO events (a file landed, a pass trained, a version exported) as lines
    on stderr, unless the caller configured logging already."""
    import logging

    logging.basicConfig(format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("terarec").setLevel(logging.INFO)

