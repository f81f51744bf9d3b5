"""``terarec synth``: write synthetic Criteo-format click logs with a known ground truth.

The train and validation files share one ground-truth model (``--seed``) and differ in
the rows drawn, so a model trained on one can be scored on the other against the best
AUC any model could reach. ``--truth`` picks the shape of that model: the default low-rank
FM, a random MLP of the field embeddings, high-order crosses, a nearly linear one, or a
mix (docs/models.md).
"""

from __future__ import annotations

import argparse
import time
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING

from terarec.data.truths import TRUTHS
from terarec.io import file_above

if TYPE_CHECKING:  # imported where used: --help needs no numba or pyarrow
    from terarec.data.synth import SynthInfo


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("synth", help="write synthetic Criteo-format click logs",
                       description=__doc__)
    p.add_argument("--rows", type=int, required=True,
                   help="training rows (with --hourly: rows per file)")
    p.add_argument("--out", type=Path, required=True,
                   help="training file (TSV); with --hourly a folder")
    p.add_argument("--hourly", type=int, metavar="N",
                   help="write N time-partitioned files (2026-12-01T00-00.tsv, ...) into "
                   "--out whose ground truth drifts by --drift per hour")
    # Mode-specific knobs default to None (their defaults are in _DEFAULTS), so that one
    # given in a mode it does not apply to is refused rather than ignored.
    p.add_argument("--drift", type=float,
                   help="--hourly: 1 - the correlation of consecutive hours' planted "
                   "logits, in [0, 1] (default 0: no drift)")
    p.add_argument("--start",
                   help="--hourly: the first file's hour (ISO date and time)")
    p.add_argument("--valid-rows", type=int, default=None,
                   help="validation rows, written to --valid-out (default none)")
    p.add_argument("--valid-out", type=Path, help="validation file (TSV)")
    p.add_argument("--seed", type=int, default=0,
                   help="ground-truth model seed; rows use sample seeds 2*seed and 2*seed+1")
    p.add_argument("--truth", choices=TRUTHS,
                   help="the planted truth's shape: fm (low-rank pairs, the default), deep "
                   "(a random MLP), cross (3- and 4-field crosses), linear, mixed")
    p.add_argument("--exponent", type=float,
                   help="Zipf exponent of categorical values (default 1.1)")
    p.add_argument("--vocab-scale", type=float,
                   help="multiply every field's vocabulary size (default 1.0)")
    p.add_argument("--conversion", action="store_true",
                   help="also plant a conversion label (only after a click, sharing the "
                   "click truth's factors plus its own): a CSV with a header, "
                   "click,conversion,I1..I13,C1..C26, for multi-task models "
                   "(docs/multitask.md)")
    g = p.add_argument_group("retrieval (--retrieval): a click log with planted user-item "
                             "affinity, and its item catalog OUT.items")
    g.add_argument("--retrieval", action="store_true",
                   help="write label/user/item/topic rows whose true top items per user are "
                   "known (docs/retrieval.md)")
    g.add_argument("--users", type=int,
                   help="users (default 100,000; with --history 1,000)")
    g.add_argument("--items", type=int,
                   help="items (default 1,000,000; with --history 1,000)")
    g.add_argument("--negatives", type=int,
                   help="uniformly drawn unclicked rows per click (default 1)")
    g = p.add_argument_group("behaviour sequences (--history): label,user,item,hist rows "
                             "whose click depends on the user's recent items")
    g.add_argument("--history", action="store_true",
                   help="write CSV rows with a planted history effect and its ceiling AUC "
                   "(docs/sequences.md)")
    g.add_argument("--max-history", type=int,
                   help="--history: longest history in items (default 20)")
    p.set_defaults(func=run)


# Each mode-specific flag: its default, the modes it applies to, and those in words.
_DEFAULTS: dict[str, tuple[object, tuple[str, ...], str]] = {
    "drift": (0.0, ("hourly",), "with --hourly"),
    "start": ("2026-12-01T00:00", ("hourly",), "with --hourly"),
    "truth": ("fm", ("click", "hourly"), "to click logs, not with --retrieval"),
    "exponent": (1.1, ("click", "hourly"), "to click logs, not with --retrieval"),
    "vocab_scale": (1.0, ("click", "hourly"), "to click logs, not with --retrieval"),
    "users": (None, ("retrieval", "history"), "with --retrieval"),
    "items": (None, ("retrieval", "history"), "with --retrieval"),
    "max_history": (20, ("history",), "with --history"),
    "negatives": (1, ("retrieval",), "with --retrieval")}


def _mode_defaults(args: argparse.Namespace) -> None:
    """Refuse a flag of another mode (naming it and where it applies); fill in the rest."""
    if args.retrieval and args.history:
        raise ValueError("--retrieval and --history write different data; give one")
    mode = ("retrieval" if args.retrieval else "history" if args.history
            else "hourly" if args.hourly is not None else "click")
    for attr, (default, modes, where) in _DEFAULTS.items():
        if getattr(args, attr) is None:
            setattr(args, attr, default)
        elif mode not in modes:
            raise ValueError(f"--{attr.replace('_', '-')} applies only {where}")
    for flag, value in (("--exponent", args.exponent), ("--vocab-scale", args.vocab_scale)):
        if not value > 0:
            raise ValueError(f"{flag} must be > 0, got {value}")


def run(args: argparse.Namespace) -> int:
    _mode_defaults(args)
    if args.out.is_dir() and args.hourly is None:
        raise ValueError(f"--out {args.out} is a folder; synth writes one file there "
                         "(a folder only with --hourly)")
    if (blocked := file_above(args.out)) is not None:
        raise ValueError(f"--out {args.out}: {blocked} is a file, not a folder")
    try:
        return _run(args)
    except OSError as exc:  # an --out that cannot be written
        raise ValueError(f"--out {args.out}: {exc.strerror or exc}") from None


def _run(args: argparse.Namespace) -> int:
    from terarec.data.synth import generate

    if args.rows <= 0:
        raise ValueError(f"--rows must be positive, got {args.rows}")
    if args.valid_rows is not None and args.valid_rows < 1:
        raise ValueError(f"--valid-rows must be positive, got {args.valid_rows}")
    if (args.valid_rows is not None) != (args.valid_out is not None):
        given, missing = (("--valid-rows", "--valid-out") if args.valid_rows is not None
                          else ("--valid-out", "--valid-rows"))
        raise ValueError(f"{given} needs {missing}: --valid-rows N --valid-out FILE writes "
                         "N validation rows")
    if args.seed < 0:
        raise ValueError(f"--seed must not be negative, got {args.seed}")
    if args.conversion and (args.retrieval or args.hourly is not None):
        raise ValueError("--conversion plants a second label in click logs; it does not go "
                         "with --retrieval or --hourly")
    if args.retrieval:
        return _retrieval(args)
    if args.history:
        return _history(args)
    if args.hourly is not None:
        return _hourly(args)
    if args.conversion:
        return _conversion(args)
    common = dict(model_seed=args.seed, exponent=args.exponent, vocab_scale=args.vocab_scale,
                  truth=args.truth)
    jobs = [("train", args.out, args.rows, 2 * args.seed)]
    if args.valid_rows:
        jobs.append(("valid", args.valid_out, args.valid_rows, 2 * args.seed + 1))
    for name, path, rows, sample_seed in jobs:
        start = time.perf_counter()
        info = generate(path, rows, sample_seed=sample_seed, **common)
        _print(name, info, time.perf_counter() - start)
    return 0


def _conversion(args: argparse.Namespace) -> int:
    from terarec.data.synth_conversion import generate_conversion

    jobs = [("train", args.out, args.rows, 2 * args.seed)]
    if args.valid_rows:
        jobs.append(("valid", args.valid_out, args.valid_rows, 2 * args.seed + 1))
    for name, path, rows, sample_seed in jobs:
        start = time.perf_counter()
        info = generate_conversion(path, rows, model_seed=args.seed, sample_seed=sample_seed,
                                   exponent=args.exponent, vocab_scale=args.vocab_scale,
                                   truth=args.truth)
        print(f"{name}: {info.rows:,} rows -> {info.path} "
              f"({time.perf_counter() - start:.1f} s, truth {info.truth})\n"
              f"  click: CTR {100 * info.ctr:.2f} %, best reachable AUC "
              f"{info.ceiling_auc:.4f} (log loss {info.ceiling_logloss:.4f})\n"
              f"  conversion: {100 * info.conversion_rate:.2f} % of rows "
              f"({100 * info.cvr:.2f} % of clicks), best reachable AUC "
              f"{info.conversion_ceiling_auc:.4f} "
              f"(log loss {info.conversion_ceiling_logloss:.4f})")
    return 0


def _hourly(args: argparse.Namespace) -> int:
    from terarec.data.synth import generate_hourly

    if args.hourly <= 0:
        raise ValueError(f"--hourly must be positive, got {args.hourly}")
    if not 0.0 <= args.drift <= 1.0:
        raise ValueError(f"--drift must be in [0, 1], got {args.drift}")
    if args.valid_rows:
        raise ValueError("--valid-rows does not go with --hourly: score each hour's file "
                         "with the model of the hours before it (train --follow)")
    if args.out.exists() and not args.out.is_dir():
        raise ValueError(f"--out {args.out} is a file; --hourly writes files into a folder")
    try:
        datetime.fromisoformat(args.start)
    except ValueError:
        raise ValueError(f"--start {args.start!r} is not an ISO date and time") from None
    start = time.perf_counter()
    infos = generate_hourly(args.out, args.hourly, args.rows, drift=args.drift,
                            model_seed=args.seed, exponent=args.exponent,
                            vocab_scale=args.vocab_scale, start=args.start, truth=args.truth)
    seconds = (time.perf_counter() - start) / len(infos)
    for info in infos:
        _print(f"hour {info.hour}", info, seconds)
    return 0


def _print(name: str, info: SynthInfo, seconds: float) -> None:
    print(f"{name}: {info.rows:,} rows -> {info.path} ({seconds:.1f} s, truth {info.truth})\n"
          f"  CTR {100 * info.ctr:.2f} %, best reachable AUC {info.ceiling_auc:.4f} "
          f"(log loss {info.ceiling_logloss:.4f})")


def _history(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from terarec.data.synth_history import HistorySettings, generate_history

    if args.hourly is not None:
        raise ValueError("--history does not go with --hourly")
    settings = HistorySettings(max_history=args.max_history)
    if args.users is not None:
        settings = replace(settings, users=args.users)
    if args.items is not None:
        settings = settings.with_items(args.items)
    settings.check()
    jobs = [("train", args.out, args.rows, 0)]
    if args.valid_rows:
        jobs.append(("valid", args.valid_out, args.valid_rows, 1))
    for name, path, rows, sample_seed in jobs:
        start = time.perf_counter()
        info = generate_history(path, rows, seed=args.seed, sample_seed=sample_seed,
                                settings=settings)
        print(f"{name}: {info.rows:,} rows -> {info.path} "
              f"({time.perf_counter() - start:.1f} s, history up to {info.max_history})\n"
              f"  CTR {100 * info.ctr:.2f} %, best reachable AUC {info.ceiling_auc:.4f}")
    return 0


def _retrieval(args: argparse.Namespace) -> int:
    from terarec.data.synth_retrieval import write_retrieval

    if args.hourly is not None or args.valid_rows:
        raise ValueError("--retrieval does not go with --hourly or --valid-rows")
    start = time.perf_counter()
    info = write_retrieval(args.out, args.rows, users=args.users or 100_000,
                           items=args.items or 1_000_000,
                           negatives=args.negatives, seed=args.seed)
    print(f"retrieval: {info.rows:,} rows ({info.clicks:,} clicks) -> {info.path} "
          f"({time.perf_counter() - start:.1f} s)\n  {info.users:,} users, {info.items:,} "
          f"items in {info.topics:,} topics; catalog {info.catalog}")
    return 0
