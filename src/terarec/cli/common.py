"""Arguments shared by subcommands: input format and schema, training knobs."""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path

from terarec.config import TrainConfig, from_dict, load_train_config, to_dict
from terarec.data.numeric import DEFAULT_STATS_ROWS, with_numeric_stats
from terarec.data.readers import ReadStats, csv_schema
from terarec.types import FeatureSchema, NumericTransform


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
    g.add_argument("--log1p", default=None,
                   help="comma-separated numeric columns to transform with signed log1p; "
                   "the others get --numeric-transform none (default: every numeric "
                   "column gets --numeric-transform)")
    g.add_argument("--numeric-transform", choices=["log1p", "none"], default=None,
                   help="per-value transform of numeric columns before standardisation "
                   "(default log1p: sign(x) * log(1 + |x|))")
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
    numeric = _split(args.numeric)
    default = getattr(args, "numeric_transform", None) or "log1p"
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
    return csv_schema(args.label, numeric, _split(args.categorical),
                      delimiter=args.delimiter, separator=args.multi_sep, multi_valued=multi,
                      transform=transform, format=fmt)


def add_numeric_stats_args(parser: argparse.ArgumentParser) -> None:
    """How training gathers the standardisation statistics of numeric columns."""
    g = parser.add_argument_group("numeric columns")
    g.add_argument("--no-standardize", action="store_true",
                   help="feed transformed numeric values as they are, without the "
                   "(x - mean) / std the first rows' statistics give")
    g.add_argument("--stats-rows", type=int, default=DEFAULT_STATS_ROWS,
                   help="rows read from the start of --train for numeric statistics "
                   f"(default {DEFAULT_STATS_ROWS:,})")


def train_schema_from_args(args: argparse.Namespace,
                           base: FeatureSchema | None = None) -> FeatureSchema:
    """The schema a new training run uses: ``base`` (default ``schema_from_args``) with
    numeric statistics gathered from the first ``--stats-rows`` rows of ``--train``."""
    schema = base if base is not None else schema_from_args(args)
    if getattr(args, "no_standardize", False):
        return schema
    rows = getattr(args, "stats_rows", DEFAULT_STATS_ROWS)
    if rows <= 0:
        raise ValueError(f"--stats-rows must be positive, got {rows}")
    return with_numeric_stats(schema, args.train, max_rows=rows,
                              on_bad_row=getattr(args, "on_bad_row", "error"))


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
    add_regularisation_args(parser)
    add_compression_args(parser)


def add_regularisation_args(parser: argparse.ArgumentParser) -> None:
    """Regularisation flags (docs/models.md)."""
    g = parser.add_argument_group("regularisation")
    g.add_argument("--embedding-l2", type=float, metavar="LAMBDA",
                   help="L2 on the embeddings each batch looks up, per use and independent "
                   "of the batch size (BARS's embedding_regularizer; default 0)")
    g.add_argument("--sparse-weight-decay", type=float, metavar="WD",
                   help="L2 added to a touched row's gradient once per step (default 0)")
    g.add_argument("--dense-weight-decay", type=float, metavar="WD",
                   help="weight decay of the dense optimizer (default 0)")
    g.add_argument("--dropout", type=float, help="dropout after every hidden MLP layer "
                   "(default 0)")
    g.add_argument("--batch-norm", action="store_true", default=None,
                   help="batch norm before every hidden MLP activation")


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


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    config = load_train_config(args.config) if args.config else TrainConfig()
    data = to_dict(config)
    for path, value in _overrides(args).items():
        if value is None:
            continue
        node = data
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
    return from_dict(TrainConfig, data)


def explicit_config_keys(args: argparse.Namespace) -> set[str]:
    """Dotted config keys the user gave, by a flag or in ``--config``: the ones
    data-sized defaults (terarec.train.defaults) leave alone."""
    keys = {".".join(path) for path, value in _overrides(args).items() if value is not None}
    if getattr(args, "config", None):
        import json

        def walk(node: dict, prefix: str) -> None:
            for k, v in node.items():
                if isinstance(v, dict):
                    walk(v, f"{prefix}{k}.")
                else:
                    keys.add(prefix + k)

        with open(args.config) as fh:
            walk(json.load(fh), "")
    return keys


def _overrides(args: argparse.Namespace) -> dict[tuple[str, ...], object]:
    """Config key path -> the flag's value (None when the flag was not given)."""
    return {
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
        ("sparse_optimizer", "embedding_l2"): getattr(args, "embedding_l2", None),
        ("sparse_optimizer", "weight_decay"): getattr(args, "sparse_weight_decay", None),
        ("dense_optimizer", "weight_decay"): getattr(args, "dense_weight_decay", None),
        ("model", "dropout"): getattr(args, "dropout", None),
        ("model", "batch_norm"): getattr(args, "batch_norm", None),
    }


def report_skipped(stats: ReadStats, what: str = "rows") -> None:
    if stats.skipped:
        print(f"skipped {stats.skipped} bad {what}; first: " + " | ".join(stats.examples),
              file=sys.stderr)


def add_model_data_args(parser: argparse.ArgumentParser, data_help: str) -> None:
    """``--model DIR --data FILE...`` plus the format args, for commands that score."""
    parser.add_argument("--model", required=True, type=Path, help="model directory")
    parser.add_argument("--data", nargs="+", required=True, type=Path, help=data_help)
    add_format_args(parser)


@contextlib.contextmanager
def model_data(args: argparse.Namespace) -> Iterator[tuple]:
    """(trainer restored from ``--model``, batches of ``--data``, their ReadStats).

    A model trained with AutoFeature tables has them joined onto the raw rows first, so
    new rows get exactly the features training computed.
    """
    from terarec.autofeature.features import model_inputs
    from terarec.train.checkpoint import restore_trainer
    from terarec.train.passes import iter_file_batches

    trainer = restore_trainer(args.model)
    with model_inputs(args.model, trainer.schema, args.data,
                      lambda s: schema_for_data(s, args)) as (schema, data):
        stats = ReadStats()
        yield trainer, iter_file_batches(data, schema, trainer.config.batch_size,
                                         on_bad_row=args.on_bad_row, stats=stats), stats
