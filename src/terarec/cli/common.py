"""Arguments shared by subcommands: input format and schema, training knobs."""

from __future__ import annotations

import argparse
import contextlib
import sys
import typing
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from terarec.config import (
    COMPRESSION,
    INPUT_FORMAT,
    REGULARISATION,
    TRAINING,
    DenseCommConfig,
    TrainConfig,
    config_file_keys,
    flag_fields,
    from_dict,
    load_train_config,
    to_dict,
)
from terarec.data.numeric import (
    DEFAULT_STATS_ROWS,
    MAX_BUCKETS,
    ROWS_PER_BUCKET,
)
from terarec.data.spec import DataSpec, names
from terarec.train.selection import (
    DEFAULT_MAX_EPOCHS,
    DEFAULT_PATIENCE,
    SELECT_BY,
    SelectionTracker,
)
from terarec.types import FeatureSchema
from terarec.validation import InvalidInput, strip_type

if typing.TYPE_CHECKING:
    from terarec.api.training import TrainJob
    from terarec.data.readers import ReadStats


def add_format_args(parser: argparse.ArgumentParser, required: bool = True) -> None:
    g = parser.add_argument_group("input format")
    g.add_argument("--format", choices=["criteo", "csv", "parquet"], default=None,
                   required=False, help="input format (default: criteo for training; "
                   "the model's own format for eval/predict)")
    g.add_argument("--label", help="label column (csv/parquet); several as "
                   "click:1,conversion:0.5 (one task each, with its loss weight) for a "
                   "multi-task model (sharedbottom, mmoe, esmm)")
    g.add_argument("--numeric", default="", help="comma-separated numeric columns")
    g.add_argument("--categorical", default="", help="comma-separated categorical columns")
    g.add_argument("--delimiter", default=None,
                   help="csv delimiter (default ','; for eval/predict the model's own)")
    g.add_argument("--multi-sep", default=None,
                   help="separator inside multi-valued categorical cells, e.g. '|'")
    g.add_argument("--multi-valued", default=None,
                   help="comma-separated categorical columns that are multi-valued")
    g.add_argument("--sequence", default="", metavar="COL[:MAX_LEN],...",
                   help="ordered multi-valued columns kept as sequences of their most "
                   "recent MAX_LEN values (default 50), not pooled (docs/sequences.md)")
    g.add_argument("--share-table", default="", metavar="FIELD=TABLE,...",
                   help="fields that look up another field's table: the same value gives "
                   "the same key and row (e.g. hist_items=item)")
    g.add_argument("--log1p", default=None,
                   help="comma-separated numeric columns to transform with signed log1p; "
                   "the others get none (default: every numeric column gets "
                   "--numeric-transform)")
    g.add_argument("--numeric-transform", choices=["log1p", "none"], default=None,
                   help="per-value transform of every numeric column before "
                   "standardisation (default log1p: sign(x) * log(1 + |x|))")
    add_config_flags(g, INPUT_FORMAT)  # --on-bad-row


def spec_from_args(args: argparse.Namespace) -> DataSpec:
    """The ``DataSpec`` the format and numeric-statistics flags describe (a command
    without the numeric flags gets their defaults)."""
    return DataSpec(
        format=args.format, label=args.label, numeric=names(args.numeric),
        categorical=names(args.categorical), delimiter=getattr(args, "delimiter", None),
        multi_sep=args.multi_sep,
        multi_valued=names(args.multi_valued) if args.multi_valued is not None else None,
        log1p=names(args.log1p) if args.log1p is not None else None,
        numeric_transform=getattr(args, "numeric_transform", None),
        standardize=not getattr(args, "no_standardize", False),
        stats_rows=getattr(args, "stats_rows", DEFAULT_STATS_ROWS),
        numeric_buckets=getattr(args, "numeric_buckets", None),
        sequences=names(getattr(args, "sequence", "")),
        share_tables=names(getattr(args, "share_table", "")))


def schema_from_args(args: argparse.Namespace) -> FeatureSchema:
    """The schema the format flags make (``DataSpec.schema``)."""
    return spec_from_args(args).schema()


def add_numeric_stats_args(parser: argparse.ArgumentParser) -> None:
    """How training gathers the standardisation statistics of numeric columns."""
    g = parser.add_argument_group("numeric columns")
    g.add_argument("--no-standardize", action="store_true",
                   help="feed transformed numeric values as they are, without the "
                   "(x - mean) / std the first rows' statistics give")
    g.add_argument("--stats-rows", type=int, default=DEFAULT_STATS_ROWS,
                   help="rows read from the start of --train for numeric statistics "
                   f"(default {DEFAULT_STATS_ROWS:,})")
    g.add_argument("--numeric-buckets", type=_buckets_arg, default=None,
                   metavar="log|tested|N",
                   help="also feed each numeric column's bucket as a categorical key: log "
                   "(default): integer columns cut at sign(x)*floor(log1p|x|^2), the others "
                   "as tested; tested: one quantile bucket per "
                   f"{ROWS_PER_BUCKET} sampled values, at most {MAX_BUCKETS}, where the "
                   "label departs from a linear effect; N: at most N quantile buckets on "
                   "every column; 0: off")


def _buckets_arg(text: str) -> int | str:
    """The value of ``--numeric-buckets``: a bucket count, ``log`` or ``tested``."""
    if text in ("log", "tested"):
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected a bucket count, 'log' or 'tested'") from None


def add_train_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("training")
    g.add_argument("--config", type=Path, help="TrainConfig JSON; flags given override it")
    add_config_flags(g, TRAINING)
    add_config_flags(parser.add_argument_group(REGULARISATION), REGULARISATION)  # models.md
    add_config_flags(parser.add_argument_group(COMPRESSION), COMPRESSION)  # docs/compression.md


def add_config_flags(group: argparse._ArgumentGroup, name: str) -> None:
    """The flags of the TrainConfig fields in flag group ``name`` (``knob`` in config.py).

    Every flag defaults to None, meaning "not given": only flags the user passed
    override the ``--config`` file (``config_from_args``)."""
    for _, flag, tp, default in flag_fields():
        if flag.group != name:
            continue
        kwargs: dict[str, Any] = {"dest": flag.attr, "default": None, "metavar": flag.metavar}
        base = strip_type(tp)
        if typing.get_origin(base) is typing.Literal:
            kwargs["choices"] = list(typing.get_args(base))
        elif base is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif typing.get_origin(base) is tuple:
            item = strip_type(typing.get_args(base)[0])
            kwargs["type"] = _int_list if item is int else _float_list
        else:
            kwargs["type"] = base if base in (int, float) else str
        shown = "" if default in (None, (), False) or "default" in flag.help \
            else f" (default: {default})"  # a help that explains its default says it
        group.add_argument(flag.name, help=(flag.help + shown).strip() or None, **kwargs)


def _number_list(cast: type, what: str) -> Callable[[str], tuple[Any, ...]]:
    """An argparse ``type`` for comma-separated numbers, e.g. ``1,4,16``."""

    def parse(text: str) -> tuple[Any, ...]:
        try:
            return tuple(cast(x) for x in text.split(",") if x.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected comma-separated {what}, got {text!r}") from None

    return parse


_int_list = _number_list(int, "integers")
_float_list = _number_list(float, "numbers")


def add_training_args(p: argparse.ArgumentParser) -> None:
    """What ``train`` and ``search`` both take: input format, numeric statistics, the
    training knobs and validation-driven selection (a trial is one ``train`` run)."""
    add_format_args(p)
    add_numeric_stats_args(p)
    add_train_args(p)
    add_selection_args(p)


def add_selection_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("validation-driven training (with --valid)")
    g.add_argument("--select-by", choices=list(SELECT_BY), default="logloss",
                   help="validation metric that picks the best checkpoint (default logloss)")
    g.add_argument("--select-task", default=None, metavar="LABEL",
                   help="with several --label columns: select by this label's metric "
                   "(default: the label weights' weighted mean)")
    g.add_argument("--patience", type=int, default=DEFAULT_PATIENCE,
                   help="stop after this many epochs of evaluations without "
                   "improvement (every pass is evaluated; with --eval-every, this many "
                   f"evaluations) (default {DEFAULT_PATIENCE}); --epochs is then an upper bound "
                   f"(default {DEFAULT_MAX_EPOCHS} + patience, more on small data: room for "
                   "3,000 steps, at most 100 epochs)")
    g.add_argument("--eval-every", type=int, metavar="N",
                   help="evaluate at least every N steps: passes are cut to at most N "
                   "batches, so a pass boundary (evaluation, checkpoint) comes every N steps")


def selection_from_args(args: argparse.Namespace,
                        config: TrainConfig) -> SelectionTracker | None:
    """The run's selection tracker (None without --valid); with --valid, fixes the epoch
    upper bound and the pass length --eval-every asks for (``training.selection_for``)."""
    from terarec.api.training import TrainJob, selection_for

    return selection_for(TrainJob(out=Path("."), train=args.train, valid=args.valid,
                                  select_by=args.select_by, patience=args.patience,
                                  select_task=getattr(args, "select_task", None),
                                  eval_every=args.eval_every,
                                  given=explicit_config_keys(args)), config)


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The ``--config`` file (or the defaults) with the config flags the user passed
    applied on top; a bad value is an error naming the flag or the file."""
    config_file = getattr(args, "config", None)
    config = load_train_config(config_file) if config_file else TrainConfig()
    data = to_dict(config)
    passed: dict[str, str] = {}
    for path, flag, _, _ in flag_fields():
        value = getattr(args, flag.attr, None)
        if value is None:
            continue
        node = data
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
        passed[".".join(path)] = flag.name
    try:
        return from_dict(TrainConfig, data)
    except InvalidInput as exc:
        lines = [f"{passed[p.path]}: {p.message}" if p.path in passed else p.message
                 for p in exc.problems]
        raise InvalidInput("; ".join(lines), exc.problems) from None


def train_job_from_args(args: argparse.Namespace,
                        dense_comm: DenseCommConfig | None = None) -> TrainJob:
    """The ``TrainJob`` the flags describe (``train``'s, or what every trial of a
    ``search`` is: a command without the follow and export flags has none)."""
    from terarec.api.training import ExportSchedule, FollowSettings, TrainJob
    from terarec.cli.storage_args import storage_options_from_args

    follow = getattr(args, "follow", None)
    named = {".".join(path): flag.name for path, flag, _, _ in flag_fields()
             if getattr(args, flag.attr, None) is not None}
    export_to = getattr(args, "export_to", None)
    return TrainJob(
        out=args.out, config=config_from_args(args), train=args.train,
        follow=None if follow is None else FollowSettings(
            follow, poll_seconds=args.poll_seconds, stop_after=args.stop_after,
            stop_idle=args.stop_idle),
        valid=args.valid, data=spec_from_args(args), given=explicit_config_keys(args),
        named=named, config_origin=f"--config {args.config}", resume=args.resume,
        refit=args.refit, checkpoint_every=args.checkpoint_every,
        progress=not args.no_progress, features=args.features, select_by=args.select_by,
        select_task=getattr(args, "select_task", None),
        patience=args.patience, eval_every=args.eval_every,
        export=ExportSchedule() if export_to is None and not hasattr(args, "delta_every")
        else ExportSchedule(
            to=export_to, delta_every=args.delta_every, delta_minutes=args.delta_minutes,
            full_every_hours=args.full_every_hours, full_at=args.full_at,
            publish_to=getattr(args, "publish_to", None),
            publish_namespace=getattr(args, "publish_namespace", "terarec"),
            storage_options=storage_options_from_args(args)),
        dense_comm=dense_comm or DenseCommConfig(), choose=getattr(args, "choose", None),
        valid_split=getattr(args, "valid_split", None))


def explicit_config_keys(args: argparse.Namespace) -> set[str]:
    """Dotted config keys the user gave, by a flag or in ``--config``: the ones
    data-sized defaults (terarec.train.defaults) leave alone."""
    keys = {".".join(path) for path, flag, _, _ in flag_fields()
            if getattr(args, flag.attr, None) is not None}
    config_file = getattr(args, "config", None)
    if config_file:
        keys |= config_file_keys(config_file)
    return keys


def report_skipped(stats: ReadStats, what: str = "rows") -> None:
    if stats.skipped:
        print(f"skipped {stats.skipped} bad {what}; first: " + " | ".join(stats.examples),
              file=sys.stderr)


def add_model_data_args(parser: argparse.ArgumentParser, data_help: str) -> None:
    """``--model DIR --data FILE...`` plus the format args, for commands that score."""
    parser.add_argument("--model", required=True, type=Path, help="model directory")
    parser.add_argument("--data", nargs="+", required=True, type=Path, help=data_help)
    add_checkpoint_arg(parser)
    add_format_args(parser)


def add_checkpoint_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", default="best", metavar="best|latest|pass-N",
                        help="which checkpoint of the model directory: best (default: the "
                        "best on the validation set, the newest without one), latest, or "
                        "pass-N")


@contextlib.contextmanager
def model_data(args: argparse.Namespace, *, with_label: bool = True) -> Iterator[tuple]:
    """(trainer restored from ``--model``, batches of ``--data``, their ReadStats).
    ``with_label=False`` (predict: new rows) never reads a label, so files may lack it.
    A model trained with AutoFeature tables has them joined onto the raw rows first
    (``model_files``)."""
    from terarec.train.passes import iter_file_batches

    with model_files(args) as (trainer, schema, data):
        from terarec.data.readers import ReadStats

        stats = ReadStats()
        batches = iter_file_batches(data, schema, trainer.config.batch_size,
                                    on_bad_row=args.on_bad_row or "error", stats=stats,
                                    with_label=with_label)
        yield trainer, _with_rows(batches, args.data, stats), stats


@contextlib.contextmanager
def model_files(args: argparse.Namespace) -> Iterator[tuple]:
    """(trainer restored from ``--model``, the schema to read ``--data`` with, the files
    to read): ``Model.scoring_files``. The command's ``--out`` file is checked first: a
    folder there (or a file above it) failed only once every row was scored."""
    from terarec.api.model import Model, check_output_path

    check_output_path(getattr(args, "out", None))
    model = Model(args.model, getattr(args, "checkpoint", "best"))
    with model.scoring_files(args.data, spec_from_args(args),
                             getattr(args, "on_bad_row", None) or "error") as scored:
        yield scored


def _with_rows(batches: Iterator[Any], paths: list[Path], stats: ReadStats) -> Iterator[Any]:
    """``batches``, then an error naming the files when they held no row to score: with
    every row skipped, predict wrote an empty file and exited 0."""
    from terarec.api.model import check_rows_scored

    yield from batches
    check_rows_scored(paths, stats)
