"""``terarec export``: write a model directory's best (or newest) checkpoint as a full
version, one slice of it (``--slice``), or a delta on the export's newest version
(``--delta``)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from terarec.cli.storage_args import (
    add_storage_args,
    storage_options_from_args,
)


def add_parser(sub: argparse._SubParsersAction) -> None:
    from terarec.cli.common import add_checkpoint_arg
    from terarec.export.format import DEFAULT_SHARD_ROWS

    p = sub.add_parser("export", help="export a trained model for serving",
                       description=__doc__)
    p.add_argument("--model", required=True, type=Path, help="model directory")
    p.add_argument("--out", required=True,
                   help="export URI: a local folder or an fsspec URL such as s3://bucket/x")
    p.add_argument("--shard-rows", type=int, default=DEFAULT_SHARD_ROWS,
                   help=f"sparse rows per shard file (default {DEFAULT_SHARD_ROWS})")
    p.add_argument("--bits", type=int, choices=[32, 16, 8, 4, 2, 1], default=32,
                   help="bits per sparse value: 32/16 float, 8/4/2/1 integer codes with a "
                   "row-wise scale and bias (default 32); see docs/compression.md")
    p.add_argument("--codebook", action="store_true",
                   help="with --bits 8/4/2/1: shared k-means levels times a row scale")
    p.add_argument("--slice", metavar="NAME",
                   help="export only a part of the model: user_tower / item_tower (dssm), "
                   "wide / deep (widedeep) or a comma-separated field list; again to the "
                   "same --out writes a delta (docs/retrieval.md)")
    p.add_argument("--keys-from", type=Path, action="append", default=[], metavar="FILE",
                   help="with --slice: a data file (training log, item catalog) holding the "
                   "slice's fields, whose keys the slice carries (repeatable)")
    p.add_argument("--delta", action="store_true",
                   help="a delta on --out's newest version (same model, fp32): the rows "
                   "new or changed since it, the keys gone, the dense weights; servers "
                   "apply it live (docs/serving.md)")
    add_checkpoint_arg(p)
    add_storage_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from terarec.api.model import Model

    written = Model(args.model, args.checkpoint).export(
        args.out, bits=args.bits, codebook=args.codebook, shard_rows=args.shard_rows,
        slice=args.slice, keys_from=args.keys_from,
        storage_options=storage_options_from_args(args), delta=args.delta)
    print(json.dumps(written))
    return 0
