"""``terarec predict``: one click probability per input row."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from terarec.cli.common import add_model_data_args, model_data
from terarec.finite import check_model_scores
from terarec.io import atomic_open


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("predict", help="score rows with a model", description=__doc__)
    add_model_data_args(p, "input file(s)")
    p.add_argument("--out", type=Path, help="output file, one score per line (default stdout)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.on_bad_row == "skip":
        raise ValueError("--on-bad-row skip: predict writes one score per input row, in "
                         "order, and a skipped row would shift every score after it; fix "
                         "the rows the error names (eval takes --on-bad-row skip)")
    with model_data(args, with_label=False) as (trainer, batches, stats):
        if args.out:
            with atomic_open(args.out, "w") as fh:
                for probs, _ in trainer.predict_stream(batches):
                    check_model_scores(probs, f"{args.model}")
                    np.savetxt(fh, probs, fmt="%.8f")
        else:
            for probs, _ in trainer.predict_stream(batches):
                check_model_scores(probs, f"{args.model}")
                np.savetxt(sys.stdout, probs, fmt="%.8f")
    return 0
