"""``terarec train``: train pass by pass, checkpoint at pass boundaries, write metrics."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from terarec.autofeature.features import (
    FeatureConfig,
    feature_inputs,
    install_features,
    model_features,
)
from terarec.cli.common import (
    add_format_args,
    add_numeric_stats_args,
    add_selection_args,
    add_train_args,
    config_from_args,
    explicit_config_keys,
    report_skipped,
    schema_for_data,
    selection_from_args,
    train_schema_from_args,
)
from terarec.cli.main import UserError
from terarec.cli.storage_args import add_storage_args, storage_options_from_args
from terarec.config import parse_bytes
from terarec.data.readers import ReadStats
from terarec.distributed.context import launched_by_torchrun
from terarec.distributed.run import (
    add_distributed_args,
    reject_distributed_args,
    train_main,
)
from terarec.export import IncrementalExporter
from terarec.export.writer import model_features_dir
from terarec.finite import check_finite_loss
from terarec.io import LockedError, atomic_write_text, exclusive_lock, remove_atomic_leftovers
from terarec.train.checkpoint import (
    best_checkpoint,
    clear_best,
    list_checkpoints,
    mark_best,
    restore_trainer,
    save_checkpoint,
)
from terarec.train.defaults import apply_sized_defaults
from terarec.train.passes import iter_file_batches
from terarec.train.selection import SelectionTracker
from terarec.train.trainer import Trainer


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train a model", description=__doc__)
    p.add_argument("--train", nargs="+", required=True, type=Path, help="training file(s)")
    p.add_argument("--valid", nargs="*", default=[], type=Path, help="validation file(s)")
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
    add_format_args(p)
    add_numeric_stats_args(p)
    add_train_args(p)
    add_selection_args(p)
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
                   help="a delta at the first pass end M minutes after the previous export")
    add_storage_args(g)


def make_exporter(args: argparse.Namespace, trainer: Trainer) -> IncrementalExporter | None:
    if args.export_to is None:
        if args.delta_every is not None or args.delta_minutes is not None:
            raise ValueError("--delta-every / --delta-minutes need --export-to")
        return None
    every_passes = args.delta_every
    if every_passes is None and args.delta_minutes is None:
        every_passes = 1  # a delta at every pass boundary
    return IncrementalExporter(args.export_to, trainer, every_passes=every_passes,
                               every_minutes=args.delta_minutes,
                               storage_options=storage_options_from_args(args),
                               features_dir=model_features_dir(args.out))


LOCK_FILE = ".lock"  # in --out: held by the one run training that model directory


def run(args: argparse.Namespace) -> int:
    """Train, holding the model directory's lock; with AutoFeature tables, on copies of
    the inputs joined with them."""
    if launched_by_torchrun():  # one rank of `torchrun ... -m terarec train`
        return train_main(args)
    reject_distributed_args(args)
    if args.out.exists() and not args.out.is_dir():
        raise UserError(f"--out {args.out} is a file, not a model directory")
    try:
        lock = exclusive_lock(args.out / LOCK_FILE, f"model directory {args.out}")
        with lock:
            remove_atomic_leftovers(args.out)  # of a run killed mid-write
            return _locked_run(args)
    except LockedError as exc:
        raise UserError(str(exc)) from None


def _locked_run(args: argparse.Namespace) -> int:
    features = None
    if args.resume and list_checkpoints(args.out):
        features = model_features(args.out)
    elif args.features:
        features = install_features(args.out, FeatureConfig.load(args.features))
        print(f"features: {', '.join(features.selected) or 'none selected'}")
    if features is None:
        return _run(args, None)
    raw = schema_for_data(features.base_schema, args)
    with feature_inputs(features, args.train, schema=raw) as train, \
            feature_inputs(features, args.valid, schema=raw) as valid:
        return _run(argparse.Namespace(**{**vars(args), "train": train, "valid": valid}),
                    features)


def _run(args: argparse.Namespace, features: FeatureConfig | None) -> int:
    config, sized = apply_sized_defaults(config_from_args(args), args.train,
                                         explicit_config_keys(args))
    if sized:
        print("data-sized defaults: " + ", ".join(f"{k}={v:g}" for k, v in sized.items()),
              file=sys.stderr)
    if config.store.memory_budget is not None:
        parse_bytes(config.store.memory_budget)  # a bad size fails here, not mid-run
        if config.store.disk_path is None:
            config.store.disk_path = str(args.out / "store")
    resuming = args.resume and list_checkpoints(args.out)
    selection = selection_from_args(args, config)
    if resuming:
        trainer = restore_trainer(args.out, config)
        print(f"resuming {args.out} after pass {trainer.pass_id}")
        schema = trainer.schema
        if selection is not None:  # continue with the best value and patience it had
            selection = SelectionTracker.from_history(trainer.history, args.select_by,
                                                      args.patience)
    else:
        clear_best(args.out)
        schema = train_schema_from_args(args, features.schema if features else None)
        trainer = Trainer(schema, config)
    stats = ReadStats()
    valid = list(iter_file_batches(args.valid, schema, config.batch_size,
                                   on_bad_row=config.on_bad_row, stats=stats))

    exporter = make_exporter(args, trainer)

    def on_pass_end(t: Trainer, record: dict) -> None:
        check_finite_loss(record["train_loss"], f"pass {t.pass_id}")
        if t.pass_id % max(1, args.checkpoint_every) == 0 or record.get("best"):
            committed = save_checkpoint(args.out, t)
            if record.get("best"):
                mark_best(args.out, committed.name)
        if exporter is not None:
            exporter.on_pass_end(t, record)

    start = time.perf_counter()
    history = trainer.fit(args.train, valid, progress=not args.no_progress, stats=stats,
                          on_pass_end=on_pass_end, skip_passes=trainer.pass_id,
                          selection=selection)
    seconds = time.perf_counter() - start
    latest = save_checkpoint(args.out, trainer)
    if exporter is not None:
        exporter.finish(trainer)
    trained = history
    rows = sum(h["rows"] for h in trained)
    busy = sum(h["staging_s"] + h["train_s"] + h["write_back_s"] for h in trained)
    evaluated = best_checkpoint(args.out) or latest.name
    if valid:
        scorer = trainer if evaluated == latest.name else restore_trainer(args.out,
                                                                         name=evaluated)
        metrics = scorer.evaluate(valid)
        metrics["evaluated_on"] = "valid"
    else:
        metrics = trainer.evaluate(iter_file_batches(args.train, schema, config.batch_size,
                                                     on_bad_row=config.on_bad_row))
        metrics["evaluated_on"] = "train"
    metrics.pop("samples_per_s")  # here: training throughput, set below
    metrics.update(
        eval_rows=metrics.pop("rows"), rows=rows, passes=trainer.pass_id,
        samples_per_s=rows / busy if busy else 0.0, wall_seconds=seconds,
        skipped_rows=stats.skipped, store_keys=len(trainer.store), model=config.model.name,
        checkpoint=evaluated, stop_reason=trainer.stop_reason)
    if selection is not None:
        metrics.update(selection.summary())
    metrics.update(_store_size(trainer))
    atomic_write_text(args.out / "metrics.json", json.dumps(metrics, indent=2))
    history = [*trainer.history[:-1], {**trainer.history[-1],
                                       "stop_reason": trainer.stop_reason}] \
        if trainer.history else []
    atomic_write_text(args.out / "history.json", json.dumps(history, indent=2))
    from terarec.report import write_report  # matplotlib: only the commands that plot load it

    write_report(args.out / "report", history, {**metrics, **sized},
                 title=f"terarec train: {config.model.name} on "
                 f"{', '.join(Path(p).name for p in args.train)}")
    report_skipped(stats)
    print(json.dumps({k: metrics[k] for k in ("auc", "logloss", "rows", "samples_per_s")}))
    print(f"model written to {args.out}; report: {args.out / 'report' / 'report.html'}")
    return 0


def _store_size(trainer: Trainer) -> dict:
    """Stored value bytes (codes + row scale/bias, no optimizer state) and pruned keys."""
    st = trainer.store.stats()
    value_bytes = trainer.store.value_bytes
    return {"store_value_bytes": value_bytes,
            "store_bytes_per_key": value_bytes / max(st.keys, 1),
            "store_precision": trainer.config.store.precision, "pruned_keys": st.pruned}
