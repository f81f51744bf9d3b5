"""HTTP front of the serving engine: Open Inference Protocol (KServe v2) routes, a plain
JSON ``/predict``, ``/retrieve`` with an item index, and Prometheus ``/metrics``.

The modules behind it, by job: ``asgi`` (reading bodies, answering, metrics
middleware), ``schemas`` (the request bodies, decoded once), ``errors`` (what becomes
which status), ``kserve`` (v2 tensor checks), ``routes`` (what each route does). Every
bad input gets a 4xx whose message names the offending field (``candidates[3].C7:
...``), never a 500; bodies are read with a byte cap (413 past it).
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from terarec.serving.asgi import ROUTES, Disconnected, Receive, Scope, Send, Timing, send_json
from terarec.serving.batching import DynamicBatcher
from terarec.serving.engine import ServedVersion, ServingEngine
from terarec.serving.errors import ANSWERED, BadRequest, status_of
from terarec.serving.metrics import ServingMetrics
from terarec.serving.openapi import openapi_document
from terarec.serving.routes import ScoringRoutes, add_v2_routes
from terarec.serving.schemas import InferRequest, encode

log = logging.getLogger(__name__)

# A scoring route: (scope, receive) -> the JSON answer of a 200.
Handler = Callable[[Scope, Receive], Awaitable[Any]]


class ServingApp(FastAPI):
    """The FastAPI app, with its scoring routes (``POST /predict`` and ``POST
    /v2/models/NAME/infer``) answered by plain ASGI handlers: they skip FastAPI's
    routing, middleware, dependency and response layers, most of a small request's
    framework time. They answer errors through the same mapping as the app's exception
    handlers (``serving/errors.py``), and record the same latency and status metrics.
    Every other request (and the lifespan) goes through FastAPI."""

    def set_scoring_routes(self, routes: list[tuple[re.Pattern[str], str, Handler]],
                           metrics: ServingMetrics) -> None:
        self.scoring_routes = routes
        self.scoring_latency = {label: metrics.latency.labels(label) for _, label, _ in routes}
        self.scoring_metrics = metrics
        self.scoring_counts: dict[tuple[str, int], Any] = {}  # (route, status) -> its counter

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            path = scope["path"]
            for pattern, label, handler in getattr(self, "scoring_routes", ()):
                if pattern.match(path):
                    await self.answer(label, handler, scope, receive, send)
                    return
        await super().__call__(scope, receive, send)

    async def answer(self, label: str, handler: Handler, scope: Scope, receive: Receive,
                     send: Send) -> None:
        """Run one scoring ``handler`` and send its answer, or the error it raised."""
        start = time.perf_counter()
        headers: list[tuple[bytes, bytes]] = []
        try:
            if scope["method"] != "POST":
                headers.append((b"allow", b"POST"))
                raise BadRequest(f"{scope['method']} {scope['path']}: Method Not Allowed", 405)
            status, body = 200, encode(await handler(scope, receive))
        except ANSWERED as exc:
            status, body = status_of(exc), encode({"error": str(exc)})
        except Disconnected:
            return
        except Exception:
            log.exception("%s %s failed", scope["method"], scope["path"])
            status, body = 500, encode({"error": "internal server error"})
        await send_json(send, status, body, headers)
        self.scoring_latency[label].observe(time.perf_counter() - start)
        counter = self.scoring_counts.get((label, status))
        if counter is None:
            counter = self.scoring_counts[label, status] = self.scoring_metrics.requests.labels(
                label, str(status))
        counter.inc()


def create_app(engine: ServingEngine, *, model_name: str = "terarec",
               max_candidates: int = 1000, max_body_bytes: int = 4 << 20,
               poll_interval_s: float | None = None,
               batcher: DynamicBatcher | None = None,
               index: Any = None, max_top_k: int = 1000) -> ServingApp:
    """The ASGI app. With ``poll_interval_s`` the engine follows new versions while the
    app runs (started and stopped with the app's lifespan). Requests in flight together
    are scored in one pass by ``batcher`` (by default one over ``engine.score_batch``
    with its default limits). With ``index`` (an item index, retrieval/index.py), ``POST
    /retrieve`` and v2 requests with ``parameters.top_k`` return its top items."""
    batcher = batcher or DynamicBatcher(engine.score_batch)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if poll_interval_s is not None:
            engine.start_polling(poll_interval_s)
        try:
            yield
        finally:
            engine.close()

    app = ServingApp(title="terarec", lifespan=lifespan, docs_url=None, redoc_url=None,
                     openapi_url=None)

    async def answered(request: Request, exc: Exception) -> JSONResponse:
        return JSONResponse({"error": str(exc)}, status_code=status_of(exc))

    for kind in ANSWERED:
        app.add_exception_handler(kind, answered)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # an unknown route or method answers in the same {"error": ...} shape
        return JSONResponse({"error": f"{request.method} {request.url.path}: {exc.detail}"},
                            status_code=exc.status_code, headers=exc.headers)

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi() -> dict:
        from terarec import __version__

        current = engine.current
        features = None if current is None else (current.raw_schema or current.schema).fields
        return openapi_document(model_name, features, __version__,
                                max_top_k=None if index is None else max_top_k)

    async def top_k(version: ServedVersion, body: InferRequest) -> dict[str, Any]:
        from terarec.serving.retrieve import infer_top_k  # faiss only when asked for

        return await infer_top_k(engine, index, version, body, model_name, max_top_k)

    scoring = ScoringRoutes(engine, batcher, model_name=model_name,
                            max_candidates=max_candidates, max_body_bytes=max_body_bytes,
                            top_k=top_k)
    add_v2_routes(app, engine, scoring)

    if index is not None:  # an item index (retrieval/index.py): POST /retrieve
        from terarec.serving.retrieve import add_retrieve_routes

        add_retrieve_routes(app, engine, index, model_name=model_name,
                            max_body_bytes=max_body_bytes, max_top_k=max_top_k,
                            batcher=batcher)

    app.add_middleware(Timing, metrics=engine.metrics)  # times the other routes
    app.set_scoring_routes([(ROUTES[0][0], "infer", scoring.infer),
                            (ROUTES[3][0], "predict", scoring.predict)], engine.metrics)
    return app
