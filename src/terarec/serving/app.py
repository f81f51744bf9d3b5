"""HTTP front of the serving engine: Open Inference Protocol (KServe v2) routes, a plain
JSON ``/predict`` and Prometheus ``/metrics``.

Requests are parsed by hand rather than by pydantic models so that every bad input gets
a 4xx whose message names the offending field (``candidates[3].C7: ...``), never a 500.
Bodies are read with a byte cap (413 past it).

``/predict`` takes raw feature values: one ``context`` (user, page) shared by ``N``
``candidates`` (items); each candidate is merged with the context and hashed with the
model's saved schema, exactly as training hashed its files::

    {"context": {"C1": "u42", "I1": 3}, "candidates": [{"C3": "item7"}, {"C3": "item9"}]}
    -> {"model": "terarec", "version": 3, "scores": [0.031, 0.207]}
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Mapping
from contextlib import asynccontextmanager
from typing import Any

import pyarrow as pa
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from terarec.data.readers import DataError
from terarec.finite import NonFiniteError, check_scores
from terarec.serving.engine import NoVersionError, ServedVersion, ServingEngine

log = logging.getLogger(__name__)

KSERVE_DATATYPES = {"BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32",
                    "INT64", "FP16", "FP32", "FP64", "BYTES"}
OUTPUT_NAME = "score"
_ROUTES = [(re.compile(r"^/v2/models/[^/]+/infer$"), "infer"),
           (re.compile(r"^/v2/models/[^/]+(/ready)?$"), "model"),
           (re.compile(r"^/v2(/health/(live|ready))?$"), "health"),
           (re.compile(r"^/predict$"), "predict"), (re.compile(r"^/metrics$"), "metrics")]


class BadRequest(Exception):
    """A request the server will not score; becomes ``{"error": message}``."""

    def __init__(self, message: str, status: int = 422) -> None:
        super().__init__(message)
        self.status = status


def _route_label(path: str) -> str:
    return next((label for pattern, label in _ROUTES if pattern.match(path)), "other")


class _Timing:
    """ASGI middleware: latency histogram and status counts per route."""

    def __init__(self, app, metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500

        async def send_wrapper(message) -> None:
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


async def _read_json(request: Request, max_bytes: int) -> Any:
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
        return json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BadRequest(f"malformed JSON: {exc}", 400) from None
    except RecursionError:
        raise BadRequest("malformed JSON: nested too deeply", 400) from None


def _type_name(value: Any) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", int: "number",
            float: "number", type(None): "null"}.get(type(value), type(value).__name__)


def _check_features(features: Any, where: str, version: ServedVersion) -> Mapping[str, Any]:
    if not isinstance(features, dict):
        raise BadRequest(f"{where} must be an object of feature values, got "
                         f"{_type_name(features)}")
    if not features.keys() <= version.feature_set:
        unknown = [k for k in features if k not in version.feature_set]
        raise BadRequest(f"{where}: unknown feature(s) {unknown}; the model's features are "
                         f"{list(version.feature_names)}")
    return features


def _score(engine: ServingEngine, version: ServedVersion, context: Mapping[str, Any],
           candidates: list[dict], where: str) -> list[float]:
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
    async def lifespan(app: FastAPI):
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
        body = await _read_json(request, max_body_bytes)
        records, request_id = _kserve_records(body, version, max_candidates)
        scores = _score(engine, version, {}, records, "row")
        out = {"model_name": model_name, "model_version": str(version.version),
               "outputs": [{"name": OUTPUT_NAME, "datatype": "FP32", "shape": [len(scores)],
                            "data": scores}]}
        if request_id is not None:
            out["id"] = request_id
        return out

    @app.post("/predict")
    async def predict(request: Request) -> dict:
        version = engine.served()
        body = await _read_json(request, max_body_bytes)
        context, candidates = _predict_request(body, version, max_candidates)
        scores = _score(engine, version, context, candidates, "candidates")
        return {"model": model_name, "version": version.version, "scores": scores}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(engine.metrics.registry),
                        media_type=CONTENT_TYPE_LATEST)

    return app


def _predict_request(body: Any, version: ServedVersion,
                     max_candidates: int) -> tuple[Mapping[str, Any], list[dict]]:
    if not isinstance(body, dict):
        raise BadRequest(f"request must be a JSON object with 'candidates' (and optionally "
                         f"'context'), got {_type_name(body)}")
    extra = sorted(set(body) - {"context", "candidates"})
    if extra:
        raise BadRequest(f"unknown request field(s) {extra}; expected 'context' and "
                         "'candidates'")
    if "candidates" not in body:
        raise BadRequest("missing field 'candidates': a list of feature objects")
    context = _check_features(body.get("context", {}), "context", version)
    candidates = body["candidates"]
    if not isinstance(candidates, list):
        raise BadRequest(f"'candidates' must be an array, got {_type_name(candidates)}")
    if not candidates:
        raise BadRequest("'candidates' is empty; send at least one")
    if len(candidates) > max_candidates:
        raise BadRequest(f"{len(candidates)} candidates exceed the limit of {max_candidates}",
                         413)
    for i, cand in enumerate(candidates):
        _check_features(cand, f"candidates[{i}]", version)
        if not context.keys().isdisjoint(cand):
            both = [k for k in cand if k in context]
            raise BadRequest(f"candidates[{i}]: feature(s) {both} also given in 'context'")
    return context, candidates


def _kserve_records(body: Any, version: ServedVersion,
                    max_candidates: int) -> tuple[list[dict], Any]:
    """Rows from a v2 inference request: one input tensor per feature, shape [N] or
    [N, 1], all with the same N."""
    if not isinstance(body, dict):
        raise BadRequest(f"request must be a JSON object with 'inputs', got "
                         f"{_type_name(body)}")
    extra = sorted(set(body) - {"id", "inputs", "outputs", "parameters"})
    if extra:
        raise BadRequest(f"unknown request field(s) {extra}; expected 'inputs' (and "
                         "optionally 'id', 'outputs', 'parameters')")
    if "inputs" not in body:
        raise BadRequest("missing field 'inputs': a list of input tensors")
    inputs = body["inputs"]
    if not isinstance(inputs, list) or not inputs:
        raise BadRequest("'inputs' must be a non-empty array of input tensors")
    outputs = body.get("outputs", [])
    if not isinstance(outputs, list) or any(
            not isinstance(o, dict) or o.get("name") != OUTPUT_NAME for o in outputs):
        raise BadRequest(f"'outputs' may only request the output {OUTPUT_NAME!r}")
    columns: dict[str, list] = {}
    rows = None
    known = version.feature_names
    for i, tensor in enumerate(inputs):
        where = f"inputs[{i}]"
        if not isinstance(tensor, dict):
            raise BadRequest(f"{where} must be an object, got {_type_name(tensor)}")
        missing = [k for k in ("name", "shape", "datatype", "data") if k not in tensor]
        if missing:
            raise BadRequest(f"{where}: missing field(s) {missing}")
        extra = sorted(set(tensor) - {"name", "shape", "datatype", "data", "parameters"})
        if extra:
            raise BadRequest(f"{where}: unknown field(s) {extra}")
        name, shape, datatype, data = (tensor[k] for k in ("name", "shape", "datatype", "data"))
        if not isinstance(name, str) or name not in version.feature_set:
            raise BadRequest(f"{where}: unknown input {name!r}; the model's inputs are "
                             f"{list(known)}")
        where = f"input {name!r}"
        if name in columns:
            raise BadRequest(f"{where} given twice")
        if datatype not in KSERVE_DATATYPES:
            raise BadRequest(f"{where}: unknown datatype {datatype!r}")
        if (not isinstance(shape, list) or not shape or len(shape) > 2
                or not all(isinstance(s, int) and not isinstance(s, bool) for s in shape)
                or (len(shape) == 2 and shape[1] != 1)):
            raise BadRequest(f"{where}: shape must be [N] or [N, 1], got {shape!r}")
        if not isinstance(data, list):
            raise BadRequest(f"{where}: 'data' must be an array, got {_type_name(data)}")
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
    assert rows is not None
    names = list(columns)
    records = [dict(zip(names, values, strict=True)) for values in zip(*columns.values(),
                                                                      strict=True)]
    return records, body.get("id")
