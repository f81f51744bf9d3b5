"""``terarec search``: K trial configurations trained together in one pass loop (data
read, hashed and planned once per pass), suggested and pruned by optuna; the best trial
is written as an ordinary model directory (OUT/best)."""

from __future__ import annotations

import argparse
from pathlib import Path

from terarec.cli.common import add_training_args, report_skipped


def add_parser(sub: argparse._SubParsersAction) -> None:
    from terarec.train.search.samplers import PRUNERS, SAMPLERS

    p = sub.add_parser("search", help="hyper-parameter search, trials trained together",
                       description=__doc__)
    p.add_argument("--train", nargs="+", required=True, type=Path, help="training file(s)")
    p.add_argument("--valid", nargs="+", required=True, type=Path, help="validation file(s)")
    p.add_argument("--out", required=True, type=Path,
                   help="search directory: best/, trials/, results.json/.csv, report.html")
    p.add_argument("--trials", type=int, default=8, help="trials in all (default 8)")
    p.add_argument("--parallel", type=int,
                   help="trials trained together in one pass loop (default: all)")
    p.add_argument("--sampler", choices=SAMPLERS, default="tpe",
                   help="optuna sampler (default tpe; grid needs choices for every value)")
    p.add_argument("--pruner", choices=PRUNERS, default="halving",
                   help="optuna pruner at pass boundaries (default halving: successive "
                   "halving, which compares trials training together; median compares "
                   "with finished trials, i.e. earlier waves of --parallel)")
    p.add_argument("--prune-after", type=int, metavar="PASSES",
                   help="the pass at which the pruner first compares trials (default: "
                   "enough passes for 100 optimizer steps; 1 pass on large data)")
    p.add_argument("--space", type=Path,
                   help="search space, a JSON file: {config.path: {type, low, high, log} "
                   "or [choices]} (default: a space for --model, see docs/search.md)")
    p.add_argument("--resume", action="store_true",
                   help="continue the search in --out after a stop or a crash: finished "
                   "trials are kept, interrupted ones continue from their last "
                   "committed pass (same settings needed)")
    p.add_argument("--checkpoint-every", type=int, default=1,
                   help="every live trial commits a checkpoint every N passes (default 1; "
                   "a resume continues from the last; a pass that leads the search is "
                   "always committed)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--features", type=Path,
                   help="feature config from `terarec autofeature`: every trial trains on "
                   "the inputs joined with its tables (raw files are read with the "
                   "config's schema; --format may name another container); the best "
                   "model carries them, as a model of `train --features` does")
    p.add_argument("--refit", action=argparse.BooleanOptionalAction, default=None,
                   help="refit the best trial on --train and --valid together for its "
                   "selected epoch count, as train --refit does (default: on below "
                   "100,000 training rows, one process)")
    add_training_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from terarec.api.search import SearchJob, run_search_job
    from terarec.cli.common import train_job_from_args
    from terarec.io import finite_json

    train_job = train_job_from_args(args)
    outcome = run_search_job(SearchJob(
        run=train_job, trials=args.trials, parallel=args.parallel, sampler=args.sampler,
        pruner=args.pruner, prune_after=args.prune_after, space=args.space))
    if outcome.is_main:
        report_skipped(outcome.stats)
        result = outcome.result
        assert result is not None
        best = result.best
        print(finite_json({"trials": len(result.trials),
                          "pruned": sum(t.state == "pruned" for t in result.trials),
                          "best_trial": best.number if best else None,
                          "best_value": best.selection.best_value if best else None,
                          "best_params": best.params if best else None,
                          "seconds": round(result.seconds, 2),
                          "world_size": outcome.world}))
        if result.best_dir is not None:
            print(f"best model written to {result.best_dir}")
    return 0
