"""``terarec index``: embed an item catalog with an export's item tower and build (or bring
up to date) a faiss index for ``terarec serve --index``."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from terarec.cli.storage_args import add_storage_args, storage_options_from_args


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("index", help="build an item-vector index for /retrieve",
                       description=__doc__)
    p.add_argument("uri", help="export URI of a dssm model or its item_tower slice")
    p.add_argument("--items", required=True, type=Path,
                   help="item catalog: CSV/TSV with a header, or Parquet, holding the item "
                   "fields' raw values, one item a row")
    p.add_argument("--out", required=True, type=Path, help="index folder")
    p.add_argument("--id-field", help="the catalog column /retrieve returns as the item id "
                   "(default: the first item field)")
    p.add_argument("--kind", choices=["hnsw", "ivfpq"], default="ivfpq",  # IndexOptions.kind
                   help="ivfpq (clusters and compressed codes, default) or hnsw (graph)")
    p.add_argument("--rebuild", action="store_true",
                   help="build afresh even when the index can follow the export's deltas")
    p.add_argument("--batch-rows", type=int, default=8192, help="items embedded at a time")
    # The kind's own knobs default to None (IndexOptions' defaults), so that a knob of the
    # other kind is refused rather than ignored.
    p.add_argument("--hnsw-m", type=int, help="hnsw: links per node (32)")
    p.add_argument("--ef-construction", type=int, help="hnsw: build beam (80)")
    p.add_argument("--ef-search", type=int, help="hnsw: search beam (256)")
    p.add_argument("--nlist", type=int, help="ivfpq: clusters (default about sqrt(items))")
    p.add_argument("--pq-m", type=int,
                   help="ivfpq: bytes per vector (default one a dimension, or the "
                   "largest divisor of the vector size up to 64)")
    p.add_argument("--nprobe", type=int, help="ivfpq: clusters searched (8)")
    p.add_argument("--refine", type=int,
                   help="ivfpq: candidates re-scored with the exact vectors, per item asked "
                   "for (default 8)")
    add_storage_args(p)
    p.set_defaults(func=run)


_KIND_KNOBS = {"hnsw": ("hnsw_m", "ef_construction", "ef_search"),
               "ivfpq": ("nlist", "pq_m", "nprobe", "refine")}


def run(args: argparse.Namespace) -> int:
    from terarec.cli.main import UserError
    from terarec.retrieval.faiss_import import FaissMissingError, import_faiss

    try:
        import_faiss()
    except FaissMissingError as exc:
        raise UserError(str(exc)) from None
    from terarec.retrieval.index import IndexOptions, build_index, update_index

    if args.out.exists() and not args.out.is_dir():
        raise ValueError(f"--out {args.out} is a file, not an index folder")
    if args.batch_rows < 1:
        raise ValueError(f"--batch-rows must be >= 1, got {args.batch_rows}")
    knobs: dict[str, int] = {}
    for kind, names in _KIND_KNOBS.items():
        for name in names:
            value, flag = getattr(args, name), "--" + name.replace("_", "-")
            if value is None:
                continue
            if kind != args.kind:
                raise ValueError(f"{flag} applies only with --kind {kind} (got --kind "
                                 f"{args.kind})")
            if value < 1:
                raise ValueError(f"{flag} must be >= 1, got {value}")
            knobs[name] = value
    options = IndexOptions(kind=args.kind, **knobs)
    build = build_index if args.rebuild else update_index
    result = build(args.uri, args.items, args.out, options, id_field=args.id_field,
                   storage_options=storage_options_from_args(args), rows=args.batch_rows)
    print(json.dumps(result))
    return 0
