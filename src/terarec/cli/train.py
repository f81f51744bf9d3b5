"""``terarec train``: train pass by pass, checkpoint at pass boundaries, write metrics."""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from terarec.autofeature.features import FeatureConfig, feature_inputs, keyed_copies
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
from terarec.cli.main import UserError
from terarec.cli.storage_args import (
    add_storage_args,
    check_export_target,
    storage_options_from_args,
)
from terarec.config import TrainConfig, flag_fields, resumed_config, unused_keys
from terarec.data.positions import InputFile
from terarec.distributed.context import (
    DistContext,
    launched_by_torchrun,
    restart_count,
    topology,
)
from terarec.distributed.dense_comm import DENSE_COMMS, DenseCommConfig
from terarec.export import IncrementalExporter
from terarec.export.writer import model_features_dir, parse_hhmm
from terarec.io import (
    LockedError,
    exclusive_lock,
    finite_json,
    remove_atomic_leftovers,
    shared_lock,
    try_lock_file,
)
from terarec.modeldir import list_checkpoints, read_model_meta
from terarec.train.defaults import (
    ACCUMULATOR_KEY,
    accumulator_choices,
    apply_sized_defaults,
    estimate_rows,
    refit_by_default,
)
from terarec.train.follow import (
    CACHE_DIR,
    FollowOptions,
    Prepare,
    first_landed,
    remove_first_leftovers,
)
from terarec.train.passes import iter_file_batches
from terarec.train.run import TrainRun, train_model
from terarec.train.search import Choice, choose_by_validation
from terarec.train.selection import SelectionTracker
from terarec.train.trainer import Trainer
from terarec.types import FeatureSchema

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
    p.add_argument("--valid", nargs="+", default=[], type=Path, help="validation file(s)")
    p.add_argument("--refit", action=argparse.BooleanOptionalAction, default=None,
                   help="with --valid: once validation has picked the best epoch count, "
                   "train a fresh model that long on --train and --valid together and "
                   "write it as the model (default: on below 100,000 training rows)")
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


def make_exporter(args: argparse.Namespace, trainer: Trainer) -> IncrementalExporter | None:
    if args.export_to is None:  # schedule flags without it: refused (_check_export_args)
        return None
    every_passes = args.delta_every
    if every_passes is None and args.delta_minutes is None:
        every_passes = 1  # a delta at every pass boundary
    options = dict(every_passes=every_passes, every_minutes=args.delta_minutes,
                   storage_options=storage_options_from_args(args),
                   features_dir=model_features_dir(args.out),
                   full_every_hours=args.full_every_hours, full_at=args.full_at)
    if getattr(args, "publish_to", None):
        from terarec.sparsetier.publish import PublishingExporter

        return PublishingExporter(args.export_to, trainer, publish_to=args.publish_to,
                                  namespace=args.publish_namespace, **options)
    return IncrementalExporter(args.export_to, trainer, **options)


def add_distributed_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("distributed (under torchrun)")
    g.add_argument("--dense-comm", choices=DENSE_COMMS, default="none",
                   help="dense gradient exchange: none (all-reduce), fp16, or dgc "
                        "(Deep Gradient Compression)")
    # None (not given) takes DenseCommConfig's default; given without --dense-comm dgc,
    # a DGC flag is refused rather than ignored.
    g.add_argument("--dgc-ratio", type=float,
                   help="DGC: share of gradient entries sent per step (default 0.001)")
    g.add_argument("--dgc-momentum", type=float,
                   help="DGC: momentum of the local momentum correction (default 0.5: "
                        "the dense optimizer adds its own)")
    g.add_argument("--dgc-warmup-steps", type=int,
                   help="DGC: steps over which sparsity rises from 75%% to its target")


LOCK_FILE = ".lock"  # in --out: held by the one run training that model directory
CHOOSING_DIR = "choosing"  # in --out while a default is chosen by validation (_choose)
RANKS_LOCK_FILE = ".lock-ranks"  # in --out: shared by every rank of that run


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
    """Train, alone or as one torchrun rank (the same code); with AutoFeature tables, on
    copies of the inputs joined with them. ``on_commit``: called on every rank after
    each committed checkpoint."""
    if not launched_by_torchrun() and args.dense_comm != "none":
        # A single process has no dense gradients to exchange: say so, don't ignore it.
        raise ValueError(f"--dense-comm {args.dense_comm} needs several ranks: launch with "
                         "torchrun --nproc_per_node N -m terarec train ...")
    dense_comm_from_args(args)  # a stray or out-of-range DGC flag, before any work
    if args.out.exists() and not args.out.is_dir():
        raise UserError(f"--out {args.out} is a file, not a model directory")
    _check_follow_args(args)
    check_no_repeats(args.train or [], "--train")
    check_no_repeats(args.valid, "--valid")
    check_disjoint(args.train or [], args.valid)
    for flag, value in (("--checkpoint-every", args.checkpoint_every),
                        ("--delta-every", args.delta_every)):
        if value is not None and value < 1:
            raise UserError(f"{flag} {value}: must be >= 1")
    _check_export_args(args)
    config = config_from_args(args)
    if args.features and config.on_bad_row == "skip":
        raise UserError(SKIP_WITH_FEATURES)
    if not _resuming(args):  # a resumed run's model is the checkpoint's: checked then
        _refuse_unused_keys(args, config)
    store_dir = config.store.disk_path
    if store_dir is not None and Path(store_dir).exists() and not Path(store_dir).is_dir():
        raise UserError(f"--store-dir {store_dir} is a file, not a folder")
    if args.export_to is not None and Path(args.export_to).is_file():
        raise UserError(f"--export-to {args.export_to} is a file, not an export folder")
    if args.export_to is not None and Path(args.export_to).resolve() == args.out.resolve():
        raise UserError(f"--export-to {args.export_to} is the model directory (--out); "
                        "export to a folder of its own (e.g. a subfolder)")
    if args.export_to is not None:  # with --follow the options may be the source's
        check_export_target(args.export_to, storage_options_from_args(args), "--export-to",
                            options_elsewhere=args.follow is not None)
    ctx = topology(config.device)
    fresh = ctx.is_main and not args.out.exists()
    try:
        with contextlib.ExitStack() as held:
            _lock_model_dir(args.out, ctx, held)
            return _locked_run(args, config, ctx, on_commit)
    except BaseException:
        if fresh:  # a run that failed before writing anything leaves no empty model folder
            _remove_if_only_locks(args.out)
        raise


def _remove_if_only_locks(out: Path) -> None:
    names = {p.name for p in out.iterdir()} if out.is_dir() else None
    if names is not None and names <= {LOCK_FILE, RANKS_LOCK_FILE}:
        for name in names:
            (out / name).unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            out.rmdir()


def _check_export_args(args: argparse.Namespace) -> None:
    """The export schedule's flags, before any work: checked once the exporter was made,
    after the statistics pass, they left a model directory behind and did not all name
    the flag; a NaN or infinite period was taken and never came due."""
    if args.export_to is None:
        if (args.delta_every is not None or args.delta_minutes is not None
                or args.full_every_hours is not None or args.full_at is not None
                or getattr(args, "publish_to", None)):
            raise UserError("--delta-every / --delta-minutes / --full-every-hours / "
                            "--full-at / --publish-to need --export-to")
        return
    for flag, value in (("--delta-minutes", args.delta_minutes),
                        ("--full-every-hours", args.full_every_hours)):
        if value is not None and not 0 < value < math.inf:
            raise UserError(f"{flag} {value}: must be > 0 and finite")
    if args.full_at is not None:
        try:
            parse_hhmm(args.full_at)
        except ValueError as exc:
            raise UserError(f"--full-at: {exc}") from None


def _check_follow_args(args: argparse.Namespace) -> None:
    if (args.train is None) == (args.follow is None):
        raise UserError("give either --train FILE... or --follow SOURCE")
    if args.follow is None:
        for flag in ("stop_after", "stop_idle", "poll_seconds"):
            if getattr(args, flag) is not None:
                raise UserError(f"--{flag.replace('_', '-')} needs --follow")
        return
    if args.refit is not None:  # a stream has no fixed training set to train again
        raise UserError(f"--{'' if args.refit else 'no-'}refit does not apply to --follow: "
                        "its model is the last pass trained")
    if Path(args.follow).is_file():
        raise UserError(f"--follow {args.follow} is a file: --follow takes the folder (or "
                        "URI) files land in; train a file with --train")
    if args.poll_seconds is not None and not 0 < args.poll_seconds < math.inf:
        raise UserError(f"--poll-seconds must be > 0 and finite, got {args.poll_seconds}")
    if args.stop_after is not None and args.stop_after < 1:
        raise UserError(f"--stop-after must be >= 1, got {args.stop_after}")
    if args.stop_idle is not None and not args.stop_idle > 0:  # nan never stopped
        raise UserError(f"--stop-idle must be > 0, got {args.stop_idle}")


def _follow_run(args: argparse.Namespace, config: TrainConfig, ctx: DistContext,
                on_commit: Callable[[Trainer], None] | None) -> int:
    """``--follow``: the files of SOURCE as they land; a fresh model takes its numeric
    statistics from the first file to land. With AutoFeature tables each file is joined
    with them as it lands (``follow.Prepare``), into a copy under the follow cache."""
    features = _features(args, ctx)
    if features and config.on_bad_row == "skip":  # a resumed model's own tables
        raise UserError(SKIP_WITH_FEATURES)
    raw = schema_for_data(features.base_schema, args) if features else None
    prepare = Prepare(raw, functools.partial(features.augment_file, schema=raw)) \
        if features is not None and raw is not None and features.tables.tables else None
    options = FollowOptions(args.follow, storage_options_from_args(args),
                            poll_s=args.poll_seconds or POLL_SECONDS,
                            stop_after=args.stop_after, stop_idle_s=args.stop_idle,
                            prepare=prepare)
    if _resuming(args):  # the model's own shape, seed and optimizers, or an error
        config = resumed_config(read_model_meta(args.out)[1], config,
                                explicit_config_keys(args), str(args.out))
        _refuse_unused_keys(args, config)
        if features is None:
            _check_resumed_columns(args)
    elif features is None:  # the flags make the schema: check them now, not once the
        schema_from_args(args)  # first file lands
    # The schema training reads: the joined copies' with tables, else the landed files'.
    base = None if features is None else features.schema if prepare else raw

    def schema() -> FeatureSchema:
        landed = raw if raw is not None else schema_from_args(args)  # how files are read
        with first_landed(options, args.out / CACHE_DIR, landed) as first:
            return train_schema_from_args(
                argparse.Namespace(**{**vars(args), "train": [first.path]}), base)

    metrics, stats = train_model(
        TrainRun(train=[], valid=args.valid, out=args.out, resume=args.resume,
                 checkpoint_every=args.checkpoint_every, progress=not args.no_progress,
                 follow=options),
        config, schema, ctx, dense_comm=dense_comm_from_args(args),
        exporter=lambda trainer: make_exporter(args, trainer), on_commit=on_commit,
        selection=selection_from_args(args, config))
    if ctx.is_main:
        report_skipped(stats)
        _say_undefined_auc(metrics)
        print(finite_json({k: metrics.get(k) for k in (
            "auc", "logloss", "rows", "files_trained", "passes", "stop_reason")}))
        _write_report(args, metrics, {}, f"terarec train: {config.model.name} following "
                      f"{args.follow}")
    if ctx.world > 1:
        # A rank's read-ahead thread may still wait in a collective of its own group for
        # a listing or pass its peers stopped before reading; once every rank is done,
        # leave without unwinding it (the locks are released with the process).
        ctx.barrier()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0


def _write_report(args: argparse.Namespace, metrics: dict, sized: dict, title: str) -> None:
    history = json.loads((args.out / "history.json").read_text())
    from terarec.report import write_report  # matplotlib: only commands that plot load it

    write_report(args.out / "report", history, {**metrics, **sized},
                 title=title)
    print(f"model written to {args.out}; report: {args.out / 'report' / 'report.html'}")


def _lock_model_dir(out: Path, ctx: DistContext, held: contextlib.ExitStack) -> None:
    """Every rank (alone: the process) holds ``out``'s locks for the whole run, or every
    rank fails with the same message: rank 0 holds ``LOCK_FILE`` (one run per model
    directory), and each rank a shared lock on ``RANKS_LOCK_FILE``, which rank 0 first
    checks is free: no rank of an earlier run, whose rank 0 is gone, still writes its
    shard into ``out``. Rank 0's verdict is broadcast before any other collective, so no
    rank waits for a peer that gave up."""
    failure: str | None = None
    if ctx.is_main:
        try:
            held.enter_context(exclusive_lock(out / LOCK_FILE, f"model directory {out}"))
            fd = try_lock_file(out / RANKS_LOCK_FILE)
            if fd is None:
                raise LockedError(f"model directory {out} is still written by a rank of "
                                  f"an earlier run (lock file {out / RANKS_LOCK_FILE}); "
                                  "wait for it to exit")
            os.close(fd)
            remove_atomic_leftovers(out)  # of a run killed mid-write
            remove_first_leftovers(out / CACHE_DIR)  # of one killed taking statistics
        except LockedError as exc:
            failure = str(exc)
        except OSError as exc:
            failure = f"--out {out}: {exc.strerror or exc}"
    failure = ctx.broadcast_object(failure)
    if failure is not None:
        held.close()
        raise UserError(failure)
    held.enter_context(shared_lock(out / RANKS_LOCK_FILE, f"model directory {out}"))


def _locked_run(args: argparse.Namespace, config: TrainConfig, ctx: DistContext,
                on_commit: Callable[[Trainer], None] | None) -> int:
    if args.follow is not None:
        return _follow_run(args, config, ctx, on_commit)
    if not args.features and not _resuming(args):  # the flags make the schema: build it
        schema_from_args(args)  # now, so a bad column flag fails before the data is sized
    features = _features(args, ctx)
    if features and config.on_bad_row == "skip":  # a resumed model's own tables
        raise UserError(SKIP_WITH_FEATURES)
    if not features and _resuming(args):
        _check_resumed_columns(args)
    raw = schema_for_data(features.base_schema, args) if features else None
    with feature_inputs(features, args.train, schema=raw) as train, \
            feature_inputs(features, args.valid, schema=raw) as valid:
        # the inputs as the model reads them (joined copies with AutoFeature tables)
        read = argparse.Namespace(**{**vars(args), "train": train, "valid": valid})
        given = explicit_config_keys(args)
        config, sized = apply_sized_defaults(config, train, given)
        if _resuming(args):  # the model's own shape, seed and optimizers, or an error
            config = resumed_config(read_model_meta(args.out)[1], config, given,
                                    str(args.out))
            _refuse_unused_keys(args, config)
            sized = {}  # the run's own values hold where no flag was given
        selection = selection_from_args(args, config)  # the epoch bound, before choosing
        # Joined copies are named in checkpoints by the raw files, so --resume reads on.
        inputs: list[Path | InputFile] = [*keyed_copies(args.train, train)] \
            if features and features.tables.tables else [*train]
        schema = functools.cache(lambda: train_schema_from_args(
            read, features.schema if features else None, ctx))
        notes: dict[str, Any] = {}
        # With a memory budget the trials would split it: the start stays the sized one.
        choices = accumulator_choices(sized) if config.store.memory_budget is None else None
        if choices is not None and selection is not None:
            choice = _choose(args, config, schema(), choices, inputs, valid, selection, ctx)
            config.sparse_optimizer.initial_accumulator = choice.chosen
            sized[ACCUMULATOR_KEY] = choice.chosen
            notes["chosen_by_validation"] = [choice.summary()]
        if sized and ctx.is_main:
            print("data-sized defaults: " + ", ".join(f"{k}={v:g}" for k, v in sized.items()),
                  file=sys.stderr)
        metrics, stats = train_model(
            TrainRun(train=inputs, valid=valid, out=args.out, resume=args.resume,
                     checkpoint_every=args.checkpoint_every, progress=not args.no_progress,
                     refit=_refit(args, train), notes=notes),
            config, schema, ctx,
            dense_comm=dense_comm_from_args(args),
            exporter=lambda trainer: make_exporter(args, trainer), on_commit=on_commit,
            selection=selection)
    if ctx.is_main:
        report_skipped(stats)
        shown = ("auc", "logloss", "rows", "samples_per_s") + (
            ("world_size",) if ctx.world > 1 else ())
        _say_undefined_auc(metrics)
        print(finite_json({k: metrics[k] for k in shown}))
        _write_report(args, metrics, sized, f"terarec train: {config.model.name} on "
                      f"{', '.join(Path(p).name for p in args.train)}")
    ctx.close()
    return 0


def _choose(args: argparse.Namespace, config: TrainConfig, schema: FeatureSchema,
            choices: tuple[float, ...], inputs: list[Path | InputFile], valid: list[Path],
            selection: SelectionTracker, ctx: DistContext) -> Choice:
    """Adagrad's start on small data, by validation (``accumulator_choices``): one run
    per start side by side in a scratch folder of ``--out``, said on stderr."""
    batches = list(iter_file_batches(valid, schema, config.batch_size,
                                     on_bad_row=config.on_bad_row))
    choice = choose_by_validation(schema, config, ACCUMULATOR_KEY, choices, inputs, batches,
                                  args.out / CHOOSING_DIR, select_by=selection.select_by,
                                  patience=selection.patience, ctx=ctx)
    if ctx.is_main:
        said = ", ".join(f"{v:g}: {b:.5f}" if b is not None else f"{v:g}: none"
                         for v, b in choice.values.items())
        print(f"{ACCUMULATOR_KEY} chosen by validation {selection.select_by} ({said})",
              file=sys.stderr)
    return choice


def _refuse_unused_keys(args: argparse.Namespace, config: TrainConfig) -> None:
    """A key the run's model or sparse optimizer does not read (checked on the config
    the run trains with: a resumed one is the checkpoint's) is refused, not ignored,
    naming its flag or the --config file that set it."""
    unused = unused_keys(config, explicit_config_keys(args))
    flags = {".".join(path): flag for path, flag, _, _ in flag_fields()}
    by_flag, in_file = [], []
    for key, why in unused.items():
        flag = flags.get(key)
        if flag is not None and getattr(args, flag.attr, None) is not None:
            by_flag.append(f"{flag.name}: {why}")
        else:
            in_file.append(f"{key}: {why}")
    if in_file:
        by_flag.append(f"--config {args.config}: {'; '.join(in_file)}")
    if by_flag:
        raise UserError("; ".join(by_flag))


def _check_resumed_columns(args: argparse.Namespace) -> None:
    """A resumed run reads its files with the model's schema: format and column flags
    describing another one (a column added, another delimiter) were silently ignored.
    The same flags as the first run, the usual restart, describe the same columns; no
    format flag at all takes the model's."""
    flags = ("format", "label", "numeric", "categorical", "delimiter", "multi_sep",
             "multi_valued", "log1p", "numeric_transform")
    if all(getattr(args, f, None) in (None, "") for f in flags):
        return

    def columns(schema: FeatureSchema) -> tuple:
        return (schema.format, schema.label,
                schema.delimiter if schema.format == "csv" else None,
                tuple((f.name, f.kind, f.transform, f.separator) for f in schema.fields))

    saved, given = columns(read_model_meta(args.out)[0]), columns(schema_from_args(args))
    if saved != given:
        parts = ("format", "label", "delimiter", "fields")
        differ = [p for p, a, b in zip(parts, saved, given, strict=True) if a != b]
        raise UserError(f"--resume: {args.out} was trained on other columns than the format "
                        f"flags describe ({', '.join(differ)} "
                        f"{'differs' if len(differ) == 1 else 'differ'}); resume with the "
                        "flags it was trained with, or train into another --out")


def _say_undefined_auc(metrics: dict) -> None:
    """A validation AUC over rows of one class is undefined: said, and written as null."""
    auc = metrics.get("auc")
    if isinstance(auc, float) and not math.isfinite(auc):
        print("AUC is undefined: every validation label is the same class; written as null",
              file=sys.stderr)


def _refit(args: argparse.Namespace, train: list[Path]) -> bool:
    """``--refit`` / ``--no-refit``, else on for small data (``refit_by_default``)."""
    if args.refit is not None:
        if args.refit and not args.valid:
            raise UserError("--refit needs --valid (validation picks the epoch count)")
        return bool(args.refit)
    return bool(args.valid) and refit_by_default(estimate_rows(train))


def _resuming(args: argparse.Namespace) -> bool:
    """Whether this run continues the checkpoints in ``--out`` (``--resume``, or a worker
    group torchrun restarted)."""
    return (args.resume or restart_count() > 0) and bool(list_checkpoints(args.out))


def _features(args: argparse.Namespace, ctx: DistContext) -> FeatureConfig | None:
    """The run's AutoFeature tables: the model's own when resuming, else ``--features``."""
    return run_features(args.features, args.out, ctx, resuming=_resuming(args))
