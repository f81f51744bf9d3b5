"""HTTP front of the serving engine: Open Inference Protocol (KServe v2) routes, a plain
JSON ``/predict`` and Prometheus ``/metrics``.

Request bodies are validated against ``PredictRequest`` / ``InferRequest`` (their shape)
and then against the served model (feature names, shapes, values), so that every bad
input gets a 4xx whose message names the offending field (``candidates[3].C7: ...``),
never a 500. Bodies are read with a byte cap (413 past it).

``/predict`` takes raw feature values: one ``context`` (user, page) shared by ``N``
``candidates`` (items); each candidate is merged with the context and hashed with the
model's saved schema, exactly as training hashed its files::

    {"context": {"C1": "u42", "I1": 3}, "candidates": [{"C3": "item7"}, {"C3": "item9"}]}
    -> {"model": "terarec", "version": 3, "scores": [0.031, 0.207]}
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, MutableMapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Annotated, Any, TypeVar

import pyarrow as pa
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from terarec.data.readers import DataError
from terarec.finite import NonFiniteError, check_scores
from terarec.serving.cluster import SparseReadError
from terarec.serving.engine import NoVersionError, ServedVersion, ServingEngine
from terarec.serving.metrics import ServingMetrics
from terarec.serving.openapi import openapi_document
from terarec.validation import STRICT, InvalidInput, validate_json

log = logging.getLogger(__name__)

KSERVE_DATATYPES = {"BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32",
                    "INT64", "FP16", "FP32", "FP64", "BYTES"}
OUTPUT_NAME = "score"
_ROUTES = [(re.compile(r"^/v2/models/[^/]+/infer$"), "infer"),
           (re.compile(r"^/v2/models/[^/]+(/ready)?$"), "model"),
           (re.compile(r"^/v2(/health/(live|ready))?$"), "health"),
           (re.compile(r"^/predict$"), "predict"), (re.compile(r"^/metrics$"), "metrics")]


T = TypeVar("T")
Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


@dataclass
class PredictRequest:
    """``/predict`` body: ``candidates`` scored, each merged with ``context``."""

    __pydantic_config__ = STRICT

    candidates: Annotated[list[dict[str, Any]], Field(
        min_length=1, description="an array of feature objects, one per item to score")]
    context: Annotated[dict[str, Any], Field(description="an object of feature values")] = \
        field(default_factory=dict)


@dataclass
class InferInput:
    """One input tensor of a v2 inference request: a feature's values, one per row."""

    __pydantic_config__ = STRICT

    name: str
    shape: list[int]
    datatype: str
    data: list[Any]
    parameters: dict[str, Any] = field(default_factory=dict)


@dataclass
class InferRequest:
    """Open Inference Protocol (KServe v2) ``/infer`` body."""

    __pydantic_config__ = STRICT

    inputs: Annotated[list[InferInput], Field(
        min_length=1, description="a non-empty array of input tensors")]
    id: str | None = None
    outputs: list[dict[str, Any]] = field(default_factory=list)
    parameters: dict[str, Any] = field(default_factory=dict)


class BadRequest(Exception):
    """A request the server will not score; becomes ``{"error": message}``."""

    def __init__(self, message: str, status: int = 422) -> None:
        super().__init__(message)
        self.status = status


def _route_label(path: str) -> str:
    return next((label for pattern, label in _ROUTES if pattern.match(path)), "other")


class _Timing:
    """ASGI middleware: latency histogram and status counts per route."""

    def __init__(self, app: ASGIApp, metrics: ServingMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500

        async def send_wrapper(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            route = _route_label(scope.get("path", ""))
            self.metrics.latency.labels(route).observe(time.perf_counter() - start)
            self.metrics.requests.labels(route, str(status)).inc()


async def _read_body(request: Request, max_bytes: int, model: type[T]) -> T:
    """The request body, at most ``max_bytes``, parsed and validated as a ``model``."""
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            if int(declared) > max_bytes:
                raise BadRequest(f"request body of {declared} bytes exceeds the limit of "
                                 f"{max_bytes} bytes", 413)
        except ValueError:
            raise BadRequest(f"bad Content-Length header {declared!r}", 400) from None
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise BadRequest(f"request body exceeds the limit of {max_bytes} bytes", 413)
        chunks.append(chunk)
    body = b"".join(chunks)
    if not body:
        raise BadRequest("empty request body; expected a JSON object", 400)
    try:
        return validate_json(model, body, root="request")
    except InvalidInput as exc:
        bad_json = next((p for p in exc.problems if p.kind == "json_invalid"), None)
        if bad_json is None:
            raise BadRequest(str(exc)) from None
        if "recursion limit" in bad_json.message:
            raise BadRequest("malformed JSON: nested too deeply", 400) from None
        raise BadRequest(f"malformed JSON: {bad_json.message.split(': ', 1)[-1]}",
                         400) from None


def _check_features(features: Mapping[str, Any], where: str,
                    version: ServedVersion) -> Mapping[str, Any]:
    if not features.keys() <= version.feature_set:
        unknown = [k for k in features if k not in version.feature_set]
        raise BadRequest(f"{where}: unknown feature(s) {unknown}; the model's features are "
                         f"{list(version.feature_names)}")
    return features


def _score(engine: ServingEngine, version: ServedVersion, context: Mapping[str, Any],
           candidates: list[dict[str, Any]], where: str) -> list[float]:
    try:
        batch = version.batch(context, candidates)
    except (DataError, ValueError, TypeError, pa.ArrowException) as exc:
        message = str(exc).replace("candidates[", f"{where}[", 1)
        raise BadRequest(message) from None
    scores = engine.score_batch(batch, version)
    try:
        check_scores(scores)
    except NonFiniteError as exc:
        raise BadRequest(f"{where}: {exc}") from None
    return scores.tolist()


def create_app(engine: ServingEngine, *, model_name: str = "terarec",
               max_candidates: int = 1000, max_body_bytes: int = 4 << 20,
               poll_interval_s: float | None = None) -> FastAPI:
    """The ASGI app. With ``poll_interval_s`` the engine follows new versions while the
    app runs (started and stopped with the app's lifespan)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if poll_interval_s is not None:
            engine.start_polling(poll_interval_s)
        try:
            yield
        finally:
            engine.close()

    app = FastAPI(title="terarec", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.add_middleware(_Timing, metrics=engine.metrics)

    @app.exception_handler(BadRequest)
    async def bad_request(request: Request, exc: BadRequest) -> JSONResponse:
        return JSONResponse({"error": str(exc)}, status_code=exc.status)

    @app.exception_handler(NoVersionError)
    async def no_version(request: Request, exc: NoVersionError) -> JSONResponse:
        return JSONResponse({"error": str(exc)}, status_code=503)

    @app.exception_handler(SparseReadError)
    async def sparse_unreadable(request: Request, exc: SparseReadError) -> JSONResponse:
        return JSONResponse({"error": str(exc)}, status_code=503)

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
        return openapi_document(model_name, features, __version__)

    def served_model(name: str) -> ServedVersion:
        if name != model_name:
            raise BadRequest(f"unknown model {name!r}; this server serves {model_name!r}", 404)
        return engine.served()

    @app.get("/v2/health/live")
    async def live() -> dict:
        return {"live": True}

    @app.get("/v2/health/ready")
    async def ready() -> JSONResponse:
        ok = engine.current is not None
        return JSONResponse({"ready": ok}, status_code=200 if ok else 503)

    @app.get("/v2")
    async def server_metadata() -> dict:
        from terarec import __version__

        return {"name": "terarec", "version": __version__, "extensions": []}

    @app.get("/v2/models/{name}")
    async def model_metadata(name: str) -> dict:
        version = served_model(name)
        inputs = [{"name": f.name, "datatype": "FP64" if f.kind == "numeric" else "BYTES",
                   "shape": [-1]} for f in version.schema.fields]
        return {"name": model_name, "versions": [str(version.version)], "platform": "terarec",
                "inputs": inputs,
                "outputs": [{"name": OUTPUT_NAME, "datatype": "FP32", "shape": [-1]}]}

    @app.get("/v2/models/{name}/ready")
    async def model_ready(name: str) -> JSONResponse:
        if name != model_name:
            raise BadRequest(f"unknown model {name!r}; this server serves {model_name!r}", 404)
        ok = engine.current is not None
        return JSONResponse({"name": model_name, "ready": ok}, status_code=200 if ok else 503)

    @app.post("/v2/models/{name}/infer")
    async def infer(name: str, request: Request) -> dict:
        version = served_model(name)
        body = await _read_body(request, max_body_bytes, InferRequest)
        records = _kserve_records(body, version, max_candidates)
        scores = _score(engine, version, {}, records, "row")
        out = {"model_name": model_name, "model_version": str(version.version),
               "outputs": [{"name": OUTPUT_NAME, "datatype": "FP32", "shape": [len(scores)],
                            "data": scores}]}
        if body.id is not None:
            out["id"] = body.id
        return out

    @app.post("/predict")
    async def predict(request: Request) -> dict:
        version = engine.served()
        body = await _read_body(request, max_body_bytes, PredictRequest)
        context, candidates = _predict_request(body, version, max_candidates)
        scores = _score(engine, version, context, candidates, "candidates")
        return {"model": model_name, "version": version.version, "scores": scores}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(engine.metrics.registry),
                        media_type=CONTENT_TYPE_LATEST)

    return app


def _predict_request(body: PredictRequest, version: ServedVersion,
                     max_candidates: int) -> tuple[Mapping[str, Any], list[dict[str, Any]]]:
    """The body's context and candidates, checked against the served model."""
    context = _check_features(body.context, "context", version)
    candidates = body.candidates
    if len(candidates) > max_candidates:
        raise BadRequest(f"{len(candidates)} candidates exceed the limit of {max_candidates}",
                         413)
    for i, cand in enumerate(candidates):
        _check_features(cand, f"candidates[{i}]", version)
        if not context.keys().isdisjoint(cand):
            both = [k for k in cand if k in context]
            raise BadRequest(f"candidates[{i}]: feature(s) {both} also given in 'context'")
    return context, candidates


def _kserve_records(body: InferRequest, version: ServedVersion,
                    max_candidates: int) -> list[dict[str, Any]]:
    """Rows from a v2 inference request: one input tensor per feature, shape [N] or
    [N, 1], all with the same N."""
    if any(o.get("name") != OUTPUT_NAME for o in body.outputs):
        raise BadRequest(f"'outputs' may only request the output {OUTPUT_NAME!r}")
    columns: dict[str, list[Any]] = {}
    rows = None
    known = version.feature_names
    for i, tensor in enumerate(body.inputs):
        name, shape, data = tensor.name, tensor.shape, tensor.data
        if name not in version.feature_set:
            raise BadRequest(f"inputs[{i}]: unknown input {name!r}; the model's inputs are "
                             f"{list(known)}")
        where = f"input {name!r}"
        if name in columns:
            raise BadRequest(f"{where} given twice")
        if tensor.datatype not in KSERVE_DATATYPES:
            raise BadRequest(f"{where}: unknown datatype {tensor.datatype!r}")
        if not shape or len(shape) > 2 or (len(shape) == 2 and shape[1] != 1):
            raise BadRequest(f"{where}: shape must be [N] or [N, 1], got {shape!r}")
        if len(data) and isinstance(data[0], list) and len(shape) == 2:
            if not all(isinstance(row, list) and len(row) == 1 for row in data):
                raise BadRequest(f"{where}: nested 'data' must hold one value per row")
            data = [row[0] for row in data]
        if shape[0] != len(data):
            raise BadRequest(f"{where}: shape {shape} does not match {len(data)} values")
        if rows is None:
            rows = shape[0]
            if rows < 1:
                raise BadRequest(f"{where}: no rows")
            if rows > max_candidates:
                raise BadRequest(f"{rows} rows exceed the limit of {max_candidates}", 413)
        elif shape[0] != rows:
            raise BadRequest(f"{where}: {shape[0]} rows, other inputs have {rows}")
        columns[name] = data
    names = list(columns)
    return [dict(zip(names, values, strict=True))
            for values in zip(*columns.values(), strict=True)]
