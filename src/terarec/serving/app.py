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

``/v2/models/NAME/infer`` also takes KServe's binary tensor data (``serving/binary.py``).
Every scoring request goes through one ``DynamicBatcher``, which scores the requests in
flight together in one pass (``serving/batching.py``).
"""

from __future__ import annotations

import logging
import re
import time
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, MutableMapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Annotated, Any, TypeVar

import msgspec
import numpy as np
import orjson
import pyarrow as pa
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from terarec.data.readers import DataError, batch_from_columns
from terarec.finite import NonFiniteError, check_scores
from terarec.serving import binary
from terarec.serving.batching import DynamicBatcher, QueueFull
from terarec.serving.cluster import SparseReadError
from terarec.serving.engine import NoVersionError, ServedVersion, ServingEngine
from terarec.serving.features import columns_batch, relabel
from terarec.serving.metrics import ServingMetrics
from terarec.serving.openapi import openapi_document
from terarec.types import Batch
from terarec.validation import STRICT, InvalidInput, json_type, validate_json

log = logging.getLogger(__name__)

KSERVE_DATATYPES = {"BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32",
                    "INT64", "FP16", "FP32", "FP64", "BYTES"}
OUTPUT_NAME = "score"
_ROUTES = [(re.compile(r"^/v2/models/[^/]+/infer$"), "infer"),
           (re.compile(r"^/v2/models/[^/]+(/ready)?$"), "model"),
           (re.compile(r"^/v2(/health/(live|ready))?$"), "health"),
           (re.compile(r"^/predict$"), "predict"), (re.compile(r"^/metrics$"), "metrics"),
           (re.compile(r"^/retrieve$"), "retrieve")]


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


class _Disconnected(Exception):
    """The client went away before its body arrived: nothing to answer."""


def _header(scope: Scope, name: bytes) -> str | None:
    """The value of request header ``name`` (lower case, as ASGI servers give them)."""
    for key, value in scope["headers"]:
        if key == name:
            return value.decode("latin-1")
    return None


async def _read_body(scope: Scope, receive: Receive, max_bytes: int) -> bytes:
    """The request body, at most ``max_bytes`` (413 past it, 400 when empty)."""
    declared = _header(scope, b"content-length")
    if declared is not None:
        try:
            if int(declared) > max_bytes:
                raise BadRequest(f"request body of {declared} bytes exceeds the limit of "
                                 f"{max_bytes} bytes", 413)
        except ValueError:
            raise BadRequest(f"bad Content-Length header {declared!r}", 400) from None
    chunks: list[bytes] = []
    size, more = 0, True
    while more:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise _Disconnected
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > max_bytes:
            raise BadRequest(f"request body exceeds the limit of {max_bytes} bytes", 413)
        if chunk:
            chunks.append(chunk)
        more = message.get("more_body", False)
    body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
    encoding = (_header(scope, b"content-encoding") or "identity").strip().lower()
    if encoding != "identity":
        body = _decompress(body, encoding, max_bytes)
    if not body:
        raise BadRequest("empty request body; expected a JSON object", 400)
    return body


# Content-Encoding -> zlib's wbits for it: gzip, and deflate as HTTP means it (zlib format).
_ENCODINGS = {"gzip": 31, "x-gzip": 31, "deflate": 15}


def _decompress(body: bytes, encoding: str, max_bytes: int) -> bytes:
    """A compressed body, inflated to at most ``max_bytes`` (the limit holds for what is
    parsed, so a small body cannot expand past it)."""
    wbits = _ENCODINGS.get(encoding)
    if wbits is None:
        raise BadRequest(f"Content-Encoding {encoding!r} is not supported; send gzip, "
                         "deflate or an uncompressed body", 415)
    inflater = zlib.decompressobj(wbits)
    try:
        out = inflater.decompress(body, max_bytes + 1)
    except zlib.error as exc:
        raise BadRequest(f"body is not valid {encoding} data ({exc})", 400) from None
    if len(out) > max_bytes:
        raise BadRequest(f"request body exceeds the limit of {max_bytes} bytes once "
                         f"decompressed", 413)
    if not inflater.eof:
        raise BadRequest(f"body is truncated {encoding} data", 400)
    return out


# A scoring route: (scope, receive) -> the JSON answer of a 200.
_Handler = Callable[[Scope, Receive], Awaitable[Any]]
_JSON_TYPE = (b"content-type", b"application/json")


class ServingApp(FastAPI):
    """The FastAPI app, with its scoring routes (``POST /predict`` and ``POST
    /v2/models/NAME/infer``) answered by plain ASGI handlers: they skip FastAPI's
    routing, middleware, dependency and response layers, most of a small request's
    framework time. They answer errors as the app's exception handlers do (``{"error":
    ...}`` with the same statuses), and record the same latency and status metrics.
    Every other request (and the lifespan) goes through FastAPI."""

    def set_scoring_routes(self, routes: list[tuple[re.Pattern[str], str, _Handler]],
                           metrics: ServingMetrics) -> None:
        self._scoring = routes
        self._latency = {label: metrics.latency.labels(label) for _, label, _ in routes}
        self._metrics = metrics
        self._counted: dict[tuple[str, int], Any] = {}  # (route, status) -> its counter

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            path = scope["path"]
            for pattern, label, handler in getattr(self, "_scoring", ()):
                if pattern.match(path):
                    await self._answer(label, handler, scope, receive, send)
                    return
        await super().__call__(scope, receive, send)

    async def _answer(self, label: str, handler: _Handler, scope: Scope, receive: Receive,
                      send: Send) -> None:
        start = time.perf_counter()
        headers = [_JSON_TYPE]
        try:
            if scope["method"] != "POST":
                raise BadRequest(f"{scope['method']} {scope['path']}: Method Not Allowed", 405)
            status, body = 200, orjson.dumps(await handler(scope, receive))
        except BadRequest as exc:
            status, body = exc.status, orjson.dumps({"error": str(exc)})
            if status == 405:
                headers.append((b"allow", b"POST"))
        except (NoVersionError, SparseReadError) as exc:
            status, body = 503, orjson.dumps({"error": str(exc)})
        except _Disconnected:
            return
        except Exception:
            log.exception("%s %s failed", scope["method"], scope["path"])
            status, body = 500, orjson.dumps({"error": "internal server error"})
        headers.append((b"content-length", str(len(body)).encode()))
        await _send_once(send, {"type": "http.response.start", "status": status,
                                "headers": headers}, {"type": "http.response.body", "body": body})
        self._latency[label].observe(time.perf_counter() - start)
        counter = self._counted.get((label, status))
        if counter is None:
            counter = self._counted[label, status] = self._metrics.requests.labels(
                label, str(status))
        counter.inc()


class _CollectedWrites:
    """Stands in for a connection's transport while one answer is sent: keeps what is
    written (and a close) and hands it on in one write."""

    def __init__(self, transport: Any) -> None:
        self.transport = transport
        self.parts: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        self.parts.append(data)

    def close(self) -> None:
        self.closed = True

    def __getattr__(self, name: str) -> Any:
        return getattr(self.transport, name)

    def flush(self) -> None:
        if self.parts:
            self.transport.write(b"".join(self.parts))
        if self.closed:
            self.transport.close()


async def _send_once(send: Send, start: Message, body: Message) -> None:
    """Send an answer's start and body messages as one socket write.

    uvicorn writes the status line and headers as soon as the start message comes and
    the body with the next one: two system calls, two TCP segments, the client woken
    twice (a tenth of a worker's time in a profile at one request in flight). Where
    ``send`` is bound to a uvicorn request cycle, its transport is swapped for the two
    messages; any other server gets the two messages as they are."""
    cycle: Any = getattr(send, "__self__", None)
    transport = getattr(cycle, "transport", None)
    if transport is None or not callable(getattr(transport, "write", None)):
        await send(start)
        await send(body)
        return
    collected = _CollectedWrites(transport)
    cycle.transport = collected
    try:
        await send(start)
        await send(body)
    finally:
        cycle.transport = transport
        collected.flush()


def _parse(model: type[T], body: bytes) -> T:
    """``body`` parsed and validated as a ``model``; errors name the JSON path."""
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


class _PredictBody(msgspec.Struct, forbid_unknown_fields=True):
    """``PredictRequest`` as msgspec decodes it: the fast first try (see
    ``_decode_predict``)."""

    candidates: list[dict[str, Any]]
    context: dict[str, Any] = msgspec.field(default_factory=dict)


_PREDICT_DECODER = msgspec.json.Decoder(_PredictBody)


def _decode_predict(body: bytes, version: ServedVersion, max_candidates: int
                    ) -> tuple[Mapping[str, Any], list[dict[str, Any]], frozenset[str] | None]:
    """The body's context and candidates, checked against the served model, and the
    candidates' feature names where the check found them (the conversion needs them).

    msgspec decodes a well-formed body in one pass and whole-request set operations
    check its feature names; anything either refuses (or that msgspec reads differently
    from the JSON standard pydantic follows, such as NaN) is decoded and checked again
    by ``PredictRequest`` and ``_predict_request``, which word the error."""
    try:
        fast = _PREDICT_DECODER.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError):
        fast = None
    if fast is not None and 0 < len(fast.candidates) <= max_candidates:
        names = frozenset().union(*fast.candidates)
        allowed = version.feature_set
        if names <= allowed and fast.context.keys() <= allowed \
                and names.isdisjoint(fast.context):
            return fast.context, fast.candidates, names
    return (*_predict_request(_parse(PredictRequest, body), version, max_candidates), None)


def _check_features(features: Mapping[str, Any], where: str,
                    version: ServedVersion) -> Mapping[str, Any]:
    if not features.keys() <= version.feature_set:
        unknown = [k for k in features if k not in version.feature_set]
        raise BadRequest(f"{where}: unknown feature(s) {unknown}; the model's features are "
                         f"{list(version.feature_names)}")
    return features


def _request_batch(version: ServedVersion, context: Mapping[str, Any],
                   candidates: list[dict[str, Any]], where: str,
                   row_names: frozenset[str] | None = None) -> Batch:
    try:
        return version.batch(context, candidates, row_names)
    except (DataError, ValueError, TypeError, pa.ArrowException) as exc:
        message = str(exc).replace("candidates[", f"{where}[", 1)
        raise BadRequest(message) from None


def _columns_request_batch(version: ServedVersion, columns: dict[str, Any], rows: int
                           ) -> Batch:
    """The Batch of a tensor request (one column per input): Arrow columns converted
    whole; a column pyarrow cannot type, or a bad value, takes the per-record path,
    whose error names the row."""
    if version.features is None:
        try:
            arrays = {name: data if isinstance(data, pa.Array) else pa.array(data)
                      for name, data in columns.items()}
            return columns_batch(arrays, rows, version.schema)
        except (DataError, ValueError, TypeError, OverflowError, pa.ArrowException):
            if all(isinstance(data, pa.Array) for data in columns.values()):
                return _binary_batch_error(version, columns, rows)
    names = list(columns)
    values = [c.to_pylist() if isinstance(c, pa.Array) else c for c in columns.values()]
    records = [dict(zip(names, row, strict=True)) for row in zip(*values, strict=True)]
    return _request_batch(version, {}, records, "row")


def _binary_batch_error(version: ServedVersion, columns: dict[str, Any], rows: int
                        ) -> Batch:
    """``batch_from_columns`` on binary tensors, its errors as 422s naming the row."""
    try:
        return batch_from_columns(columns, rows, version.schema)
    except (DataError, ValueError, TypeError, OverflowError, pa.ArrowException) as exc:
        raise BadRequest(relabel(str(exc), "row")) from None


async def _scores(batcher: DynamicBatcher, version: ServedVersion, batch: Batch,
                  where: str) -> list[float]:
    try:
        scores = await batcher.score(version, batch)
    except QueueFull as exc:
        raise BadRequest(f"server overloaded: {exc}; retry later", 503) from None
    try:
        check_scores(scores)
    except NonFiniteError as exc:
        raise BadRequest(f"{where}: {exc}") from None
    return scores.tolist()


def require_route(version: ServedVersion, route: str) -> None:
    """A model slice answers only its routes (retrieval/slices.py); a whole model all."""
    info = version.manifest.data.get("slice")
    if info is not None and route not in info["routes"]:
        answers = ", ".join(f"/{r}" for r in info["routes"]) or "no scoring route"
        raise BadRequest(f"/{route}: this server serves model slice {info['name']!r}, "
                         f"which answers {answers}", 404)


def create_app(engine: ServingEngine, *, model_name: str = "terarec",
               max_candidates: int = 1000, max_body_bytes: int = 4 << 20,
               poll_interval_s: float | None = None,
               batcher: DynamicBatcher | None = None,
               index: Any = None, max_top_k: int = 1000) -> ServingApp:
    """The ASGI app. With ``poll_interval_s`` the engine follows new versions while the
    app runs (started and stopped with the app's lifespan). Requests in flight together
    are scored in one pass by ``batcher`` (by default one over ``engine.score_batch``
    with its default limits)."""
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
        return openapi_document(model_name, features, __version__,
                                max_top_k=None if index is None else max_top_k)

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

        return {"name": "terarec", "version": __version__,
                "extensions": ["binary_tensor_data"]}

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

    async def infer(scope: Scope, receive: Receive) -> dict[str, Any]:
        version = served_model(scope["path"].split("/")[3])
        raw = await _read_body(scope, receive, max_body_bytes)
        header = _header(scope, binary.HEADER.encode())
        if header is None:
            body = _parse(InferRequest, raw)
            if "top_k" in body.parameters:  # retrieval (serving/retrieve.py)
                from terarec.serving.retrieve import infer_top_k

                return await infer_top_k(engine, index, version, body, model_name,
                                         max_top_k)
            require_route(version, "predict")
            columns, rows = _kserve_columns(body, version, max_candidates)
            request_id = body.id
        else:
            require_route(version, "predict")
            columns, rows, request_id = _binary_columns(raw, header, version,
                                                        max_candidates)
        batch = _columns_request_batch(version, columns, rows)
        scores = await _scores(batcher, version, batch, "row")
        out: dict[str, Any] = {
            "model_name": model_name, "model_version": str(version.version),
            "outputs": [{"name": OUTPUT_NAME, "datatype": "FP32", "shape": [len(scores)],
                         "data": scores}]}
        if request_id is not None:
            out["id"] = request_id
        return out

    async def predict(scope: Scope, receive: Receive) -> dict[str, Any]:
        version = engine.served()
        require_route(version, "predict")
        raw = await _read_body(scope, receive, max_body_bytes)
        context, candidates, names = _decode_predict(raw, version, max_candidates)
        batch = _request_batch(version, context, candidates, "candidates", names)
        scores = await _scores(batcher, version, batch, "candidates")
        return {"model": model_name, "version": version.version, "scores": scores}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(engine.metrics.registry),
                        media_type=CONTENT_TYPE_LATEST)

    if index is not None:  # an item index (retrieval/index.py): POST /retrieve
        from terarec.serving.retrieve import add_retrieve_routes

        add_retrieve_routes(app, engine, index, model_name=model_name,
                            max_body_bytes=max_body_bytes, max_top_k=max_top_k,
                            batcher=batcher)

    app.add_middleware(_Timing, metrics=engine.metrics)  # times the other routes
    app.set_scoring_routes([(_ROUTES[0][0], "infer", infer),
                            (_ROUTES[3][0], "predict", predict)], engine.metrics)
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


def _kserve_columns(body: InferRequest, version: ServedVersion, max_candidates: int
                    ) -> tuple[dict[str, Any], int]:
    """Columns of a v2 inference request: one input tensor per feature, shape [N] or
    [N, 1], all with the same N; and N."""
    _check_outputs(body.outputs)
    columns: dict[str, Any] = {}
    rows = None
    for i, tensor in enumerate(body.inputs):
        name, shape, data = tensor.name, tensor.shape, tensor.data
        where = _check_tensor(i, name, tensor.datatype, shape, columns, version)
        if len(data) and isinstance(data[0], list) and len(shape) == 2:
            if not all(isinstance(row, list) and len(row) == 1 for row in data):
                raise BadRequest(f"{where}: nested 'data' must hold one value per row")
            data = [row[0] for row in data]
        if shape[0] != len(data):
            raise BadRequest(f"{where}: shape {shape} does not match {len(data)} values")
        _check_data(where, tensor.datatype, data)
        rows = _check_rows(where, shape[0], rows, max_candidates)
        columns[name] = data
    assert rows is not None  # InferRequest holds one input at least
    return columns, rows


def _check_outputs(outputs: list[dict[str, Any]]) -> None:
    if any(o.get("name") != OUTPUT_NAME for o in outputs):
        raise BadRequest(f"'outputs' may only request the output {OUTPUT_NAME!r}")


def _check_tensor(i: int, name: str, datatype: str, shape: list[int],
                  columns: Mapping[str, Any], version: ServedVersion) -> str:
    """``inputs[i]`` names a feature, once, with a known datatype and a [N] / [N, 1]
    shape; returns how errors about it name it."""
    if name not in version.feature_set:
        raise BadRequest(f"inputs[{i}]: unknown input {name!r}; the model's inputs are "
                         f"{list(version.feature_names)}")
    where = f"input {name!r}"
    if name in columns:
        raise BadRequest(f"{where} given twice")
    if datatype not in KSERVE_DATATYPES:
        raise BadRequest(f"{where}: unknown datatype {datatype!r}")
    if not shape or len(shape) > 2 or (len(shape) == 2 and shape[1] != 1):
        raise BadRequest(f"{where}: shape must be [N] or [N, 1], got {shape!r}")
    return where


# The JSON values each datatype's 'data' may hold (null: a missing value). An INT64 tensor
# holding 1.5 or a BOOL one holding 3 was read as the number it held.
_DATA_TYPES: dict[str, frozenset[type]] = {
    **{d: frozenset({int, type(None)}) for d in KSERVE_DATATYPES if "INT" in d},
    "BOOL": frozenset({bool, type(None)}),
    **{d: frozenset({int, float, type(None)}) for d in ("FP16", "FP32", "FP64")},
    "BYTES": frozenset({str, int, type(None)})}


# The values an integer datatype holds: UINT8 300 or INT64 2**70 was read as that number.
_INT_RANGES = {d: (int(np.iinfo(d.lower()).min), int(np.iinfo(d.lower()).max))
               for d in KSERVE_DATATYPES if "INT" in d}


def _check_data(where: str, datatype: str, data: list[Any]) -> None:
    """Every value of a JSON tensor is of its datatype (integers within its range)."""
    allowed = _DATA_TYPES[datatype]
    low, high = _INT_RANGES.get(datatype, (None, None))
    if {type(v) for v in data} <= allowed:
        numbers = [v for v in data if v is not None] if low is not None else None
        if not numbers or low <= min(numbers) and max(numbers) <= high:
            return
    i, v = next((i, v) for i, v in enumerate(data) if type(v) not in allowed
                or (low is not None and v is not None and not low <= v <= high))
    raise BadRequest(f"{where}: data[{i}] is {json_type(v)} {orjson.dumps(v).decode()[:60]}, "
                     f"not a {datatype} value")


def _check_rows(where: str, n: int, rows: int | None, max_candidates: int) -> int:
    if rows is None:
        if n < 1:
            raise BadRequest(f"{where}: no rows")
        if n > max_candidates:
            raise BadRequest(f"{n} rows exceed the limit of {max_candidates}", 413)
        return n
    if n != rows:
        raise BadRequest(f"{where}: {n} rows, other inputs have {rows}")
    return rows


@dataclass
class BinaryInput:
    """An input tensor whose values follow the JSON header as raw bytes."""

    __pydantic_config__ = STRICT

    name: str
    shape: list[int]
    datatype: str
    parameters: dict[str, Any]


@dataclass
class BinaryInferRequest:
    """The JSON header of a v2 request with binary tensor data."""

    __pydantic_config__ = STRICT

    inputs: Annotated[list[BinaryInput], Field(
        min_length=1, description="a non-empty array of input tensors")]
    id: str | None = None
    outputs: list[dict[str, Any]] = field(default_factory=list)
    parameters: dict[str, Any] = field(default_factory=dict)


def _binary_columns(raw: bytes, header: str, version: ServedVersion, max_candidates: int
                    ) -> tuple[dict[str, Any], int, str | None]:
    """Columns of a request with binary tensor data (``binary``): the JSON header's
    first ``header`` bytes, then each input's ``binary_data_size`` bytes in order."""
    try:
        size = int(header)
    except ValueError:
        size = -1
    if not 0 < size <= len(raw):
        raise BadRequest(f"bad {binary.HEADER} header {header!r}: the body has "
                         f"{len(raw)} bytes", 400)
    body = _parse(BinaryInferRequest, raw[:size])
    _check_outputs(body.outputs)
    data = memoryview(raw)[size:]
    columns: dict[str, Any] = {}
    rows, start = None, 0
    for i, tensor in enumerate(body.inputs):
        name, shape = tensor.name, tensor.shape
        where = _check_tensor(i, name, tensor.datatype, shape, columns, version)
        nbytes = tensor.parameters.get("binary_data_size")
        if type(nbytes) is not int or nbytes < 0:
            raise BadRequest(f"{where}: parameters.binary_data_size must be a byte count, "
                             f"got {nbytes!r}")
        rows = _check_rows(where, shape[0], rows, max_candidates)
        chunk = data[start:start + nbytes]
        if len(chunk) != nbytes:
            raise BadRequest(f"{where}: binary_data_size {nbytes} runs past the end of the "
                             f"body ({len(data) - start} bytes left)", 400)
        start += nbytes
        try:
            if tensor.datatype == "BYTES":
                col = binary.bytes_tensor(chunk, rows)
                if name in version.numeric_names:
                    col = col.cast(pa.string())  # numeric text must be UTF-8
            else:
                col = binary.fixed_tensor(chunk, tensor.datatype, rows)
        except (binary.BinaryTensorError, pa.ArrowException) as exc:
            raise BadRequest(f"{where}: {exc}") from None
        columns[name] = col
    if start != len(data):
        raise BadRequest(f"the body holds {len(data)} bytes of tensor data, the inputs "
                         f"declare {start}", 400)
    assert rows is not None
    return columns, rows, body.id
