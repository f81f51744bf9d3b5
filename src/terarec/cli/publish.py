"""``terarec publish``: copy an exported version into a Redis Cluster sparse tier, where
``terarec serve --sparse-tier`` replicas read it.

The cold part (a full version's rows) and the hot part (the deltas since) can be
published on their own cadences; the version is announced once its whole chain is in,
then versions no live server uses are removed.
"""

from __future__ import annotations

import argparse
import json
import logging
import math

from terarec.cli.storage_args import add_storage_args, storage_options_from_args


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("publish", help="publish an exported version to a Redis Cluster",
                       description=__doc__)
    p.add_argument("version_uri",
                   help="EXPORT_URI/vNNNNNN, or an export URI (its newest version)")
    p.add_argument("--to", required=True, metavar="redis://HOST:PORT",
                   help="any node(s) of the cluster: redis://HOST:PORT[,HOST:PORT...]")
    p.add_argument("--namespace", default="terarec",
                   help="key prefix of this model in the cluster (default terarec)")
    p.add_argument("--part", choices=["hot", "cold", "all"], default="all",
                   help="cold: the full version's rows; hot: the deltas on it; all: both "
                        "(default)")
    p.add_argument("--gc-grace-seconds", type=float, default=30.0,
                   help="keep a superseded version this long even if no server registered "
                        "it (default 30)")
    p.add_argument("--json", action="store_true",
                   help="print the result as one JSON object instead of one line of text")
    p.add_argument("--log-level", default="warning",
                   choices=["debug", "info", "warning", "error"])
    add_storage_args(p)
    p.set_defaults(func=run)


def check_publish_args(args: argparse.Namespace) -> None:
    """The grace period in range and the source an export with a version, before any
    connection to the cluster (whose errors would otherwise hide these)."""
    from terarec.cli.main import UserError
    from terarec.export.format import MANIFEST, latest_version
    from terarec.export.storage import Storage, StorageError
    from terarec.export.target import local_options_error
    from terarec.sparsetier.publish import split_version_uri
    from terarec.sparsetier.tier import parse_url

    try:
        parse_url(args.to)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    grace = args.gc_grace_seconds
    if not (math.isfinite(grace) and grace >= 0):
        raise UserError(f"--gc-grace-seconds must be a finite number >= 0, got {grace}")
    export, name = split_version_uri(args.version_uri)
    try:
        storage = Storage(export, storage_options_from_args(args))
        if storage.is_local and args.storage_options:
            raise UserError(local_options_error(export))
        if name is not None and not storage.exists(f"{name}/{MANIFEST}"):
            raise UserError(f"{args.version_uri}: no such version (no {MANIFEST} in it)")
        if name is None and latest_version(storage) is None:
            raise UserError(f"{export}: no version to publish (not an export written by "
                            "`terarec export` or `train --export-to`)")
    except (ValueError, StorageError) as exc:
        raise UserError(str(exc)) from None


def run(args: argparse.Namespace) -> int:
    from terarec.cli.main import UserError
    from terarec.sparsetier.publish import Publisher, PublishError
    from terarec.sparsetier.tier import TierError

    check_publish_args(args)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        publisher = Publisher(args.to, args.namespace)
    except TierError as exc:
        raise UserError(str(exc)) from None
    try:
        result = publisher.publish(args.version_uri, part=args.part,
                                   storage_options=storage_options_from_args(args),
                                   gc_grace_s=args.gc_grace_seconds)
    except (PublishError, TierError) as exc:
        raise UserError(str(exc)) from None
    finally:
        publisher.close()
    if args.json:
        print(json.dumps({**result.to_dict(), "to": args.to, "namespace": args.namespace}))
    else:
        print(result.summary(args.to, args.namespace))
    return 0
