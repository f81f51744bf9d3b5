"""``terarec serve``: serve an exported model over HTTP and follow its new versions.

Routes: ``/v2/health/live``, ``/v2/health/ready``, ``/v2/models/NAME``,
``/v2/models/NAME/infer`` (Open Inference Protocol), ``/predict`` (raw feature values)
and ``/metrics`` (Prometheus).
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from terarec.cli.storage_args import add_storage_args, storage_options_from_args


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
    tier = p.add_argument_group("sparse tier (rows in a Redis Cluster, `terarec publish`)")
    tier.add_argument("--sparse-tier", metavar="redis://HOST:PORT",
                      help="read sparse rows from this cluster; only the dense part and the "
                           "hot rows are held locally")
    tier.add_argument("--namespace", default="terarec",
                      help="the model's key prefix in the cluster (default terarec)")
    tier.add_argument("--hot-rows", type=int, default=1_000_000,
                      help="most-shown rows held in local memory (default 1,000,000)")
    tier.add_argument("--hot-bytes", type=int,
                      help="cap on the hot rows' memory, in bytes (fp32 values + key)")
    tier.add_argument("--sparse-deadline-ms", type=float, default=100.0,
                      help="how long one request waits for cluster rows (default 100)")
    tier.add_argument("--hedge-ms", type=float,
                      help="fixed hedge delay (default: each node's observed p95, at least "
                           "--hedge-floor-ms)")
    tier.add_argument("--hedge-floor-ms", type=float, default=2.0,
                      help="smallest hedge delay (default 2)")
    tier.add_argument("--no-hedge", action="store_true",
                      help="never send a read to a replica before the master failed")
    tier.add_argument("--strict-sparse", action="store_true",
                      help="answer 503 when rows cannot be read in time (default: score "
                           "them as zero rows, as unknown keys)")
    p.add_argument("--threads", type=int, help="torch intra-op threads")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    add_storage_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch
    import uvicorn

    from terarec.serving.app import create_app
    from terarec.serving.engine import ServingEngine

    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    common = dict(storage_options=storage_options_from_args(args),
                  cache_rows=args.cache_rows, cache_dir=args.cache_dir,
                  incomplete_timeout_s=args.incomplete_seconds)
    if args.sparse_tier:
        from redis.exceptions import RedisError

        from terarec.cli.main import UserError
        from terarec.serving.cluster import ClusterEngine
        from terarec.sparsetier.tier import TierError

        for flag in ("hot_rows", "hot_bytes", "sparse_deadline_ms", "hedge_floor_ms"):
            value = getattr(args, flag)
            if value is not None and value < 0:
                raise ValueError(f"--{flag.replace('_', '-')} must be >= 0, got {value}")
        try:
            engine: ServingEngine = ClusterEngine(
                args.uri, args.sparse_tier, ns=args.namespace, hot_rows=args.hot_rows,
                hot_bytes=args.hot_bytes, strict=args.strict_sparse,
                deadline_s=args.sparse_deadline_ms / 1000, hedge=not args.no_hedge,
                hedge_floor_s=args.hedge_floor_ms / 1000,
                hedge_delay_s=None if args.hedge_ms is None else args.hedge_ms / 1000,
                **common)
        except (TierError, RedisError) as exc:
            raise UserError(f"--sparse-tier {args.sparse_tier}: {exc}") from None
    else:
        engine = ServingEngine(args.uri, **common)
    if args.wait_seconds > 0:
        engine.wait_for_version(args.wait_seconds)
    else:
        engine.refresh()
    if engine.current is None:
        logging.getLogger(__name__).warning("no version under %s yet; polling every %.1fs",
                                            args.uri, args.poll_seconds)
    app = create_app(engine, model_name=args.name, max_candidates=args.max_candidates,
                     max_body_bytes=args.max_body_bytes, poll_interval_s=args.poll_seconds)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level,
                access_log=False)
    return 0
