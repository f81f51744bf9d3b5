"""``terarec search``: K trial configurations trained together in one pass loop (data
read, hashed and planned once per pass), suggested and pruned by optuna; the best trial
is written as an ordinary model directory (OUT/best)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from terarec.autofeature.features import (
    FeatureConfig,
    feature_inputs,
    install_features,
    keyed_copies,
    model_features,
)
from terarec.cli.common import (
    SKIP_WITH_FEATURES,
    add_training_args,
    check_disjoint,
    check_no_repeats,
    config_from_args,
    explicit_config_keys,
    report_skipped,
    run_features,
    schema_for_data,
    schema_from_args,
    selection_from_args,
    train_schema_from_args,
)
from terarec.config import TrainConfig, parse_bytes
from terarec.data.readers import ReadStats
from terarec.distributed.context import DistContext
from terarec.train.passes import iter_file_batches


def add_parser(sub: argparse._SubParsersAction) -> None:
    from terarec.train.search import PRUNERS, SAMPLERS

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
                   help="search space, JSON or YAML: {config.path: {type, low, high, log} "
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
    from terarec.distributed.context import topology

    check_no_repeats(args.train, "--train")
    check_no_repeats(args.valid, "--valid")
    check_disjoint(args.train or [], args.valid)
    if args.trials < 1:  # run_search checks it too, naming its argument
        raise ValueError(f"--trials {args.trials}: must be >= 1")
    if args.parallel is not None and args.parallel < 1:
        raise ValueError(f"--parallel {args.parallel}: must be >= 1 (leave it out for all)")
    if args.checkpoint_every < 1:
        raise ValueError(f"--checkpoint-every {args.checkpoint_every}: must be >= 1")
    if args.prune_after is not None and args.prune_after < 1:
        raise ValueError(f"--prune-after {args.prune_after}: must be >= 1")
    config = config_from_args(args)
    if args.features and config.on_bad_row == "skip":
        raise ValueError(SKIP_WITH_FEATURES)
    if not args.features:
        schema_from_args(args)  # a bad column flag fails before any work
    ctx = topology(config.device)
    features = _features(args, ctx)
    raw = schema_for_data(features.base_schema, args) if features else None
    with feature_inputs(features, args.train, schema=raw) as train, \
            feature_inputs(features, args.valid, schema=raw) as valid:
        # the inputs as the trials read them (joined copies with AutoFeature tables)
        read = argparse.Namespace(**{**vars(args), "train": train, "valid": valid,
                                     "raw_train": args.train})
        return _run(read, config, features, ctx)


def _features(args: argparse.Namespace, ctx: DistContext) -> FeatureConfig | None:
    """The search's AutoFeature tables, kept in ``--out`` (``features/``); a resumed
    search takes its own copy and cannot gain tables it did not start with."""
    own = model_features(args.out)
    resuming = args.resume and (own is not None or (args.out / "search.json").exists())
    if resuming and args.features and own is None:
        raise ValueError(f"--resume: the search in {args.out} was started without "
                         "--features; resume it without them, or search into another --out")
    return run_features(args.features, args.out, ctx, resuming=resuming)


def _run(args: argparse.Namespace, config: TrainConfig, features: FeatureConfig | None,
         ctx: DistContext) -> int:
    """The search on ``args.train`` / ``args.valid`` as the trials read them."""
    from terarec.embedding.shared import sharing_refusal
    from terarec.io import finite_json
    from terarec.train.defaults import (
        ACCUMULATOR_KEY,
        accumulator_choices,
        apply_sized_defaults,
        estimate_rows,
    )
    from terarec.train.search import (
        base_params,
        default_space,
        first_rung,
        load_space,
        run_search,
        write_results,
        write_search_report,
    )

    # The trials' base is what ``train`` would run: data-sized defaults, numeric statistics.
    config, sized = apply_sized_defaults(config, args.train, explicit_config_keys(args))
    if config.store.memory_budget is not None:
        parse_bytes(config.store.memory_budget)
    selection_from_args(args, config)  # epoch upper bound, --eval-every
    fixed: list[dict] = []
    if args.space:  # before reading data
        space = load_space(args.space, config)
    else:
        # Where ``train`` would choose Adagrad's start by validation, so do the trials;
        # the first trials are what ``train`` runs (with each start), so the search
        # answers at least what ``train`` would on the validation rows.
        space = default_space(config.model.name, config)
        starts = accumulator_choices(sized)  # set only for adagrad
        if starts is not None:
            space[ACCUMULATOR_KEY] = {"type": "categorical", "choices": list(starts)}
        own = base_params(space, config)
        if own is not None:
            fixed = [{**own, ACCUMULATOR_KEY: start} for start in starts] if starts \
                else [own]
            fixed = fixed[:args.trials]
    schema = train_schema_from_args(args, features.schema if features else None)
    stats = ReadStats()
    valid = list(iter_file_batches(args.valid, schema, config.batch_size,
                                   on_bad_row=config.on_bad_row, stats=stats))
    why = sharing_refusal(config.store, config.sparse_optimizer)
    if why is not None and ctx.is_main:
        print(f"search: each trial keeps its own key index ({why})", file=sys.stderr)
    # Joined copies are named in checkpoints by the raw files, so a continued trial reads
    # on from its positions (the copies are made again in another temporary folder).
    inputs = keyed_copies(args.raw_train, args.train) \
        if features is not None and features.tables.tables else args.train
    result = run_search(schema, config, inputs, valid, args.out, trials=args.trials,
                        parallel=args.parallel, space=space, sampler=args.sampler,
                        pruner=args.pruner, select_by=args.select_by,
                        patience=args.patience, seed=config.seed,
                        progress=not args.no_progress, resume=args.resume, ctx=ctx,
                        checkpoint_every=args.checkpoint_every, fixed=fixed,
                        first_rung=args.prune_after if args.prune_after is not None
                        else first_rung(estimate_rows(args.train), config))
    if result.best_dir is not None and features is not None and ctx.is_main:
        install_features(result.best_dir, features)  # eval / predict / serve join them
    ctx.barrier()
    if result.best_dir is not None and _refit(args):
        refit_best(result.best_dir, args, ctx)
    if ctx.is_main:
        write_results(result, args.out)
        write_search_report(result, args.out)
        report_skipped(stats)
        best = result.best
        print(finite_json({"trials": len(result.trials),
                          "pruned": sum(t.state == "pruned" for t in result.trials),
                          "best_trial": best.number if best else None,
                          "best_value": best.selection.best_value if best else None,
                          "best_params": best.params if best else None,
                          "seconds": round(result.seconds, 2), "world_size": ctx.world}))
        if result.best_dir is not None:
            print(f"best model written to {result.best_dir}")
    ctx.close()
    return 0


def _refit(args: argparse.Namespace) -> bool:
    from terarec.train.defaults import estimate_rows, refit_by_default

    if args.refit is not None:
        return bool(args.refit)
    return refit_by_default(estimate_rows(args.train))


def refit_best(best_dir: Path, args: argparse.Namespace, ctx) -> None:
    """``train --refit`` for the best trial (``best_dir``): a fresh model of its
    configuration on train + valid for its selected epoch count becomes ``BEST``;
    metrics.json says so under ``refit``."""
    from terarec.modeldir import read_model_meta
    from terarec.train.run import TrainRun, refit_model

    metrics = json.loads((best_dir / "metrics.json").read_text())
    history = json.loads((best_dir / "history.json").read_text())
    schema, config = read_model_meta(best_dir)
    run = TrainRun(train=list(args.train), valid=list(args.valid), out=best_dir,
                   progress=not args.no_progress)
    refit, model = refit_model(run, schema, config, history, metrics.get("best_pass"), ctx)
    if model is not None:
        model.store.close()
    metrics["refit"] = refit
    if refit.get("checkpoint"):
        metrics.update(selected_checkpoint=metrics.get("checkpoint"),
                       checkpoint=refit["checkpoint"])
    if ctx.is_main:
        from terarec.io import atomic_write_text, finite_json

        atomic_write_text(best_dir / "metrics.json", finite_json(metrics, indent=2))
