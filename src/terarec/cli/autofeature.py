"""``terarec autofeature``: generate aggregate features with SQL, keep those that help.

DuckDB computes count, cross-count and group-by candidates over the training files only
(out of core, within --memory-limit); a small LR/FM model measures each candidate's
validation AUC gain on row samples; greedy forward selection keeps at most --budget of
them. Writes the feature config (--out) that ``terarec train --features`` reads, the
selected tables beside it, and every candidate's gain as CSV, JSON and a bar chart.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import math
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:  # the rest is imported where used: --help needs no DuckDB or torch
    from terarec.autofeature.selection import SelectionResult
    from terarec.types import FeatureSchema

T = TypeVar("T")
GAIN_FIELDS = ("name", "kind", "auc", "gain", "selected", "round", "gain_when_chosen")


def add_parser(sub: argparse._SubParsersAction) -> None:
    from terarec.autofeature.candidates import ALL_AGGREGATES, ALL_KINDS
    from terarec.autofeature.selection import SelectionConfig
    from terarec.cli.common import add_format_args

    p = sub.add_parser("autofeature", help="generate and select SQL aggregate features",
                       description=__doc__)
    p.add_argument("--train", nargs="+", required=True, help="training file(s) or globs")
    p.add_argument("--valid", nargs="+", required=True, help="validation file(s) or globs")
    p.add_argument("--out", type=Path, required=True,
                   help="feature config to write, e.g. features.json")
    add_format_args(p)
    g = p.add_argument_group("candidates")
    g.add_argument("--candidates", nargs="+", metavar="NAME",
                   help="explicit candidates, e.g. 'count(C3)' 'cross_count(C5,C7)' "
                   "'avg(I1)_by(C3)' (default: enumerate them)")
    g.add_argument("--kinds", default=",".join(ALL_KINDS),
                   help=f"candidate kinds to enumerate (default {','.join(ALL_KINDS)})")
    g.add_argument("--aggs", default=",".join(ALL_AGGREGATES),
                   help=f"group-by aggregates (default {','.join(ALL_AGGREGATES)})")
    g.add_argument("--max-cross-pairs", type=int, default=16,
                   help="cross counts over the N lowest-cardinality pairs (default 16)")
    g.add_argument("--max-groupby-keys", type=int, default=4,
                   help="group-by keys: the N lowest-cardinality fields (default 4)")
    g = p.add_argument_group("selection")
    defaults = SelectionConfig()
    g.add_argument("--budget", type=int, default=defaults.budget,
                   help=f"most features kept (default {defaults.budget})")
    g.add_argument("--min-gain", type=float, default=defaults.min_gain,
                   help=f"stop when the best AUC gain left is below this "
                   f"(default {defaults.min_gain})")
    g.add_argument("--shortlist", type=int, default=defaults.shortlist,
                   help="candidates (best single gains) tried after the first round "
                   f"(default {defaults.shortlist})")
    g.add_argument("--selection-model", choices=["lr", "fm"], default=defaults.model)
    g.add_argument("--sample-rows", type=int, default=defaults.train_rows,
                   help=f"training rows the selection model fits on "
                   f"(default {defaults.train_rows})")
    g.add_argument("--valid-rows", type=int, default=defaults.valid_rows,
                   help=f"validation rows its AUC is measured on (default {defaults.valid_rows})")
    g.add_argument("--epochs", type=int, default=defaults.epochs)
    g.add_argument("--seed", type=int, default=defaults.seed)
    g = p.add_argument_group("DuckDB")
    g.add_argument("--memory-limit", default=None,
                   help="DuckDB memory limit, e.g. 1GB (default: 80%% of RAM); "
                   "larger aggregations spill to --temp-dir")
    g.add_argument("--temp-dir", type=Path, default=None, help="DuckDB spill directory")
    g.add_argument("--threads", type=int, default=None, help="DuckDB threads (default all)")
    p.add_argument("--no-progress", action="store_true",
                   help="no DuckDB progress bar (drawn only on a terminal anyway)")
    p.set_defaults(func=run)


def _split(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def _choices(text: str, allowed: Sequence[T], flag: str) -> list[T]:
    """The comma-separated names in ``text``, each one of ``allowed``."""
    by_name = {str(a): a for a in allowed}
    names = _split(text)
    unknown = [n for n in names if n not in by_name]
    if unknown:
        raise ValueError(f"{flag}: unknown {unknown}; known: {', '.join(by_name)}")
    return [by_name[n] for n in names]


# Integer flags and the least value each takes (--seed: below 2**32, as train's).
_FLOORS = (("budget", 0), ("shortlist", 1), ("sample_rows", 1), ("valid_rows", 1),
           ("epochs", 1), ("seed", 0), ("max_cross_pairs", 0), ("max_groupby_keys", 0),
           ("threads", 1))


def check_args(args: argparse.Namespace) -> None:
    """The flags, checked before any SQL runs, each error naming its flag: out of range
    they failed later as a DuckDB parser error or traceback (--seed -1, --threads 0,
    --memory-limit abc), as a folder's IsADirectoryError once every candidate was
    measured (--out), or not at all (--epochs 0 measured untrained models, --min-gain
    nan never stopped)."""
    for attr, floor in _FLOORS:
        value = getattr(args, attr)
        if value is not None and value < floor:
            raise ValueError(f"--{attr.replace('_', '-')} must be >= {floor}, got {value}")
    if args.seed >= 1 << 32:
        raise ValueError(f"--seed must be < 2**32, got {args.seed}")
    if not math.isfinite(args.min_gain):
        raise ValueError(f"--min-gain must be a finite number, got {args.min_gain}")
    if args.on_bad_row == "skip":
        raise ValueError("--on-bad-row skip: autofeature reads its inputs with DuckDB, "
                         "which stops at the first bad row; clean or leave out that file")
    if args.out.is_dir():
        raise ValueError(f"--out {args.out} is a folder; name the feature config file, "
                         "e.g. features.json")


def check_rows(paths: Sequence[str], schema: FeatureSchema) -> None:
    """Every row of ``paths`` read as ``train`` reads it, before any SQL: DuckDB takes a
    label of 2, ``nan`` and ``1e40`` as values (a NaN in a numeric column then reached
    the sample as a missing value, and the others failed naming a temporary sample
    file). Files with no rows are left to the training range's own check."""
    from terarec.autofeature.source import first_bad_row
    from terarec.data.readers import no_data_rows

    for path in paths:
        if not no_data_rows(Path(path), schema) \
                and (bad := first_bad_row([path], schema)) is not None:
            raise bad


def run(args: argparse.Namespace) -> int:
    import duckdb

    from terarec.api.training import check_disjoint
    from terarec.autofeature import (
        ALL_AGGREGATES,
        ALL_KINDS,
        AutoFeatureEngine,
        Candidate,
        compute_tables,
        enumerate_candidates,
        validate_candidates,
    )
    from terarec.autofeature.features import FeatureConfig
    from terarec.autofeature.selection import (
        SelectionConfig,
        parquet_view,
        sample_rows,
        select_features,
    )
    from terarec.autofeature.source import expand_paths
    from terarec.cli.common import schema_from_args

    start = time.perf_counter()
    check_args(args)
    train, valid = expand_paths(args.train), expand_paths(args.valid, "--valid")
    check_disjoint(train, valid)
    schema = schema_from_args(args)
    check_rows([*train, *valid], schema)
    selection = SelectionConfig(
        budget=args.budget, min_gain=args.min_gain, shortlist=args.shortlist,
        model=args.selection_model, train_rows=args.sample_rows, valid_rows=args.valid_rows,
        epochs=args.epochs, seed=args.seed)
    engine = AutoFeatureEngine(memory_limit=args.memory_limit, temp_dir=args.temp_dir,
                               threads=args.threads, progress=not args.no_progress)
    with engine, tempfile.TemporaryDirectory(prefix="autofeature-",
                                             dir=engine.scratch_dir()) as tmp:
        try:  # DuckDB reads --memory-limit when the database opens
            engine.cursor().close()
        except duckdb.Error as exc:
            raise ValueError(f"--memory-limit {args.memory_limit}: {exc}") from None
        work = Path(tmp)
        if args.candidates:
            candidates = validate_candidates([Candidate.from_name(n) for n in args.candidates],
                                             schema)
        else:
            candidates = enumerate_candidates(
                schema, kinds=_choices(args.kinds, ALL_KINDS, "--kinds"),
                aggs=_choices(args.aggs, ALL_AGGREGATES, "--aggs"),
                cardinalities=engine.cardinalities(args.train, schema),
                max_cross_pairs=args.max_cross_pairs, max_groupby_keys=args.max_groupby_keys)
        print(f"computing {len(candidates)} candidates over {len(args.train)} training "
              f"file(s) with DuckDB (memory limit {args.memory_limit or 'default'})")
        tables = compute_tables(candidates, args.train, schema, work / "tables", engine=engine)
        train_sample = sample_rows(args.train, schema, selection.train_rows,
                                   work / "train-sample.parquet", seed=args.seed, engine=engine)
        valid_sample = sample_rows(args.valid, schema, selection.valid_rows,
                                   work / "valid-sample.parquet", seed=args.seed, engine=engine)
        print(f"measuring validation AUC gains with {selection.model.upper()} "
              f"(budget {selection.budget}, min gain {selection.min_gain})")
        result = select_features(tables, parquet_view(schema), train_sample, valid_sample,
                                 selection, engine=engine, log=print)
        summary = {"candidates": len(candidates), **result.to_dict(),
                   "train_paths": list(tables.train_paths), "train_rows": tables.train_rows,
                   "config": vars(selection), "seconds": time.perf_counter() - start}
        config = FeatureConfig(schema, tables.select(result.selected), {
            k: summary[k] for k in ("candidates", "auc_raw", "auc_with_features", "gain",
                                    "evaluations", "config")})
        config = config.save(args.out)
    outputs = write_gains(args.out, result, summary)
    print(gains_table(result))
    print(json.dumps({k: summary[k] for k in ("candidates", "selected", "auc_raw",
                                              "auc_with_features", "gain")}))
    print(f"feature config: {args.out} (tables in {config.tables.directory})")
    print("gains: " + ", ".join(str(p) for p in outputs))
    return 0


def gains_table(result: SelectionResult) -> str:
    """Every candidate's gain, best first, as aligned text."""
    rows = sorted(result.gains, key=lambda g: -g.gain)
    width = max(len(g.name) for g in rows)
    lines = [f"{'candidate':<{width}}  {'AUC':>7}  {'gain':>8}  selected"]
    for g in rows:
        chosen = f"round {g.round} ({g.gain_when_chosen:+.4f})" if g.selected else ""
        lines.append(f"{g.name:<{width}}  {g.auc:7.4f}  {g.gain:+8.4f}  {chosen}")
    return "\n".join(lines)


def write_gains(out: Path, result: SelectionResult, summary: dict) -> list[Path]:
    """``<stem>.gains.csv``, ``.json`` and ``.png`` beside the feature config."""
    from terarec.io import atomic_write_text

    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=GAIN_FIELDS, lineterminator="\n")
    writer.writeheader()
    for g in sorted(result.gains, key=lambda g: -g.gain):
        writer.writerow({k: getattr(g, k) for k in GAIN_FIELDS})
    paths = [out.with_name(f"{out.stem}.gains.{ext}") for ext in ("csv", "json", "png")]
    atomic_write_text(paths[0], buf.getvalue())
    atomic_write_text(paths[1], json.dumps(summary, indent=2))
    top = sorted(result.gains, key=lambda g: -g.gain)[:40]
    from terarec.report import plot_bars  # matplotlib: only the commands that plot load it

    plot_bars(paths[2], [g.name + (" *" if g.selected else "") for g in top],
              [g.gain for g in top], title="Validation AUC gain per candidate (* selected)",
              xlabel="AUC gain over the raw features")
    return paths
