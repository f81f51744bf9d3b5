"""``terarec eval``: AUC and logloss of a trained model on a labelled file."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from terarec.autofeature.features import model_inputs
from terarec.cli.common import add_format_args, report_skipped, schema_for_data
from terarec.data.readers import ReadStats
from terarec.io import atomic_write_text
from terarec.train.checkpoint import restore_trainer
from terarec.train.passes import iter_file_batches


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("eval", help="evaluate a model on labelled data", description=__doc__)
    p.add_argument("--model", required=True, type=Path, help="model directory")
    p.add_argument("--data", nargs="+", required=True, type=Path, help="labelled file(s)")
    p.add_argument("--out", type=Path, help="metrics JSON (default MODEL/eval_metrics.json)")
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
    metrics = trainer.evaluate(batches)
    metrics["skipped_rows"] = stats.skipped
    out = args.out or args.model / "eval_metrics.json"
    atomic_write_text(out, json.dumps(metrics, indent=2))
    report_skipped(stats)
    print(json.dumps(metrics))
    return 0
