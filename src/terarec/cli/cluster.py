"""``terarec cluster up|status|down``: a Redis Cluster on this machine's loopback ports for
``terarec publish`` and ``serve --sparse-tier`` (a trial, a laptop, CI). Its nodes keep
running after ``up`` returns, each with its folder under ``--dir``; ``down`` stops them.
A cluster across machines: see deploy/redis-cluster/ and docs/serving-cluster.md.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

DEFAULT_DIR = Path(".terarec-cluster")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("cluster", help="start, check or stop a local Redis Cluster",
                       description=__doc__)
    actions = p.add_subparsers(dest="action", required=True)
    up = actions.add_parser("up", help="start a cluster on loopback ports")
    up.add_argument("--port", type=int, default=7000,
                    help="first node's port; the others follow it (default 7000; each "
                         "node also uses port + 10000 for the cluster bus)")
    up.add_argument("--masters", type=int, default=3, help="masters (>= 3, default 3)")
    up.add_argument("--replicas", type=int, default=1,
                    help="replicas per master (default 1)")
    up.add_argument("--node-timeout-ms", type=int, default=5000,
                    help="cluster-node-timeout: a master unreachable this long is failed "
                         "over (default 5000)")
    status = actions.add_parser("status", help="each node's role and the cluster's state "
                                              "(exit code 1 unless every slot is served)")
    status.add_argument("--json", action="store_true", help="print one JSON object")
    actions.add_parser("down", help="stop every node and remove --dir")
    for action in (up, status, actions.choices["down"]):
        action.add_argument("--dir", type=Path, default=DEFAULT_DIR,
                            help=f"the cluster's folder (default {DEFAULT_DIR})")
        action.set_defaults(func=run)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from terarec.cli.main import UserError
    from terarec.sparsetier.local import (
        ClusterStartError,
        cluster_down,
        cluster_status,
        cluster_up,
        redis_binaries,
    )

    if args.action == "up":
        if redis_binaries() is None:
            raise UserError("redis-server / redis-cli not found on PATH (Debian/Ubuntu: "
                            "apt-get install redis-server; macOS: brew install redis)")
        try:
            st = cluster_up(args.dir, masters=args.masters, replicas=args.replicas,
                            port=args.port, node_timeout_ms=args.node_timeout_ms)
        except ClusterStartError as exc:
            raise UserError(str(exc)) from None
        print(f"cluster up: {st.url} ({st.masters} masters x {st.replicas} replicas, "
              f"ports {st.nodes[0].port}-{st.nodes[-1].port}, dir {st.root})")
        return 0
    if args.action == "status":
        st = cluster_status(args.dir)
        if args.json:
            print(json.dumps(st.to_dict()))
        else:
            alive = sum(n.alive for n in st.nodes)
            print(f"cluster {'ok' if st.ok else 'NOT ok'}: {st.url} state={st.state} "
                  f"slots_ok={st.slots_ok}/16384 nodes={alive}/{len(st.nodes)} alive")
            for n in st.nodes:
                slots = f" slots={n.slots}" if n.role == "master" else ""
                print(f"  127.0.0.1:{n.port} pid={n.pid} {n.role}{slots}")
        return 0 if st.ok else 1
    stopped = cluster_down(args.dir)
    print(f"cluster down: stopped {len(stopped)} node(s), removed {args.dir}")
    return 0
