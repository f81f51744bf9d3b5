"""``terarec predict``: one click probability per input row."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from terarec.autofeature.features import model_inputs
from terarec.cli.common import add_format_args, report_skipped, schema_for_data
from terarec.data.readers import ReadStats
from terarec.io import atomic_open
from terarec.train.checkpoint import restore_trainer
from terarec.train.passes import iter_file_batches


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("predict", help="score rows with a model", description=__doc__)
    p.add_argument("--model", required=True, type=Path, help="model directory")
    p.add_argument("--data", nargs="+", required=True, type=Path, help="input file(s)")
    p.add_argument("--out", type=Path, help="output file, one score per line (default stdout)")
    add_format_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    trainer = restore_trainer(args.model)
    # A model trained with AutoFeature tables joins them onto the raw rows first.
    with model_inputs(args.model, trainer.schema, args.data,
                      lambda s: schema_for_data(s, args)) as (schema, data):
        return _run(args, trainer, schema, data)


def _run(args: argparse.Namespace, trainer, schema, data: list[Path]) -> int:
    stats = ReadStats()
    batches = iter_file_batches(data, schema, trainer.config.batch_size,
                                on_bad_row=args.on_bad_row, stats=stats)
    if args.out:
        with atomic_open(args.out, "w") as fh:
            for probs, _ in trainer.predict_stream(batches):
                np.savetxt(fh, probs, fmt="%.8f")
    else:
        for probs, _ in trainer.predict_stream(batches):
            np.savetxt(sys.stdout, probs, fmt="%.8f")
    report_skipped(stats)
    return 0
