"""``terarec serve``: serve an exported model over HTTP and follow its new versions.

Routes: ``/v2/health/live``, ``/v2/health/ready``, ``/v2/models/NAME``,
``/v2/models/NAME/infer`` (Open Inference Protocol), ``/predict`` (raw feature values)
``/metrics`` (Prometheus), and ``/retrieve`` with ``--index``.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import re
from pathlib import Path

from terarec.cli.storage_args import add_storage_args, storage_options_from_args

_MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve an exported model over HTTP", description=__doc__)
    p.add_argument("uri", help="export URI written by `terarec export` or `train --export-to`")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8080, help="port (default 8080)")
    p.add_argument("--name", default="terarec", help="model name in /v2/models/NAME")
    p.add_argument("--poll-seconds", type=float, default=5.0,
                   help="how often to look for new versions (default 5)")
    p.add_argument("--cache-rows", type=int, default=1_000_000,
                   help="rows kept in the hot-key cache (default 1,000,000)")
    p.add_argument("--cache-dir", type=Path,
                   help="folder for the server's private, verified copies of the files it "
                        "serves (default: a temp folder, removed at exit)")
    p.add_argument("--max-candidates", type=int, default=1000,
                   help="most rows one request may score (default 1000)")
    p.add_argument("--max-body-bytes", type=int, default=4 << 20,
                   help="largest request body accepted (default 4 MiB)")
    p.add_argument("--wait-seconds", type=float, default=0.0,
                   help="at startup, wait this long for a first version (default: do not "
                        "wait; /v2/health/ready says 503 until one is loaded)")
    p.add_argument("--incomplete-seconds", type=float, default=60.0,
                   help="how long a version whose manifest is there but some files are "
                        "not (still being copied) is retried before it is refused "
                        "(default 60)")
    p.add_argument("--threads", type=int, help="torch intra-op threads (per worker)")
    p.add_argument("--workers", type=int, default=1,
                   help="server processes on the one port (default 1), each scoring on "
                        "its own core with its own hot-key cache; they share the "
                        "memory-mapped shards and swap versions together")
    p.add_argument("--max-batch-rows", type=int, default=4096,
                   help="most rows of concurrent requests scored in one pass (default "
                        "4096)")
    p.add_argument("--max-delay-ms", type=float, default=1.0,
                   help="longest a request waits for others to join its pass while more "
                        "keep arriving (default 1 ms; a request alone never waits)")
    p.add_argument("--index", type=Path,
                   help="item index folder written by `terarec index`: answer POST "
                        "/retrieve (docs/retrieval.md)")
    p.add_argument("--max-top-k", type=int, default=1000,
                   help="most items one /retrieve request may ask for (default 1000)")
    tier = p.add_argument_group("sparse tier (rows in a Redis Cluster, `terarec publish`)")
    tier.add_argument("--sparse-tier", metavar="redis://HOST:PORT",
                      help="read sparse rows from this cluster; only the dense part and the "
                           "hot rows are held locally")
    # The tier's knobs default to None (their defaults are in _TIER_DEFAULTS), so that one
    # given without --sparse-tier is refused rather than ignored.
    tier.add_argument("--namespace",
                      help="the model's key prefix in the cluster (default terarec)")
    tier.add_argument("--hot-rows", type=int,
                      help="most-shown rows held in local memory (default 1,000,000)")
    tier.add_argument("--hot-bytes", type=int,
                      help="cap on the hot rows' memory, in bytes (fp32 values + key)")
    tier.add_argument("--sparse-deadline-ms", type=float,
                      help="how long one request waits for cluster rows (default 100)")
    tier.add_argument("--hedge-ms", type=float,
                      help="fixed hedge delay (default: each node's observed p95, at least "
                           "--hedge-floor-ms)")
    tier.add_argument("--hedge-floor-ms", type=float,
                      help="smallest hedge delay (default 2)")
    tier.add_argument("--no-hedge", action="store_true", default=None,
                      help="never send a read to a replica before the master failed")
    tier.add_argument("--strict-sparse", action="store_true", default=None,
                      help="answer 503 when rows cannot be read in time (default: score "
                           "them as zero rows, as unknown keys)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    add_storage_args(p)
    p.set_defaults(func=run)


# Flags whose values have a floor (attribute, lowest allowed, whether the floor itself is
# allowed): a poll interval of 0 re-lists the export in a busy loop, a body limit of 0
# refuses every request. None (not given) is left to the option's own default.
_BOUNDS = (("port", 0, True), ("poll_seconds", 0, False), ("cache_rows", 0, True),
           ("max_candidates", 1, True), ("max_body_bytes", 1, True),
           ("wait_seconds", 0, True), ("incomplete_seconds", 0, True), ("threads", 1, True),
           ("workers", 1, True), ("max_batch_rows", 1, True), ("max_delay_ms", 0, True),
           ("max_top_k", 1, True), ("hot_rows", 0, True), ("hot_bytes", 0, True),
           ("sparse_deadline_ms", 0, True), ("hedge_ms", 0, True),
           ("hedge_floor_ms", 0, True))


_TIER_DEFAULTS: dict[str, object] = {
    "namespace": "terarec", "hot_rows": 1_000_000, "hot_bytes": None,
    "sparse_deadline_ms": 100.0, "hedge_ms": None, "hedge_floor_ms": 2.0,
    "no_hedge": False, "strict_sparse": False}


def check_serve_args(args: argparse.Namespace) -> None:
    """Every numeric flag in its range, or a UserError naming the flag and its value."""
    from terarec.cli.main import UserError

    for attr, low, inclusive in _BOUNDS:
        value = getattr(args, attr, None)
        if value is None or (math.isfinite(value)
                             and (value >= low if inclusive else value > low)):
            continue
        raise UserError(f"--{attr.replace('_', '-')} must be a finite number "
                        f"{'>=' if inclusive else '>'} {low}, got {value}")
    if args.port > 65535:
        raise UserError(f"--port must be <= 65535, got {args.port}")
    given = [a for a in _TIER_DEFAULTS if getattr(args, a) is not None]
    if given and not args.sparse_tier:
        flags = ", ".join("--" + a.replace("_", "-") for a in given)
        raise UserError(f"{flags}: only with --sparse-tier (rows are read from a cluster)")
    hedging = [f for f, a in (("--hedge-ms", "hedge_ms"), ("--hedge-floor-ms", "hedge_floor_ms"))
               if getattr(args, a) is not None]
    if args.no_hedge and hedging:
        raise UserError(f"{', '.join(hedging)}: no hedged reads with --no-hedge")
    for attr, default in _TIER_DEFAULTS.items():
        if getattr(args, attr) is None:
            setattr(args, attr, default)
    if not _MODEL_NAME.fullmatch(args.name):
        raise UserError(f"--name {args.name!r}: a model name is letters, digits, '.', '_' "
                        "and '-', starting with a letter or digit (it is a URL path segment)")
    if args.cache_dir is not None:
        if args.cache_dir.exists() and not args.cache_dir.is_dir():
            raise UserError(f"--cache-dir {args.cache_dir}: a file, not a folder")
        try:
            args.cache_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise UserError(f"--cache-dir {args.cache_dir}: {exc.strerror or exc}") from None
        if not os.access(args.cache_dir, os.W_OK | os.X_OK):
            raise UserError(f"--cache-dir {args.cache_dir}: not writable")


def check_serve_source(uri: str, storage_options: dict | None) -> None:
    """Refuse a URI that is one version folder or a model directory rather than an export
    root: the server would poll it for versions that never appear."""
    from terarec.cli.main import UserError
    from terarec.export.storage import Storage
    from terarec.export.target import local_options_error

    try:
        storage = Storage(uri, storage_options)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    if storage.is_local and storage_options:
        raise UserError(local_options_error(uri))
    try:
        version, model = (storage.exists("manifest.json"),
                          storage.exists("train_config.json") and storage.exists("checkpoints"))
    except Exception:  # a store unreachable now: the version poller retries it
        return
    if version:
        parent = uri.rstrip("/").rsplit("/", 1)[0] if "/" in uri.rstrip("/") else "its parent"
        raise UserError(f"{uri} is one exported version (it holds manifest.json): serve the "
                        f"export folder above it ({parent}), which names the newest version")
    if model:
        raise UserError(f"{uri} is a model directory, not an export: publish it with "
                        f"`terarec export --model {uri} --out URI` and serve URI")


def check_port(host: str, port: int) -> None:
    """Bind ``host:port`` once, before the model loads: taken or unresolvable, uvicorn
    said so only after loading it, and exited 3 (1 with --workers)."""
    import socket

    from terarec.cli.main import UserError

    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        family, kind, proto, _, address = infos[0]
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
            sock.bind(address)
    except OSError as exc:
        raise UserError(f"--host {host} --port {port}: cannot listen there: "
                        f"{exc.strerror or exc}") from None


def run(args: argparse.Namespace) -> int:
    check_serve_args(args)
    check_serve_source(str(args.uri), storage_options_from_args(args))
    check_port(args.host, args.port)
    import uvicorn

    from terarec.cli.main import UserError
    from terarec.io import ScratchDir
    from terarec.serving.workers import (
        SWAP_NOTICE,
        UVICORN_OPTIONS,
        ServeOptions,
        WorkerError,
        build_app,
        serve_workers,
    )

    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.index is not None:  # faiss is needed only for an index
        from terarec.retrieval.faiss_import import FaissMissingError, import_faiss

        try:
            import_faiss()
        except FaissMissingError as exc:
            raise UserError(f"--index {args.index}: {exc}") from None
    options = ServeOptions(
        uri=str(args.uri), storage_options=storage_options_from_args(args),
        model_name=args.name, poll_seconds=args.poll_seconds, cache_rows=args.cache_rows,
        cache_dir=None if args.cache_dir is None else str(args.cache_dir),
        max_candidates=args.max_candidates, max_body_bytes=args.max_body_bytes,
        wait_seconds=args.wait_seconds, incomplete_seconds=args.incomplete_seconds,
        threads=args.threads, max_batch_rows=args.max_batch_rows,
        max_delay_ms=args.max_delay_ms,
        index=None if args.index is None else str(args.index), max_top_k=args.max_top_k)
    serve = {"host": args.host, "port": args.port, "log_level": args.log_level,
             **UVICORN_OPTIONS}
    if args.sparse_tier:
        options.sparse_tier = {
            "url": args.sparse_tier, "ns": args.namespace, "hot_rows": args.hot_rows,
            "hot_bytes": args.hot_bytes, "strict": args.strict_sparse,
            "deadline_s": args.sparse_deadline_ms / 1000, "hedge": not args.no_hedge,
            "hedge_floor_s": args.hedge_floor_ms / 1000,
            "hedge_delay_s": None if args.hedge_ms is None else args.hedge_ms / 1000}
    if args.workers == 1:
        if not args.sparse_tier:
            uvicorn.run(build_app(options), **serve)
            return 0
        from redis.exceptions import RedisError

        from terarec.cli.main import UserError
        from terarec.sparsetier.tier import TierError

        try:
            app = build_app(options)
        except (TierError, RedisError) as exc:
            raise UserError(f"--sparse-tier {args.sparse_tier}: {exc}") from None
        uvicorn.run(app, **serve)
        return 0
    # Workers share one download folder (one copy of each shard in the page cache) and
    # a swap notice in it.
    import tempfile

    scratch = ScratchDir(tempfile.gettempdir(), "terarec-serve") if args.cache_dir is None \
        else None
    folder = scratch.path if scratch is not None else Path(args.cache_dir)
    options.cache_dir = str(folder)
    options.swap_notice = str(folder / SWAP_NOTICE)
    try:
        serve_workers(options, args.workers, args.host, args.port, args.log_level)
    except WorkerError as exc:
        logging.getLogger(__name__).error("%s", exc)
        return 1
    finally:
        if scratch is not None:
            scratch.close()
    return 0
