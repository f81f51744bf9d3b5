"""One server, several processes: ``terarec serve --workers N``.

One process scores on one core (the GIL), so N worker processes listen on one port:
each binds its own socket with ``SO_REUSEPORT`` and the kernel spreads connections over
them; the parent only starts the workers, restarts one that dies and stops them all on
SIGTERM / SIGINT. Each worker builds its own engine from the same ``ServeOptions`` and
keeps its own hot-key cache, but all use one download folder: the verified copies
of the shards are made once and memory-mapped by every worker, so the page cache
holds them once. A swap notice file in that folder keeps the workers on one version: a
worker that swaps rewrites it and the others refresh within ``NOTICE_POLL_S`` of seeing
it change, so all of them serve a new version within one poll interval of each other.
"""

from __future__ import annotations

import gc
import logging
import multiprocessing as mp
import signal
import socket
import threading
import time
from dataclasses import dataclass
from multiprocessing.process import BaseProcess
from typing import Any

from fastapi import FastAPI

from terarec.serving.protocol import OneWriteHttp

log = logging.getLogger(__name__)
SWAP_NOTICE = "SERVED"
# uvicorn settings of every server process: uvloop and the httptools parser, each answer
# in one socket write (serving/protocol.py); no access log, no X-Forwarded-* rewriting
# (a middleware layer on every request; the server does not log client addresses) and
# no Server header.
UVICORN_OPTIONS: dict[str, Any] = {"loop": "uvloop", "http": OneWriteHttp,
                                   "access_log": False, "proxy_headers": False,
                                   "server_header": False}
# A worker that dies sooner than this after starting is not restarted (it would only
# fail again: a port in use, an unreadable export): the server stops instead.
MIN_WORKER_LIFE_S = 10.0


class WorkerError(RuntimeError):
    """A worker process could not start."""


@dataclass
class ServeOptions:
    """Everything a server process needs to build its engine and app."""

    uri: str
    storage_options: dict[str, Any] | None = None
    model_name: str = "terarec"
    poll_seconds: float = 5.0
    cache_rows: int = 1_000_000
    cache_dir: str | None = None
    swap_notice: str | None = None
    max_candidates: int = 1000
    max_body_bytes: int = 4 << 20
    wait_seconds: float = 0.0
    incomplete_seconds: float = 60.0
    threads: int | None = None
    max_batch_rows: int = 4096
    max_delay_ms: float = 1.0
    # ClusterEngine's arguments ("url" and its keywords) to read rows from a sparse tier.
    sparse_tier: dict[str, Any] | None = None
    # An item index folder (`terarec index`): serve POST /retrieve from it.
    index: str | None = None
    max_top_k: int = 1000


def build_app(options: ServeOptions) -> FastAPI:
    """The engine (first version loaded or waited for) and its app."""
    import torch

    from terarec.serving.app import create_app
    from terarec.serving.batching import DynamicBatcher
    from terarec.serving.engine import ServingEngine

    if options.threads:
        torch.set_num_threads(options.threads)
    common: dict[str, Any] = dict(
        storage_options=options.storage_options, cache_rows=options.cache_rows,
        cache_dir=options.cache_dir, incomplete_timeout_s=options.incomplete_seconds,
        swap_notice=options.swap_notice)
    engine: ServingEngine
    if options.sparse_tier:
        from terarec.serving.cluster import ClusterEngine

        tier = dict(options.sparse_tier)
        engine = ClusterEngine(options.uri, tier.pop("url"), **tier, **common)
    else:
        engine = ServingEngine(options.uri, **common)
    if options.wait_seconds > 0:
        engine.wait_for_version(options.wait_seconds)
    else:
        engine.refresh()
    if engine.current is None:
        logging.getLogger(__name__).warning("no version under %s yet; polling every %.1fs",
                                            options.uri, options.poll_seconds)
    batcher = DynamicBatcher(engine.score_batch, max_rows=options.max_batch_rows,
                             max_delay_s=options.max_delay_ms / 1e3)
    index = None
    if options.index is not None:
        from terarec.retrieval.index import IndexWatcher

        index = IndexWatcher(options.index)  # follows CURRENT with the version poller
    # What startup loaded (torch, the network, the schema) stays alive for good: keep it
    # out of the cyclic collector's generations, whose full passes would otherwise walk
    # it all and show as latency spikes.
    gc.collect()
    gc.freeze()
    return create_app(engine, model_name=options.model_name,
                      max_candidates=options.max_candidates,
                      max_body_bytes=options.max_body_bytes,
                      poll_interval_s=options.poll_seconds, batcher=batcher,
                      index=index, max_top_k=options.max_top_k)


def serve_workers(options: ServeOptions, workers: int, host: str, port: int,
                  log_level: str) -> None:
    """Run ``workers`` server processes on ``host:port`` until SIGTERM / SIGINT."""
    if port == 0:
        raise ValueError("--workers needs a fixed --port (each worker binds it)")
    ctx = mp.get_context("spawn")
    stop = threading.Event()

    started: dict[int, float] = {}

    def start(i: int) -> BaseProcess:
        proc = ctx.Process(target=_worker, args=(options, host, port, log_level),
                           name=f"terarec-serve-{i}", daemon=False)
        proc.start()
        started[i] = time.monotonic()
        return proc

    previous = {sig: signal.signal(sig, lambda *_: stop.set())
                for sig in (signal.SIGTERM, signal.SIGINT)}
    procs = [start(i) for i in range(workers)]
    try:
        while not stop.wait(0.5):
            for i, proc in enumerate(procs):
                if proc.is_alive():
                    continue
                if time.monotonic() - started[i] < MIN_WORKER_LIFE_S:
                    raise WorkerError(f"worker {i} (pid {proc.pid}) exited with "
                                      f"{proc.exitcode} right after starting; see its log")
                log.warning("worker %d (pid %s) exited with %s; starting another", i,
                            proc.pid, proc.exitcode)
                procs[i] = start(i)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.terminate()  # uvicorn finishes the requests in flight
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _worker(options: ServeOptions, host: str, port: int, log_level: str) -> None:
    """One worker process: its own socket on the shared port, engine and app."""
    import uvicorn

    logging.basicConfig(level=log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP named: asyncio sets TCP_NODELAY on accepted connections only then
    # (without it, small answers wait ~40 ms for the client's delayed ACK).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    app = build_app(options)  # before listening: no connection waits for a load
    sock.listen(2048)
    config = uvicorn.Config(app, log_level=log_level, **UVICORN_OPTIONS)
    uvicorn.Server(config).run(sockets=[sock])
