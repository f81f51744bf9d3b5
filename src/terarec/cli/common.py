"""Arguments shared by subcommands: input format and schema, training knobs."""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path

from terarec.config import TrainConfig, from_dict, load_train_config, to_dict
from terarec.data.readers import ReadStats, csv_schema
from terarec.train.selection import (
    DEFAULT_MAX_EPOCHS,
    DEFAULT_PATIENCE,
    SELECT_BY,
    SelectionTracker,
)
from terarec.types import FeatureSchema


def add_format_args(parser: argparse.ArgumentParser, required: bool = True) -> None:
    g = parser.add_argument_group("input format")
    g.add_argument("--format", choices=["criteo", "csv", "parquet"], default=None,
                   required=False, help="input format (default: criteo for training; "
                   "the model's own format for eval/predict)")
    g.add_argument("--label", help="label column (csv/parquet)")
    g.add_argument("--numeric", default="", help="comma-separated numeric columns")
    g.add_argument("--categorical", default="", help="comma-separated categorical columns")
    g.add_argument("--delimiter", default=",", help="csv delimiter (default ',')")
    g.add_argument("--multi-sep", default=None,
                   help="separator inside multi-valued categorical cells, e.g. '|'")
    g.add_argument("--multi-valued", default=None,
                   help="comma-separated categorical columns that are multi-valued")
    g.add_argument("--log1p", default="",
                   help="comma-separated numeric columns to log1p-transform")
    g.add_argument("--on-bad-row", choices=["error", "skip"], default="error",
                   help="stop at the first bad row (default) or skip and count bad rows")


def _split(text: str | None) -> list[str]:
    return [c.strip() for c in (text or "").split(",") if c.strip()]


def schema_from_args(args: argparse.Namespace) -> FeatureSchema:
    fmt = args.format or "criteo"
    if fmt == "criteo":
        return FeatureSchema.criteo()
    if not args.label or not (args.numeric or args.categorical):
        raise ValueError(f"--format {fmt} needs --label and --numeric and/or --categorical")
    log_cols = set(_split(args.log1p))
    numeric = _split(args.numeric)
    unknown = sorted(log_cols - set(numeric))
    if unknown:
        raise ValueError(f"--log1p names columns that are not --numeric: {unknown}")
    multi = _split(args.multi_valued) if args.multi_valued is not None else None
    return csv_schema(args.label, numeric, _split(args.categorical),
                      delimiter=args.delimiter, separator=args.multi_sep, multi_valued=multi,
                      transform={c: ("log1p" if c in log_cols else "none") for c in numeric},
                      format=fmt)


def schema_for_data(model_schema: FeatureSchema, args: argparse.Namespace) -> FeatureSchema:
    """The model's schema, read with another container format if ``--format`` says so."""
    if args.format in (None, model_schema.format):
        return model_schema
    from dataclasses import replace

    if args.format == "criteo":
        raise ValueError("--format criteo only fits models trained on Criteo data")
    return replace(model_schema, format=args.format,
                   delimiter=args.delimiter if args.format == "csv" else model_schema.delimiter,
                   has_header=True, column_names=())


def add_train_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("training")
    g.add_argument("--config", type=Path, help="TrainConfig JSON; flags below override it")
    g.add_argument("--model", dest="model_name", help="lr, fm, widedeep, deepfm, dcnv2, dlrm, dssm")
    g.add_argument("--embedding-dim", type=int)
    g.add_argument("--epochs", type=int)
    g.add_argument("--batch-size", type=int)
    g.add_argument("--pass-rows", type=int, help="rows per pass (store write-back unit)")
    g.add_argument("--sparse-optimizer", choices=["adagrad", "adam", "ftrl", "sgd"])
    g.add_argument("--sparse-lr", type=float)
    g.add_argument("--dense-lr", type=float)
    g.add_argument("--admit-min-count", type=int, help="a key gets a row once seen this often")
    g.add_argument("--evict-after-passes", type=int, help="drop keys unseen for N passes")
    g.add_argument("--memory-budget",
                   help="RAM for the embedding store, e.g. 512MB or 2GB: rows beyond it live "
                   "on disk (tiered store)")
    g.add_argument("--store-dir", help="folder for the tiered store's disk tier "
                   "(default: OUT/store for train)")
    g.add_argument("--cache-policy", choices=["lfu", "lru"],
                   help="which rows the tiered store keeps in RAM (default lfu)")
    g.add_argument("--seed", type=int)
    g.add_argument("--threads", type=int)
    g.add_argument("--device", help="auto (default), cpu, cuda, cuda:1 ...")
    add_compression_args(parser)


def add_compression_args(parser: argparse.ArgumentParser) -> None:
    """Store compression flags (docs/compression.md)."""
    g = parser.add_argument_group("embedding compression")
    g.add_argument("--precision", choices=["fp32", "fp16", "int8", "int4"],
                   help="how the store keeps row values (optimizer state stays fp32)")
    g.add_argument("--stochastic-rounding", action="store_true", default=None,
                   help="round values stochastically when rows are written back")
    g.add_argument("--variable-dims", type=_int_list,
                   help="widths of the rarer frequency classes, e.g. 1,4 (full row above)")
    g.add_argument("--promote-at", type=_float_list,
                   help="show counts that move a key to the next class, e.g. 10,100")
    g.add_argument("--group-lasso", type=float, metavar="LAMBDA",
                   help="group-lasso strength on embedding rows; zero rows are pruned")


def _number_list(cast: type, what: str):
    """An argparse ``type`` for comma-separated numbers, e.g. ``1,4,16``."""

    def parse(text: str) -> tuple:
        try:
            return tuple(cast(x) for x in text.split(",") if x.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected comma-separated {what}, got {text!r}") from None

    return parse


_int_list = _number_list(int, "integers")
_float_list = _number_list(float, "numbers")


def add_selection_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("validation-driven training (with --valid)")
    g.add_argument("--select-by", choices=list(SELECT_BY), default="logloss",
                   help="validation metric that picks the best checkpoint (default logloss)")
    g.add_argument("--patience", type=int, default=DEFAULT_PATIENCE,
                   help="stop after this many evaluations without improvement "
                   f"(default {DEFAULT_PATIENCE}); --epochs is then an upper bound "
                   f"(default {DEFAULT_MAX_EPOCHS} + patience)")
    g.add_argument("--eval-every", type=int, metavar="N",
                   help="evaluate at least every N steps: passes are cut to at most N "
                   "batches, so a pass boundary (evaluation, checkpoint) comes every N steps")


def selection_from_args(args: argparse.Namespace,
                        config: TrainConfig) -> SelectionTracker | None:
    """The run's selection tracker (None without --valid); with --valid, fixes the epoch
    upper bound and the pass length --eval-every asks for."""
    if not args.valid:
        if args.eval_every is not None:
            raise ValueError("--eval-every needs --valid")
        return None
    if args.eval_every is not None:
        if args.eval_every < 1:
            raise ValueError(f"--eval-every {args.eval_every}: must be >= 1")
        config.pass_rows = min(config.pass_rows, args.eval_every * config.batch_size)
    if args.epochs is None and args.config is None:
        config.epochs = DEFAULT_MAX_EPOCHS + args.patience
    return SelectionTracker(args.select_by, args.patience)


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    config = load_train_config(args.config) if args.config else TrainConfig()
    data = to_dict(config)
    overrides = {
        ("model", "name"): args.model_name, ("model", "embedding_dim"): args.embedding_dim,
        ("epochs",): args.epochs, ("batch_size",): args.batch_size,
        ("pass_rows",): args.pass_rows, ("sparse_optimizer", "name"): args.sparse_optimizer,
        ("sparse_optimizer", "lr"): args.sparse_lr, ("dense_optimizer", "lr"): args.dense_lr,
        ("store", "admit_min_count"): args.admit_min_count,
        ("store", "evict_after_passes"): args.evict_after_passes, ("seed",): args.seed,
        ("threads",): args.threads, ("device",): args.device,
        ("store", "memory_budget"): getattr(args, "memory_budget", None),
        ("store", "disk_path"): getattr(args, "store_dir", None),
        ("store", "cache_policy"): getattr(args, "cache_policy", None),
        ("on_bad_row",): getattr(args, "on_bad_row", None),
        ("store", "precision"): getattr(args, "precision", None),
        ("store", "stochastic_rounding"): getattr(args, "stochastic_rounding", None),
        ("store", "variable_dims"): getattr(args, "variable_dims", None),
        ("store", "promote_at"): getattr(args, "promote_at", None),
        ("sparse_optimizer", "group_lasso"): getattr(args, "group_lasso", None),
    }
    for path, value in overrides.items():
        if value is None:
            continue
        node = data
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
    return from_dict(TrainConfig, data)


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
def model_data(args: argparse.Namespace) -> Iterator[tuple]:
    """(trainer restored from ``--model``, batches of ``--data``, their ReadStats).

    A model trained with AutoFeature tables has them joined onto the raw rows first, so
    new rows get exactly the features training computed.
    """
    from terarec.autofeature.features import model_inputs
    from terarec.train.checkpoint import checkpoint_name, restore_trainer
    from terarec.train.passes import iter_file_batches

    trainer = restore_trainer(args.model,
                              name=checkpoint_name(args.model, getattr(args, "checkpoint",
                                                                       "best")))
    with model_inputs(args.model, trainer.schema, args.data,
                      lambda s: schema_for_data(s, args)) as (schema, data):
        stats = ReadStats()
        yield trainer, iter_file_batches(data, schema, trainer.config.batch_size,
                                         on_bad_row=args.on_bad_row, stats=stats), stats
