"""``terarec eval``: AUC and logloss of a trained model on a labelled file."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from terarec.cli.common import add_model_data_args, model_data, report_skipped
from terarec.io import atomic_write_text


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("eval", help="evaluate a model on labelled data", description=__doc__)
    add_model_data_args(p, "labelled file(s)")
    p.add_argument("--out", type=Path, help="metrics JSON (default MODEL/eval_metrics.json)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from terarec.api.model import Model, in_sample_warning

    with model_data(args) as (trainer, batches, stats):
        metrics: dict[str, Any] = {**trainer.evaluate(batches)}
    metrics["skipped_rows"] = stats.skipped
    in_sample = Model(args.model).trained_on(args.data)
    metrics["in_sample"] = in_sample
    if in_sample:
        print(f"warning: {in_sample_warning(args.model, in_sample)}", file=sys.stderr)
    for key in [k for k in metrics if k == "auc" or k.startswith("auc_")]:  # and each task's
        auc = metrics[key]
        if auc is not None and not math.isfinite(auc):  # NaN is not JSON
            metrics[key] = None
            label = "" if key == "auc" else f" {key[4:]!r}"
            print(f"AUC is undefined: every label{label} in --data is the same class; "
                  "written as null", file=sys.stderr)
    atomic_write_text(args.out or args.model / "eval_metrics.json",
                      json.dumps(metrics, indent=2, allow_nan=False))
    report_skipped(stats)
    print(json.dumps(metrics, allow_nan=False))
    return 0
