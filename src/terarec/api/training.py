"""The training recipe: what ``terarec train`` and ``terarec.fit`` both run.

A ``TrainJob`` holds everything one run needs as typed values (the config, the data
description, selection, export schedule, distributed exchange). ``run_training`` takes
it through data-sized defaults, the choices made by validation, training with
selection, refit, the model-directory locks and the report, alone or as one of N
torchrun ranks. The command line only builds a ``TrainJob`` from its flags.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import os
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from terarec.config import DenseCommConfig, TrainConfig, resumed_config, unused_keys
from terarec.data.positions import InputFile
from terarec.data.readers import ReadStats
from terarec.data.spec import DataSpec
from terarec.distributed.context import (
    DistContext,
    launched_by_torchrun,
    restart_count,
    topology,
)
from terarec.io import (
    LockedError,
    exclusive_lock,
    remove_atomic_leftovers,
    shared_lock,
    try_lock_file,
)
from terarec.train.carve import (
    CARVED_DIR,
    DEFAULT_VALID_SPLIT,
    Carved,
    CarveError,
    carve,
    check_valid_split,
)
from terarec.train.cohort import apply_params
from terarec.train.defaults import (
    ACCUMULATOR_KEY,
    BUCKET_L2_KEY,
    DENSE_LR_KEY,
    MODEL_KEY,
    SMALL_DATA_ROWS,
    accumulator_choices,
    apply_sized_defaults,
    bucket_l2_choices,
    estimate_rows,
    evaluations_per_epoch,
    first_order_choices,
    max_epochs,
    model_choices,
    refit_by_default,
)
from terarec.train.selection import DEFAULT_PATIENCE, SelectionTracker
from terarec.types import FeatureSchema

if TYPE_CHECKING:  # importing them costs the exporter's and trainer's stacks
    from terarec.autofeature.features import FeatureConfig
    from terarec.export import IncrementalExporter
    from terarec.train.trainer import Trainer

POLL_SECONDS = 1.0  # follow: how often the source is listed by default
INPUTS_FILE = "inputs.json"  # in the model directory: the files it was trained on
LOCK_FILE = ".lock"  # in the model directory: held by the one run training it
CHOOSING_DIR = "choosing"  # in the model directory while a default is chosen by validation
CHOOSE_MODES = ("auto", "off")  # --choose: race the settings portfolio, or not
RANKS_LOCK_FILE = ".lock-ranks"  # in the model directory: shared by every rank of that run

# The rows are joined with AutoFeature tables in DuckDB first, which stops at a bad row
# before the reader could skip it: the setting would be ignored.
SKIP_WITH_FEATURES = ("--on-bad-row skip (on_bad_row in --config) does not work with "
                      "AutoFeature tables: their join reads every row first and stops at "
                      "the first bad one; clean the files or train without --features")


@dataclass
class ExportSchedule:
    """Versions written while training: a full version after the first pass, then
    deltas (every pass unless ``delta_every`` / ``delta_minutes`` say otherwise), full
    versions again after ``full_every_hours`` or at ``full_at`` (HH:MM) each day."""

    to: str | None = None
    delta_every: int | None = None
    delta_minutes: float | None = None
    full_every_hours: float | None = None
    full_at: str | None = None
    publish_to: str | None = None  # a Redis Cluster each version is also published to
    publish_namespace: str = "terarec"
    storage_options: dict[str, Any] | None = None


@dataclass
class FollowSettings:
    """Train a folder's (or URI's) files in name order as they land."""

    source: str
    poll_seconds: float | None = None
    stop_after: int | None = None  # files trained, earlier runs included
    stop_idle: float | None = None  # seconds without a new file


@dataclass
class TrainJob:
    """One training run. ``given`` holds the dotted config keys the user set (they are
    left alone by data-sized defaults); ``named`` says which flag or keyword set each,
    and ``config_origin`` where the others came from, so refusals name them."""

    out: Path
    config: TrainConfig = field(default_factory=TrainConfig)
    train: list[Path] | None = None
    follow: FollowSettings | None = None
    valid: list[Path] = field(default_factory=list)
    data: DataSpec = field(default_factory=DataSpec)
    given: set[str] = field(default_factory=set)
    named: dict[str, str] = field(default_factory=dict)
    config_origin: str = "settings"
    resume: bool = False
    refit: bool | None = None  # None: on below 100,000 training rows with validation
    checkpoint_every: int = 1
    progress: bool = True
    features: Path | None = None  # an AutoFeature config
    select_by: str = "logloss"
    select_task: str | None = None  # several labels: select by this task's metric
    patience: int = DEFAULT_PATIENCE
    eval_every: int | None = None
    export: ExportSchedule = field(default_factory=ExportSchedule)
    dense_comm: DenseCommConfig = field(default_factory=DenseCommConfig)
    # "auto": with validation rows, the portfolio of train.portfolio races the default
    # and may replace it; "off" or None: the sized defaults as they are.
    choose: str | None = None
    # Without ``valid``: the share of the training rows (the last ones) carved as
    # validation rows (train.carve); None: DEFAULT_VALID_SPLIT below SMALL_DATA_ROWS
    # estimated rows, else none; 0: none.
    valid_split: float | None = None


@dataclass
class TrainOutcome:
    """What a run wrote: its metrics (the same on every rank), the rows it skipped, the
    data-sized values it chose, and whether this process is rank 0."""

    metrics: dict[str, Any]
    stats: ReadStats
    sized: dict[str, Any]
    is_main: bool
    world: int


def run_training(job: TrainJob,
                 on_commit: Callable[[Trainer], None] | None = None) -> TrainOutcome:
    """Train ``job``, alone or as one torchrun rank (the same code); with AutoFeature
    tables, on copies of the inputs joined with them. ``on_commit``: called on every
    rank after each committed checkpoint."""
    if not launched_by_torchrun() and job.dense_comm.mode != "none":
        # A single process has no dense gradients to exchange: say so, don't ignore it.
        raise ValueError(f"--dense-comm {job.dense_comm.mode} needs several ranks: launch "
                         "with torchrun --nproc_per_node N -m terarec train ...")
    out = Path(job.out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file, not a model directory")
    _check_follow(job)
    check_no_repeats(job.train or [], "--train")
    check_no_repeats(job.valid, "--valid")
    check_disjoint(job.train or [], job.valid)
    for flag, value in (("--checkpoint-every", job.checkpoint_every),
                        ("--delta-every", job.export.delta_every)):
        if value is not None and value < 1:
            raise ValueError(f"{flag} {value}: must be >= 1")
    _check_export(job)
    _check_valid_split(job)
    _check_choose(job)
    config = job.config
    if job.features and config.on_bad_row == "skip":
        raise ValueError(SKIP_WITH_FEATURES)
    if not _resuming(job):  # a resumed run's model is the checkpoint's: checked then
        refuse_unused_keys(job, config)
    store_dir = config.store.disk_path
    if store_dir is not None and Path(store_dir).exists() and not Path(store_dir).is_dir():
        raise ValueError(f"--store-dir {store_dir} is a file, not a folder")
    target = job.export.to
    if target is not None and Path(target).is_file():
        raise ValueError(f"--export-to {target} is a file, not an export folder")
    if target is not None and Path(target).resolve() == out.resolve():
        raise ValueError(f"--export-to {target} is the model directory (--out); export to "
                         "a folder of its own (e.g. a subfolder)")
    if target is not None:  # with follow the options may be the source's
        from terarec.export.target import check_export_target

        check_export_target(target, job.export.storage_options, "--export-to",
                            options_elsewhere=job.follow is not None)
    ctx = topology(config.device)
    fresh = ctx.is_main and not out.exists()
    try:
        with contextlib.ExitStack() as held:
            _lock_model_dir(out, ctx, held)
            return _locked_run(job, config, ctx, on_commit)
    except BaseException:
        if fresh:  # a run that failed before writing anything leaves no empty model folder
            _remove_if_only_locks(out)
        raise


def check_no_repeats(paths: list[Path] | list[str], flag: str) -> None:
    """A file named twice in one list (``a.csv ./a.csv``, or through a link) would have
    every row trained twice, and checkpoints key a file's position by its path, so the
    two readings would also share one position: refused naming the flag and the file."""
    seen: dict[str, Any] = {}
    for path in paths:
        real = os.path.realpath(path)
        if real in seen:
            first = f" (as {seen[real]})" if str(seen[real]) != str(path) else ""
            raise ValueError(f"{flag}: {path} is named twice{first}: its rows would be "
                             "read twice; name it once")
        seen[real] = path


def check_disjoint(train: list[Path] | list[str], valid: list[Path] | list[str]) -> None:
    """A file in both train and valid: validation would score rows the model trained
    on (picking the overfit pass as best), and a refit would train them twice."""
    trained = {os.path.realpath(p): p for p in train}
    for path in valid:
        if (same := trained.get(os.path.realpath(path))) is not None:
            named = f" (as {same})" if str(same) != str(path) else ""
            raise ValueError(f"--valid: {path} is also a --train file{named}: validation "
                             "must hold rows training does not see")


def _check_choose(job: TrainJob) -> None:
    if job.choose is None:
        return
    if job.choose not in CHOOSE_MODES:
        raise ValueError(f"--choose {job.choose}: expected one of {', '.join(CHOOSE_MODES)}")
    if job.choose == "auto" and (job.follow is not None
                                 or not (job.valid or job.valid_split != 0)):
        raise ValueError("--choose auto needs --valid, or validation rows carved from "
                         "--train (--valid-split), to choose the settings on, and --train")


def _check_valid_split(job: TrainJob) -> None:
    """``valid_split`` in range, and only where there is something to carve from."""
    check_valid_split(job.valid_split)
    if not job.valid_split:
        return
    if job.follow is not None:
        raise ValueError(f"--valid-split {job.valid_split:g} does not apply to --follow: "
                         "each file is scored before it is trained")
    if job.valid:
        raise ValueError(f"--valid-split {job.valid_split:g} carves validation rows from "
                         "--train, and --valid gives them: give one")


def _choosing(job: TrainJob, config: TrainConfig) -> bool:
    """Whether this run races the portfolio: asked for (``choose="auto"``, opt-in: the
    race costs up to 3 runs more and has kept the default in every measured case), with
    validation rows, on a fresh model whose store is all in RAM (a memory budget would
    be split between the members)."""
    return job.choose == "auto" and bool(job.valid) and not _resuming(job) \
        and config.store.memory_budget is None


def _remove_if_only_locks(out: Path) -> None:
    names = {p.name for p in out.iterdir()} if out.is_dir() else None
    if names is not None and names <= {LOCK_FILE, RANKS_LOCK_FILE}:
        for name in names:
            (out / name).unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            out.rmdir()


def _check_export(job: TrainJob) -> None:
    """The export schedule, before any work: checked once the exporter was made, after
    the statistics pass, it left a model directory behind; a NaN or infinite period was
    taken and never came due."""
    ex = job.export
    if ex.to is None:
        if (ex.delta_every is not None or ex.delta_minutes is not None
                or ex.full_every_hours is not None or ex.full_at is not None
                or ex.publish_to):
            raise ValueError("--delta-every / --delta-minutes / --full-every-hours / "
                             "--full-at / --publish-to need --export-to")
        return
    for flag, value in (("--delta-minutes", ex.delta_minutes),
                        ("--full-every-hours", ex.full_every_hours)):
        if value is not None and not 0 < value < math.inf:
            raise ValueError(f"{flag} {value}: must be > 0 and finite")
    if ex.full_at is not None:
        from terarec.export.writer import parse_hhmm

        try:
            parse_hhmm(ex.full_at)
        except ValueError as exc:
            raise ValueError(f"--full-at: {exc}") from None


def _check_follow(job: TrainJob) -> None:
    if (job.train is None) == (job.follow is None):
        raise ValueError("give either --train FILE... or --follow SOURCE")
    follow = job.follow
    if follow is None:
        return
    if job.refit is not None:  # a stream has no fixed training set to train again
        raise ValueError(f"--{'' if job.refit else 'no-'}refit does not apply to --follow: "
                         "its model is the last pass trained")
    if Path(follow.source).is_file():
        raise ValueError(f"--follow {follow.source} is a file: --follow takes the folder "
                         "(or URI) files land in; train a file with --train")
    if follow.poll_seconds is not None and not 0 < follow.poll_seconds < math.inf:
        raise ValueError(f"--poll-seconds must be > 0 and finite, got {follow.poll_seconds}")
    if follow.stop_after is not None and follow.stop_after < 1:
        raise ValueError(f"--stop-after must be >= 1, got {follow.stop_after}")
    if follow.stop_idle is not None and not follow.stop_idle > 0:  # nan never stopped
        raise ValueError(f"--stop-idle must be > 0, got {follow.stop_idle}")


def make_exporter(job: TrainJob, trainer: Trainer) -> IncrementalExporter | None:
    """The run's version writer, or None without an export target."""
    ex = job.export
    if ex.to is None:
        return None
    from terarec.export import IncrementalExporter
    from terarec.export.writer import model_features_dir

    every_passes = ex.delta_every
    if every_passes is None and ex.delta_minutes is None:
        every_passes = 1  # a delta at every pass boundary
    options: dict[str, Any] = dict(
        every_passes=every_passes, every_minutes=ex.delta_minutes,
        storage_options=ex.storage_options, features_dir=model_features_dir(job.out),
        full_every_hours=ex.full_every_hours, full_at=ex.full_at)
    if ex.publish_to:
        from terarec.sparsetier.publish import PublishingExporter

        return PublishingExporter(ex.to, trainer, publish_to=ex.publish_to,
                                  namespace=ex.publish_namespace, **options)
    return IncrementalExporter(ex.to, trainer, **options)


def selection_for(job: TrainJob, config: TrainConfig) -> SelectionTracker | None:
    """The run's selection tracker (None without validation files); with them, fixes the
    epoch upper bound and the pass length ``eval_every`` asks for."""
    if not job.valid:
        given = [flag for flag, value, default in (
            ("--eval-every", job.eval_every, None),
            ("--patience", job.patience, DEFAULT_PATIENCE),
            ("--select-by", job.select_by, "logloss"),
            ("--select-task", job.select_task, None)) if value != default]
        if given:  # each was silently ignored without a validation set
            raise ValueError(f"{', '.join(given)} needs --valid, or validation rows carved "
                             f"from --train (--valid-split; by default below "
                             f"{SMALL_DATA_ROWS:,} training rows)")
        return None
    if job.patience < 1:
        raise ValueError(f"--patience {job.patience}: must be >= 1")
    if job.eval_every is not None:
        if job.eval_every < 1:
            raise ValueError(f"--eval-every {job.eval_every}: must be >= 1")
        config.pass_rows = min(config.pass_rows, job.eval_every * config.batch_size)
    rows = estimate_rows(job.train or [])
    if "epochs" not in job.given:  # neither a flag nor the config file set it
        config.epochs = max_epochs(rows, config.batch_size) + job.patience
    if job.select_task is not None:
        tasks = job.data.labels()[0]  # empty: the model's own (a resumed run)
        if tasks and (len(tasks) < 2 or job.select_task not in tasks):
            raise ValueError(f"--select-task {job.select_task!r}: not one of several "
                             f"labels (--label {job.data.label})")
    # Patience counts epochs, unless --eval-every set the evaluations it counts.
    per_epoch = 1 if job.eval_every is not None or job.follow is not None \
        else evaluations_per_epoch(rows, config.batch_size, config.pass_rows)
    return SelectionTracker(job.select_by, job.patience, task=job.select_task,
                            per_epoch=per_epoch)


def refuse_unused_keys(job: TrainJob, config: TrainConfig) -> None:
    """A key the run's model or sparse optimizer does not read (checked on the config
    the run trains with: a resumed one is the checkpoint's) is refused, not ignored,
    naming its flag or where it was set."""
    unused = unused_keys(config, job.given)
    by_flag, elsewhere = [], []
    for key, why in unused.items():
        if key in job.named:
            by_flag.append(f"{job.named[key]}: {why}")
        else:
            elsewhere.append(f"{key}: {why}")
    if elsewhere:
        by_flag.append(f"{job.config_origin}: {'; '.join(elsewhere)}")
    if by_flag:
        raise ValueError("; ".join(by_flag))


def _lock_model_dir(out: Path, ctx: DistContext, held: contextlib.ExitStack) -> None:
    """Every rank (alone: the process) holds ``out``'s locks for the whole run, or every
    rank fails with the same message: rank 0 holds ``LOCK_FILE`` (one run per model
    directory), and each rank a shared lock on ``RANKS_LOCK_FILE``, which rank 0 first
    checks is free: no rank of an earlier run, whose rank 0 is gone, still writes its
    shard into ``out``. Rank 0's verdict is broadcast before any other collective, so no
    rank waits for a peer that gave up."""
    from terarec.train.follow import CACHE_DIR, remove_first_leftovers

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
        raise LockedError(failure)
    held.enter_context(shared_lock(out / RANKS_LOCK_FILE, f"model directory {out}"))


def _train_schema(job: TrainJob, files: list[Path], base: FeatureSchema | None,
                  ctx: DistContext | None) -> FeatureSchema:
    if ctx is not None and ctx.world > 1:
        return job.data.train_schema(files, base, rank=ctx.rank, world=ctx.world,
                                     gather=ctx.all_gather_object)
    return job.data.train_schema(files, base)


def _follow_run(job: TrainJob, config: TrainConfig, ctx: DistContext,
                on_commit: Callable[[Trainer], None] | None) -> TrainOutcome:
    """Follow: the files of the source as they land; a fresh model takes its numeric
    statistics from the first file to land. With AutoFeature tables each file is joined
    with them as it lands (``follow.Prepare``), into a copy under the follow cache."""
    from terarec.modeldir import read_model_meta
    from terarec.train.follow import CACHE_DIR, FollowOptions, Prepare, first_landed
    from terarec.train.run import TrainRun, train_model

    assert job.follow is not None
    features = _features(job, ctx)
    if features and config.on_bad_row == "skip":  # a resumed model's own tables
        raise ValueError(SKIP_WITH_FEATURES)
    raw = job.data.for_model(features.base_schema) if features else None
    prepare = Prepare(raw, functools.partial(features.augment_file, schema=raw)) \
        if features is not None and raw is not None and features.tables.tables else None
    options = FollowOptions(job.follow.source, job.export.storage_options,
                            poll_s=job.follow.poll_seconds or POLL_SECONDS,
                            stop_after=job.follow.stop_after,
                            stop_idle_s=job.follow.stop_idle, prepare=prepare)
    if _resuming(job):  # the model's own shape, seed and optimizers, or an error
        config = resumed_config(read_model_meta(job.out)[1], config, job.given,
                                str(job.out))
        refuse_unused_keys(job, config)
        if features is None:
            _check_resumed_columns(job)
    elif features is None:  # the settings make the schema: check them now, not once
        job.data.schema()  # the first file lands
    # The schema training reads: the joined copies' with tables, else the landed files'.
    base = None if features is None else features.schema if prepare else raw

    def schema() -> FeatureSchema:
        landed = raw if raw is not None else job.data.schema()  # how files are read
        with first_landed(options, Path(job.out) / CACHE_DIR, landed) as first:
            return _train_schema(job, [first.path], base, None)

    metrics, stats = train_model(
        TrainRun(train=[], valid=job.valid, out=Path(job.out), resume=job.resume,
                 checkpoint_every=job.checkpoint_every, progress=job.progress,
                 follow=options),
        config, schema, ctx, dense_comm=job.dense_comm,
        exporter=lambda trainer: make_exporter(job, trainer), on_commit=on_commit,
        selection=selection_for(job, config))
    if ctx.is_main:
        write_report(Path(job.out), metrics, {}, f"terarec train: {config.model.name} "
                     f"following {job.follow.source}")
    if ctx.world > 1:
        ctx.barrier()
    return TrainOutcome(metrics, stats, {}, ctx.is_main, ctx.world)


def record_inputs(out: Path, train: list[Path], valid: list[Path], *,
                  valid_trained: bool, carved: Carved | None = None) -> None:
    """``inputs.json``: each input file's fingerprint and whether the model in ``out``
    trained on its rows (the validation files too after a refit), so scoring them later
    is known to be in-sample. A resumed run adds its files to the earlier ones. With
    validation rows ``carved`` from the training files, a file whose rows all validate
    is a validation file, and a file cut in two says which rows validate."""
    from terarec.data.positions import fingerprint
    from terarec.io import atomic_write_text, finite_json

    path = out / INPUTS_FILE
    try:
        files = {f["path"]: f for f in json.loads(path.read_text())["files"]}
    except (OSError, ValueError, KeyError, TypeError):
        files = {}
    carved_rows = {os.path.abspath(p.source): [p.first, p.end]
                   for p in (carved.valid if carved is not None else [])}
    fit = {os.path.abspath(p.source) for p in (carved.fit if carved is not None else [])}
    for role, paths, trained in (("valid", valid, valid_trained), ("train", train, True)):
        for p in paths:
            size, digest = fingerprint(p)
            name = os.path.abspath(p)
            entry = {"path": name, "role": role, "size": size, "sha256": digest,
                     "trained": trained}
            if name in carved_rows and name not in fit:  # all its rows validate
                entry.update(role="valid", trained=valid_trained)
            elif name in carved_rows:
                entry["valid_rows"] = carved_rows[name]
            files[name] = entry
    atomic_write_text(path, finite_json({"files": list(files.values())}, indent=2))


def write_report(out: Path, metrics: dict, sized: dict, title: str) -> None:
    """The HTML report with plots, in ``out/report``."""
    from terarec.report import write_report as write  # matplotlib: only when plotting

    history = json.loads((out / "history.json").read_text())
    write(out / "report", history, {**metrics, **sized}, title=title)


def _locked_run(job: TrainJob, config: TrainConfig, ctx: DistContext,
                on_commit: Callable[[Trainer], None] | None) -> TrainOutcome:
    if job.follow is not None:
        return _follow_run(job, config, ctx, on_commit)
    assert job.train is not None
    if not job.features and not _resuming(job):  # the settings make the schema: build it
        job.data.schema()  # now, so a bad column setting fails before the data is sized
    features = _features(job, ctx)
    if features and config.on_bad_row == "skip":  # a resumed model's own tables
        raise ValueError(SKIP_WITH_FEATURES)
    if not features and _resuming(job):
        _check_resumed_columns(job)
    raw = job.data.for_model(features.base_schema) if features else None
    given = job  # the files as the user named them
    carved, validation = _carve_validation(job, raw, ctx)
    if carved is not None:
        job = dataclasses.replace(job, train=[p.path for p in carved.fit],
                                  valid=[p.path for p in carved.valid])
        if ctx.is_main:
            print(carved.describe(), file=sys.stderr)
    if job.choose == "auto" and not job.valid:
        raise ValueError(f"--choose auto needs --valid, or validation rows carved from "
                         f"--train: by default below {SMALL_DATA_ROWS:,} training rows, at "
                         "any size with --valid-split F")
    try:
        metrics, stats, sized, config = _train_files(job, config, features, raw, ctx,
                                                     on_commit, validation)
        if carved is not None:  # skipped rows named in the files the user gave
            stats.examples = [carved.name_sources(e) for e in stats.examples]
    except ValueError as exc:
        if carved is None or (said := carved.name_sources(str(exc))) == str(exc):
            raise
        try:  # an error about a copy names the input file and its line
            renamed = type(exc)(said)
        except TypeError:
            renamed = ValueError(said)
        raise renamed from exc
    finally:
        if carved is not None and ctx.is_main and ctx.world == 1:
            shutil.rmtree(Path(job.out) / CARVED_DIR, ignore_errors=True)
    if carved is not None and ctx.world > 1:  # every rank has read the copies
        ctx.barrier()
        if ctx.is_main:
            shutil.rmtree(Path(job.out) / CARVED_DIR, ignore_errors=True)
    if ctx.is_main:
        refit = bool((metrics.get("refit") or {}).get("checkpoint"))
        record_inputs(Path(job.out), given.train or [], given.valid, valid_trained=refit,
                      carved=carved)
        write_report(Path(job.out), metrics, sized, f"terarec train: {config.model.name} "
                     f"on {', '.join(Path(p).name for p in given.train or [])}")
    world = ctx.world
    ctx.close()
    return TrainOutcome(metrics, stats, sized, ctx.is_main, world)


def _train_files(job: TrainJob, config: TrainConfig, features: FeatureConfig | None,
                 raw: FeatureSchema | None, ctx: DistContext,
                 on_commit: Callable[[Trainer], None] | None, validation: dict[str, Any]
                 ) -> tuple[dict[str, Any], ReadStats, dict[str, Any], TrainConfig]:
    """Sized defaults, the choices made by validation, and training with selection and
    refit, on ``job``'s files (AutoFeature copies of them with ``features``); returns
    the metrics, read statistics, sized values and the config trained with."""
    from terarec.autofeature.features import feature_inputs, keyed_copies
    from terarec.modeldir import read_model_meta
    from terarec.train.run import TrainRun, train_model

    assert job.train is not None
    with feature_inputs(features, job.train, schema=raw) as train, \
            feature_inputs(features, job.valid, schema=raw) as valid:
        # the inputs as the model reads them (joined copies with AutoFeature tables)
        config, sized = apply_sized_defaults(config, train, job.given)
        if _resuming(job):  # the model's own shape, seed and optimizers, or an error
            config = resumed_config(read_model_meta(job.out)[1], config, job.given,
                                    str(job.out))
            refuse_unused_keys(job, config)
            sized = {}  # the run's own values hold where nothing was given
        read = dataclasses.replace(job, train=train, valid=valid)
        selection = selection_for(job, config)  # the epoch bound, before choosing
        if selection is not None and "epochs" in sized:  # sized, then raised to the bound
            sized["epochs"] = config.epochs
        # Joined copies are named in checkpoints by the raw files, so resume reads on.
        inputs: list[Path | InputFile] = [*keyed_copies(job.train, train)] \
            if features and features.tables.tables else [*train]
        schema = functools.cache(lambda: _train_schema(
            read, train, features.schema if features else None, ctx))
        notes: dict[str, Any] = {"validation": validation}
        # With a memory budget the trials would split it: the start stays the sized one.
        choices = accumulator_choices(sized) if config.store.memory_budget is None else None
        if choices is not None and selection is not None:
            chosen = _choose(job, config, schema(), ACCUMULATOR_KEY, choices, inputs, valid,
                             selection, ctx)
            config.sparse_optimizer.initial_accumulator = chosen.chosen
            sized[ACCUMULATOR_KEY] = chosen.chosen
            notes["chosen_by_validation"] = [chosen.summary()]
            strengths = bucket_l2_choices(choices, job.given, schema())
            if strengths is not None:  # the chosen start's run is the prior's absence
                prior = _choose(job, config, schema(), BUCKET_L2_KEY, strengths, inputs,
                                valid, selection, ctx, known={
                                    config.sparse_optimizer.bucket_l2:
                                    chosen.values[chosen.chosen]})
                config.sparse_optimizer.bucket_l2 = prior.chosen
                sized[BUCKET_L2_KEY] = prior.chosen
                notes["chosen_by_validation"].append(prior.summary())
                chosen = prior
            models = model_choices(choices, job.given, config.model.name,
                                   int(sized["estimated_rows"]))
            if models is not None:  # the chosen run so far is the default model's
                model = _choose(job, config, schema(), MODEL_KEY, tuple(models), inputs,
                                valid, selection, ctx, known={
                                    config.model.name: chosen.values[chosen.chosen]},
                                also=models)
                config.model.name = model.chosen
                config.dense_optimizer.lr = models[model.chosen][DENSE_LR_KEY]
                sized[MODEL_KEY] = model.chosen
                sized[DENSE_LR_KEY] = config.dense_optimizer.lr
                notes["chosen_by_validation"].append(model.summary())
        first = first_order_choices(sized, job.given, config) \
            if config.store.memory_budget is None else None
        if first is not None and selection is not None:
            model = _choose_member(job, config, schema(), MODEL_KEY, first, inputs, valid,
                                   selection, ctx)
            if first[model.chosen]:
                config = apply_params(config, first[model.chosen])
                sized.update(first[model.chosen])
            notes["chosen_by_validation"] = [model.summary()]
        if selection is not None and _choosing(job, config):
            config, selection, chosen_settings = _choose_settings(
                job, config, schema(), inputs, valid, selection, ctx)
            if chosen_settings:
                notes["chosen_settings"] = chosen_settings
        if sized and ctx.is_main:
            said = {k: _said(v) for k, v in sized.items()}
            if selection is not None and "epochs" in said:  # patience stops first
                said["epochs"] = (f"{said['epochs']} at most (patience "
                                  f"{selection.patience} epochs)")
            print("data-sized defaults: " + ", ".join(f"{k}={v}" for k, v in said.items()),
                  file=sys.stderr)
        metrics, stats = train_model(
            TrainRun(train=inputs, valid=valid, out=Path(job.out), resume=job.resume,
                     checkpoint_every=job.checkpoint_every, progress=job.progress,
                     refit=_refit(job, train), notes=notes),
            config, schema, ctx, dense_comm=job.dense_comm,
            exporter=lambda trainer: make_exporter(job, trainer), on_commit=on_commit,
            selection=selection)
    return metrics, stats, sized, config


def _carve_validation(job: TrainJob, raw: FeatureSchema | None, ctx: DistContext
                      ) -> tuple[Carved | None, dict[str, Any]]:
    """Validation rows carved from ``job.train`` where none are given (``train.carve``):
    ``valid_split`` of them when given, else ``DEFAULT_VALID_SPLIT`` below
    ``SMALL_DATA_ROWS`` estimated rows. Rank 0 cuts and copies, every rank gets its
    answer. Returns the cut (None: none) and what metrics.json says under
    ``validation``."""
    from terarec.modeldir import read_model_meta

    assert job.train is not None
    if job.valid:
        return None, {"carved": False,
                      "valid_files": [os.path.abspath(p) for p in job.valid]}
    if job.valid_split == 0:
        return None, {"carved": False, "reason": "turned off (--valid-split 0)"}
    fraction = job.valid_split
    if fraction is None and _resuming(job) and not _resumed_run_validated(job.out):
        return None, {"carved": False, "reason": "the run resumed trained without "
                      "validation rows"}
    if fraction is None:
        rows = estimate_rows(job.train)
        if rows is None or rows >= SMALL_DATA_ROWS:
            return None, {"carved": False, "reason": f"about {rows:,} training rows: "
                          f"carved by default below {SMALL_DATA_ROWS:,}"
                          if rows is not None else "the training rows cannot be counted"}
        fraction = DEFAULT_VALID_SPLIT
    answer: tuple[Carved | None, str | None, bool] = (None, None, False)
    if ctx.is_main:
        try:  # the schema the files are read with: the model's own when resuming
            schema = raw if raw is not None else read_model_meta(job.out)[0] \
                if _resuming(job) else job.data.schema()
            cut = carve(job.train, schema, fraction, Path(job.out) / CARVED_DIR)
            if cut is not None and _resuming(job):
                _check_same_cut(job.out, cut)
            answer = (cut, None, False)
        except CarveError as exc:
            answer = (None, str(exc), True)
        except Exception as exc:
            if ctx.world == 1:
                raise
            answer = (None, str(exc), False)  # raised on every rank below
    carved, failure, uncuttable = ctx.broadcast_object(answer) if ctx.world > 1 else answer
    if failure is not None:
        if uncuttable and job.valid_split is None:
            if ctx.is_main:
                print(f"validation: none carved ({failure}); training without validation "
                      "rows", file=sys.stderr)
            return None, {"carved": False, "reason": failure}
        raise ValueError(f"--valid-split {fraction:g}: {failure}" if uncuttable
                         else failure)
    if carved is None:
        return None, {"carved": False, "reason": "fewer than 2 training rows"}
    return carved, carved.summary()


def _said(value: Any) -> str:
    return f"{value:g}" if isinstance(value, int | float) else str(value)


def _choose(job: TrainJob, config: TrainConfig, schema: FeatureSchema, key: str,
            choices: tuple[Any, ...], inputs: list[Path | InputFile], valid: list[Path],
            selection: SelectionTracker, ctx: DistContext,
            known: dict[Any, float | None] | None = None,
            also: dict[Any, dict[str, Any]] | None = None) -> Any:
    """A value small data chooses by validation (Adagrad's start, ``accumulator_choices``;
    the bucket prior, ``bucket_l2_choices``; the model, ``model_choices``): one run per
    value not ``known`` side by side in a scratch folder of the model directory, said on
    stderr. ``also``: more config values a choice's run trains with."""
    also = also or {}
    return _choose_member(job, config, schema, key,
                          {value: {key: value, **also.get(value, {})} for value in choices},
                          inputs, valid, selection, ctx, known)


def _choose_member(job: TrainJob, config: TrainConfig, schema: FeatureSchema, key: str,
                   members: dict[Any, dict[str, Any]], inputs: list[Path | InputFile],
                   valid: list[Path], selection: SelectionTracker, ctx: DistContext,
                   known: dict[Any, float | None] | None = None) -> Any:
    """The member (name -> dotted config values) whose run reaches the best validation
    value, the runs not ``known`` trained side by side in a scratch folder of the model
    directory; said on stderr under ``key``."""
    from terarec.train.choose import choose_member
    from terarec.train.passes import iter_file_batches

    batches = list(iter_file_batches(valid, schema, config.batch_size,
                                     on_bad_row=config.on_bad_row))
    choice = choose_member(schema, config, members, inputs, batches,
                           Path(job.out) / CHOOSING_DIR, key=key,
                           select_by=selection.select_by, patience=selection.wait,
                           ctx=ctx, known=known)
    if ctx.is_main:
        said = ", ".join(f"{_said(v)}: {b:.5f}" if b is not None else f"{_said(v)}: none"
                         for v, b in choice.values.items())
        print(f"{key} chosen by validation {selection.select_by} ({said})",
              file=sys.stderr)
    return choice


def _choose_settings(job: TrainJob, config: TrainConfig, schema: FeatureSchema,
                     inputs: list[Path | InputFile], valid: list[Path],
                     selection: SelectionTracker, ctx: DistContext
                     ) -> tuple[TrainConfig, SelectionTracker, dict[str, Any]]:
    """The portfolio raced on the validation rows (``train.portfolio``): the run's
    config and selection with the chosen member's values, and what was measured."""
    from terarec.train.passes import iter_file_batches
    from terarec.train.portfolio import choose_settings, chosen_config, portfolio

    given = job.given | ({"patience"} if job.patience != DEFAULT_PATIENCE else set())
    members = portfolio(config, given, job.patience, estimate_rows(job.train or []))
    batches = list(iter_file_batches(valid, schema, config.batch_size,
                                     on_bad_row=config.on_bad_row))
    if not batches or len(members) < 2:  # no rows (the run says so) or no challenger
        return config, selection, {}
    # A member's patience counts epochs, as the run's does; the race counts evaluations.
    raced = [dataclasses.replace(m, patience=m.patience * selection.per_epoch)
             if m.patience else m for m in members]
    choice = choose_settings(schema, config, raced, inputs, batches,
                             Path(job.out) / CHOOSING_DIR, select_by=selection.select_by,
                             patience=selection.wait or job.patience, ctx=ctx)
    if ctx.is_main:
        said = ", ".join(f"{c.member.name} {c.valid_auc:.4f}" if c.valid_auc is not None
                         else f"{c.member.name} none" for c in choice.candidates)
        summary = choice.summary()["budget"]
        print(f"settings chosen by validation: {choice.chosen.member.name} (valid auc: "
              f"{said}; standard error {choice.auc_standard_error or 0:.4f}; "
              f"{summary['used_x_default_run']:g}x the default run's passes, "
              f"{summary['seconds']:.1f}s)", file=sys.stderr)
    member = members[raced.index(choice.chosen.member)]
    if member.patience is not None:
        selection = SelectionTracker(selection.select_by, member.patience,
                                     per_epoch=selection.per_epoch)
    return chosen_config(config, choice), selection, choice.summary()


def _check_resumed_columns(job: TrainJob) -> None:
    """A resumed run reads its files with the model's schema: format and column settings
    describing another one (a column added, another delimiter) were silently ignored.
    The same settings as the first run, the usual restart, describe the same columns;
    none at all takes the model's."""
    from terarec.modeldir import read_model_meta

    if not job.data.describes_columns():
        return

    def columns(schema: FeatureSchema) -> tuple:
        return (schema.format, schema.task_names,
                schema.delimiter if schema.format == "csv" else None,
                tuple((f.name, f.kind, f.transform, f.separator, f.max_len, f.key_space)
                      for f in schema.fields))

    saved, given = columns(read_model_meta(job.out)[0]), columns(job.data.schema())
    if saved != given:
        parts = ("format", "label", "delimiter", "fields")
        differ = [p for p, a, b in zip(parts, saved, given, strict=True) if a != b]
        raise ValueError(f"--resume: {job.out} was trained on other columns than the format "
                         f"flags describe ({', '.join(differ)} "
                         f"{'differs' if len(differ) == 1 else 'differ'}); resume with the "
                         "flags it was trained with, or train into another --out")


def _check_same_cut(out: Path, carved: Carved) -> None:
    """A resumed run's cut must leave every file the checkpoint was reading where it
    was: with more (or other) ``--train`` files the cut moves, and rows trained as fit
    rows would be read again as new ones (or validate), so that is refused."""
    from terarec.modeldir import checkpoint_meta, list_checkpoints

    try:
        inputs = checkpoint_meta(list_checkpoints(out)[0]).get("inputs", {})
    except (OSError, ValueError):
        return  # refused, saying why, when it is restored
    now = {os.path.abspath(p.path) for p in [*carved.fit, *carved.valid]}
    moved = sorted(k for k in inputs.get("files", {}) if os.path.abspath(k) not in now)
    if moved:
        raise ValueError(f"--resume: the validation rows carved from --train moved (the "
                         f"run read {', '.join(moved)}, which this cut does not): resume "
                         "with the --train files the run started with, or train another "
                         "--out with --valid or --valid-split 0")


def _resumed_run_validated(out: Path) -> bool:
    """Whether the checkpoints in ``out`` were trained with validation rows (a refit's
    own history has none; the selection passes before it do): a resumed run carves
    again only then (the same files are cut the same way), so a model trained on every
    row without validation goes on doing so."""
    from terarec.modeldir import checkpoint_meta, list_checkpoints

    for path in list_checkpoints(out):
        try:  # one that cannot be read is refused, saying why, when it is restored
            history = checkpoint_meta(path).get("history", [])
        except (OSError, ValueError):
            continue
        if any("valid_logloss" in h for h in history):
            return True
    return False


def _refit(job: TrainJob, train: list[Path]) -> bool:
    """``refit`` as given, else on for small data (``refit_by_default``)."""
    if job.refit is not None:
        if job.refit and not job.valid:
            raise ValueError("--refit needs --valid, or validation rows carved from --train "
                             "(--valid-split): validation picks the epoch count")
        return bool(job.refit)
    return bool(job.valid) and refit_by_default(estimate_rows(train))


def _resuming(job: TrainJob) -> bool:
    """Whether this run continues the checkpoints in the model directory (``resume``, or
    a worker group torchrun restarted)."""
    from terarec.modeldir import list_checkpoints

    return (job.resume or restart_count() > 0) and bool(list_checkpoints(job.out))


def _features(job: TrainJob, ctx: DistContext) -> FeatureConfig | None:
    """The run's AutoFeature tables: the model's own when resuming, else ``features``."""
    return run_features(job.features, Path(job.out), ctx, resuming=_resuming(job))


def run_features(given: Path | None, out: Path, ctx: DistContext, *,
                 resuming: bool) -> FeatureConfig | None:
    """A run's AutoFeature tables (train and search): ``out``'s own copy when resuming,
    else the feature config ``given``, copied into ``out`` by rank 0 before any rank
    reads it, so the directory keeps what it was trained on."""
    from terarec.autofeature.features import FeatureConfig, install_features, model_features

    if resuming:
        return model_features(out)
    if not given:
        return None
    features = None
    if ctx.is_main:
        features = install_features(out, FeatureConfig.load(given))
        print(f"features: {', '.join(features.selected) or 'none selected'}")
    ctx.barrier()
    return features if features is not None else model_features(out)
