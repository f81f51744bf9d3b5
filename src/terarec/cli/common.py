"""Arguments shared by subcommands: input format and schema, training knobs."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import typing
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from terarec.autofeature.features import FeatureConfig, install_features, model_features
from terarec.config import (
    COMPRESSION,
    INPUT_FORMAT,
    REGULARISATION,
    TRAINING,
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
    with_numeric_stats,
)
from terarec.data.readers import ReadStats, check_delimiter, csv_schema
from terarec.distributed.context import DistContext
from terarec.io import ScratchDir, file_above
from terarec.train.defaults import estimate_rows, max_epochs
from terarec.train.selection import (
    DEFAULT_MAX_EPOCHS,
    DEFAULT_PATIENCE,
    SELECT_BY,
    SelectionTracker,
)
from terarec.types import FeatureSchema, NumericTransform
from terarec.validation import InvalidInput, strip_type


def add_format_args(parser: argparse.ArgumentParser, required: bool = True) -> None:
    g = parser.add_argument_group("input format")
    g.add_argument("--format", choices=["criteo", "csv", "parquet"], default=None,
                   required=False, help="input format (default: criteo for training; "
                   "the model's own format for eval/predict)")
    g.add_argument("--label", help="label column (csv/parquet)")
    g.add_argument("--numeric", default="", help="comma-separated numeric columns")
    g.add_argument("--categorical", default="", help="comma-separated categorical columns")
    g.add_argument("--delimiter", default=None,
                   help="csv delimiter (default ','; for eval/predict the model's own)")
    g.add_argument("--multi-sep", default=None,
                   help="separator inside multi-valued categorical cells, e.g. '|'")
    g.add_argument("--multi-valued", default=None,
                   help="comma-separated categorical columns that are multi-valued")
    g.add_argument("--log1p", default=None,
                   help="comma-separated numeric columns to transform with signed log1p; "
                   "the others get none (default: every numeric column gets "
                   "--numeric-transform)")
    g.add_argument("--numeric-transform", choices=["log1p", "none"], default=None,
                   help="per-value transform of every numeric column before "
                   "standardisation (default log1p: sign(x) * log(1 + |x|))")
    add_config_flags(g, INPUT_FORMAT)  # --on-bad-row


def _split(text: str | None) -> list[str]:
    return [c.strip() for c in (text or "").split(",") if c.strip()]


def check_format_args(args: argparse.Namespace) -> None:
    """The input-format flags a new schema needs, checked before any work is done."""
    fmt = args.format or "criteo"
    if fmt != "criteo" and (not args.label or not (args.numeric or args.categorical)):
        raise ValueError(f"--format {fmt} needs --label and --numeric and/or --categorical")
    if fmt != "criteo":  # Criteo refuses it with the other column flags
        check_delimiter_arg(getattr(args, "delimiter", None), fmt)


def check_delimiter_arg(delimiter: str | None, fmt: str) -> None:
    """``--delimiter``: one character, and only where it is read (csv); elsewhere it
    would be ignored, and a longer one failed deep in the reader with a traceback."""
    if delimiter is None:
        return
    if fmt != "csv":
        raise ValueError(f"--delimiter: only for csv data; this data is {fmt}")
    problem = check_delimiter(delimiter)
    if problem:
        raise ValueError(f"--delimiter {delimiter!r}: {problem}")


def schema_from_args(args: argparse.Namespace) -> FeatureSchema:
    check_format_args(args)
    fmt = args.format or "criteo"
    if fmt == "criteo":
        return _criteo_schema(args)
    numeric = _split(args.numeric)
    default: NumericTransform = getattr(args, "numeric_transform", None) or "log1p"
    transform: dict[str, NumericTransform] = {c: default for c in numeric}
    if args.log1p is not None:  # an explicit list: those columns, and no others
        if getattr(args, "numeric_transform", None) is not None:
            raise ValueError("--log1p and --numeric-transform both say how to transform "
                             "numeric columns; give one of them")
        log_cols = set(_split(args.log1p))
        unknown = sorted(log_cols - set(numeric))
        if unknown:
            raise ValueError(f"--log1p names columns that are not --numeric: {unknown}")
        transform = {c: ("log1p" if c in log_cols else "none") for c in numeric}
    multi = _split(args.multi_valued) if args.multi_valued is not None else None
    categorical = _split(args.categorical)
    _check_column_flags(args.label, numeric, categorical, multi)
    return csv_schema(args.label, numeric, categorical,
                      delimiter=args.delimiter if args.delimiter is not None else ",",
                      separator=args.multi_sep, multi_valued=multi,
                      transform=transform, format=fmt)


def _check_column_flags(label: str, numeric: list[str], categorical: list[str],
                        multi: list[str] | None) -> None:
    """A column named twice across --label / --numeric / --categorical, or a
    --multi-valued one that is not --categorical: said with the flags (the schema's own
    check names its fields)."""
    lists = (("--label", [label] if label else []), ("--numeric", numeric),
             ("--categorical", categorical))
    for i, (flag, names) in enumerate(lists):
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ValueError(f"{flag} names {', '.join(map(repr, repeated))} twice")
        for other, others in lists[i + 1:]:
            both = [n for n in names if n in others]
            if both:
                raise ValueError(f"{flag} and {other} both name {', '.join(map(repr, both))}:"
                                 " a column is one of label, numeric or categorical")
    stray = [n for n in multi or [] if n not in categorical]
    if stray:
        raise ValueError(f"--multi-valued names {', '.join(map(repr, stray))}, not among "
                         "--categorical: only categorical columns hold several values")


# Flags that describe the columns of a csv / parquet file (attribute, flag, default).
_COLUMN_FLAGS = (("label", "--label", None), ("numeric", "--numeric", ""),
                 ("categorical", "--categorical", ""), ("delimiter", "--delimiter", None),
                 ("multi_sep", "--multi-sep", None), ("multi_valued", "--multi-valued", None),
                 ("log1p", "--log1p", None))


def _criteo_schema(args: argparse.Namespace) -> FeatureSchema:
    """The Criteo schema; its columns are fixed, so a flag naming columns is an error
    rather than ignored. ``--numeric-transform`` applies to its I1-I13."""
    given = [flag for attr, flag, default in _COLUMN_FLAGS
             if getattr(args, attr, default) != default]
    if given:
        raise ValueError(f"{', '.join(given)}: only for --format csv or parquet; the Criteo "
                         "format's columns are fixed (label, I1-I13, C1-C26)")
    schema = FeatureSchema.criteo()
    transform = getattr(args, "numeric_transform", None)
    if transform is None:
        return schema
    return replace(schema, fields=tuple(
        replace(f, transform=transform) if f.kind == "numeric" else f for f in schema.fields))


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


def train_schema_from_args(args: argparse.Namespace,
                           base: FeatureSchema | None = None,
                           ctx: DistContext | None = None) -> FeatureSchema:
    """The schema a new training run uses: ``base`` (default ``schema_from_args``) with
    numeric statistics and bucket edges from the first ``--stats-rows`` rows of ``--train``.
    Bad rows are left out of the statistics here; training reads them again and reports
    or skips them as ``--on-bad-row`` says (on every rank alike under torchrun). With
    ``ctx`` one of N ranks (collective), each rank reads its share of those rows."""
    schema = base if base is not None else schema_from_args(args)
    rows = getattr(args, "stats_rows", DEFAULT_STATS_ROWS)
    if rows <= 0:
        raise ValueError(f"--stats-rows must be positive, got {rows}")
    buckets = getattr(args, "numeric_buckets", None)
    if isinstance(buckets, int) and (buckets < 0 or buckets == 1):
        raise ValueError(f"--numeric-buckets {buckets}: must be 0 (off) or at least 2")
    standardize = not getattr(args, "no_standardize", False)
    if ctx is not None and ctx.world > 1:
        return with_numeric_stats(schema, args.train, max_rows=rows, on_bad_row="skip",
                                  standardize=standardize, buckets=buckets,
                                  rank=ctx.rank, world=ctx.world,
                                  gather=ctx.all_gather_object)
    return with_numeric_stats(schema, args.train, max_rows=rows, on_bad_row="skip",
                              standardize=standardize, buckets=buckets)


def schema_for_data(model_schema: FeatureSchema, args: argparse.Namespace) -> FeatureSchema:
    """The model's schema, read with another container format if ``--format`` says so and
    another csv delimiter if ``--delimiter`` does. The schema fixes the columns and their
    transforms: a flag naming them is an error rather than ignored."""
    given = [flag for attr, flag, default in _COLUMN_FLAGS
             if attr != "delimiter" and getattr(args, attr, default) != default]
    if getattr(args, "numeric_transform", None) is not None:
        given.append("--numeric-transform")
    if given:
        raise ValueError(f"{', '.join(given)}: the model's schema fixes its columns and "
                         "their transforms; leave them out (--format and --delimiter say "
                         "how the file is written)")
    fmt = args.format or model_schema.format
    delimiter = getattr(args, "delimiter", None)
    check_delimiter_arg(delimiter, fmt)
    if fmt == model_schema.format:
        return model_schema if delimiter is None else replace(model_schema,
                                                              delimiter=delimiter)
    if fmt == "criteo":
        raise ValueError("--format criteo only fits models trained on Criteo data")
    return replace(model_schema, format=fmt,
                   delimiter=(delimiter or ",") if fmt == "csv" else model_schema.delimiter,
                   has_header=True, column_names=())


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
        shown = "" if default in (None, (), False) else f" (default: {default})"
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
    g.add_argument("--patience", type=int, default=DEFAULT_PATIENCE,
                   help="stop after this many evaluations without improvement "
                   f"(default {DEFAULT_PATIENCE}); --epochs is then an upper bound "
                   f"(default {DEFAULT_MAX_EPOCHS} + patience, more on small data: room for "
                   "3,000 steps, at most 100 epochs)")
    g.add_argument("--eval-every", type=int, metavar="N",
                   help="evaluate at least every N steps: passes are cut to at most N "
                   "batches, so a pass boundary (evaluation, checkpoint) comes every N steps")


def selection_from_args(args: argparse.Namespace,
                        config: TrainConfig) -> SelectionTracker | None:
    """The run's selection tracker (None without --valid); with --valid, fixes the epoch
    upper bound and the pass length --eval-every asks for."""
    if not args.valid:
        given = [flag for flag, value, default in (
            ("--eval-every", args.eval_every, None), ("--patience", args.patience,
                                                      DEFAULT_PATIENCE),
            ("--select-by", args.select_by, "logloss")) if value != default]
        if given:  # each was silently ignored without a validation set
            raise ValueError(f"{', '.join(given)} needs --valid")
        return None
    if args.patience < 1:
        raise ValueError(f"--patience {args.patience}: must be >= 1")
    if args.eval_every is not None:
        if args.eval_every < 1:
            raise ValueError(f"--eval-every {args.eval_every}: must be >= 1")
        config.pass_rows = min(config.pass_rows, args.eval_every * config.batch_size)
    if "epochs" not in explicit_config_keys(args):  # neither --epochs nor the config file
        config.epochs = max_epochs(estimate_rows(args.train), config.batch_size) + args.patience
    return SelectionTracker(args.select_by, args.patience)


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


def explicit_config_keys(args: argparse.Namespace) -> set[str]:
    """Dotted config keys the user gave, by a flag or in ``--config``: the ones
    data-sized defaults (terarec.train.defaults) leave alone."""
    keys = {".".join(path) for path, flag, _, _ in flag_fields()
            if getattr(args, flag.attr, None) is not None}
    config_file = getattr(args, "config", None)
    if config_file:
        keys |= config_file_keys(config_file)
    return keys


def check_no_repeats(paths: Sequence[str | Path], flag: str) -> None:
    """A file named twice in one list (``a.csv ./a.csv``, or through a link) would have
    every row trained twice, and checkpoints key a file's position by its path, so the
    two readings would also share one position: refused naming the flag and the file."""
    seen: dict[str, str | Path] = {}
    for path in paths:
        real = os.path.realpath(path)
        if real in seen:
            first = f" (as {seen[real]})" if str(seen[real]) != str(path) else ""
            raise ValueError(f"{flag}: {path} is named twice{first}: its rows would be "
                             "read twice; name it once")
        seen[real] = path


# The rows are joined with AutoFeature tables in DuckDB first, which stops at a bad row
# before the reader could skip it: the setting would be ignored.
SKIP_WITH_FEATURES = ("--on-bad-row skip (on_bad_row in --config) does not work with "
                      "AutoFeature tables: their join reads every row first and stops at "
                      "the first bad one; clean the files or train without --features")


def run_features(given: Path | None, out: Path, ctx: DistContext, *,
                 resuming: bool) -> FeatureConfig | None:
    """A run's AutoFeature tables (``train`` and ``search``): ``out``'s own copy when
    resuming, else the ``--features`` config ``given``, copied into ``out`` by rank 0
    before any rank reads it, so the directory keeps what it was trained on."""
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


def check_disjoint(train: Sequence[str | Path], valid: Sequence[str | Path]) -> None:
    """A file in both --train and --valid: validation would score rows the model trained
    on (picking the overfit pass as best), and a refit would train them twice."""
    trained = {os.path.realpath(p): p for p in train}
    for path in valid:
        if (same := trained.get(os.path.realpath(path))) is not None:
            named = f" (as {same})" if str(same) != str(path) else ""
            raise ValueError(f"--valid: {path} is also a --train file{named}: validation "
                             "must hold rows training does not see")


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
        stats = ReadStats()
        batches = iter_file_batches(data, schema, trainer.config.batch_size,
                                    on_bad_row=args.on_bad_row or "error", stats=stats,
                                    with_label=with_label)
        yield trainer, _with_rows(batches, args.data, stats), stats


@contextlib.contextmanager
def model_files(args: argparse.Namespace) -> Iterator[tuple]:
    """(trainer restored from ``--model``, the schema to read ``--data`` with, the files
    to read). A model trained with AutoFeature tables has them joined onto the raw rows
    first, so new rows get exactly the features training computed. The command's
    ``--out`` file is checked first: a folder there (or a file above it) failed only once
    every row was scored."""
    from terarec.autofeature.features import model_inputs
    from terarec.modeldir import checkpoint_name
    from terarec.train.trainer import Trainer

    out = getattr(args, "out", None)
    if out is not None and Path(out).is_dir():
        raise ValueError(f"--out {out} is a folder, not a file")
    if out is not None and (above := file_above(out)) is not None:
        raise ValueError(f"--out {out}: {above} is a file, not a folder")
    features = model_features(args.model)
    if getattr(args, "on_bad_row", None) == "skip" and features and features.tables.tables:
        raise ValueError(f"--on-bad-row skip: {args.model} was trained with AutoFeature "
                         "tables, whose join reads every row first and stops at the "
                         "first bad one; clean the files (the error names the row)")
    with scoring_scratch(args.model) as scratch:
        trainer = Trainer.from_checkpoint(args.model, scratch_dir=scratch, name=checkpoint_name(
            args.model, getattr(args, "checkpoint", "best")))
        with model_inputs(args.model, trainer.schema, args.data,
                          lambda s: schema_for_data(s, args)) as (schema, data):
            yield trainer, schema, data


def _with_rows(batches: Iterator[Any], paths: list[Path], stats: ReadStats) -> Iterator[Any]:
    """``batches``, then an error naming the files when they held no row to score: with
    every row skipped, predict wrote an empty file and exited 0."""
    yield from batches
    check_rows_scored(paths, stats)


def check_rows_scored(paths: Sequence[Path], stats: ReadStats) -> None:
    """An error naming the files when they held no row to score."""
    if not stats.rows:
        files = ", ".join(str(p) for p in paths)
        if stats.skipped:
            raise ValueError(f"no rows to score in {files}: all {stats.skipped} rows read "
                             f"were bad and skipped (--on-bad-row skip); first: "
                             f"{stats.examples[0]}")
        raise ValueError(f"no rows to score in {files}: the files hold no data rows")


SCRATCH_DIR = ".scratch"  # inside a model directory: private folders of scoring runs


@contextlib.contextmanager
def scoring_scratch(model_dir: Path) -> Iterator[Path]:
    """A private folder for a scoring run's tiered store, inside the model directory so
    that a run killed with -9 leaves nothing elsewhere (the next run removes it); in the
    temp folder when the model directory is read-only. Removed on exit."""
    try:
        if not (model_dir / "schema.json").is_file():  # not a model: leave it untouched
            raise NotADirectoryError(model_dir)  # Trainer.from_checkpoint says what is wrong
        scratch = ScratchDir(model_dir / SCRATCH_DIR, "store")
    except OSError:
        scratch = ScratchDir(tempfile.gettempdir(), "terarec-store")
    with scratch as path:
        yield path
