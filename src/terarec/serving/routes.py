"""What the routes do: the scoring routes (``POST /predict`` and ``POST
/v2/models/NAME/infer``), the v2 health and metadata routes, and the request checks the
scoring routes share with ``/retrieve`` (``serving/retrieve.py``).

``/predict`` takes raw feature values: one ``context`` (user, page) shared by ``N``
``candidates`` (items); each candidate is merged with the context and hashed with the
model's saved schema, exactly as training hashed its files::

    {"context": {"C1": "u42", "I1": 3}, "candidates": [{"C3": "item7"}, {"C3": "item9"}]}
    -> {"model": "terarec", "version": 3, "scores": [0.031, 0.207]}

A model of several labels also answers ``"task_scores": {"click": [...], "conversion":
[...]}`` (``"scores"`` is then the first task's), and ``/infer`` one output per task.

Every scoring request goes through one ``DynamicBatcher``, which scores the requests in
flight together in one pass (``serving/batching.py``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import KW_ONLY, dataclass
from typing import Any

import pyarrow as pa
from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from terarec.data.readers import DataError, batch_from_columns
from terarec.finite import NonFiniteError, check_scores
from terarec.serving import binary, kserve
from terarec.serving.asgi import Receive, Scope, header, read_body
from terarec.serving.batching import DynamicBatcher, QueueFull
from terarec.serving.engine import ServedVersion, ServingEngine
from terarec.serving.errors import BadRequest
from terarec.serving.features import columns_batch, relabel
from terarec.serving.schemas import InferRequest, PredictRequest, decode
from terarec.types import Batch

# A v2 request with parameters.top_k: (version, body) -> its answer (serving/retrieve.py).
TopK = Callable[[ServedVersion, InferRequest], Awaitable[dict[str, Any]]]


def check_features(features: Mapping[str, Any], where: str,
                   version: ServedVersion) -> Mapping[str, Any]:
    """``features`` if the served model knows each of them; else a 422 naming those it
    does not."""
    if not features.keys() <= version.feature_set:
        unknown = [k for k in features if k not in version.feature_set]
        raise BadRequest(f"{where}: unknown feature(s) {unknown}; the model's features are "
                         f"{list(version.feature_names)}")
    return features


def require_route(version: ServedVersion, route: str) -> None:
    """A model slice answers only its routes (retrieval/slices.py); a whole model all."""
    info = version.manifest.data.get("slice")
    if info is not None and route not in info["routes"]:
        answers = ", ".join(f"/{r}" for r in info["routes"]) or "no scoring route"
        raise BadRequest(f"/{route}: this server serves model slice {info['name']!r}, "
                         f"which answers {answers}", 404)


def predict_rows(body: PredictRequest, version: ServedVersion, max_candidates: int
                 ) -> tuple[Mapping[str, Any], list[dict[str, Any]], frozenset[str]]:
    """The body's context and candidates, checked against the served model, and the
    candidates' feature names (the conversion needs them): whole-request set
    operations; the per-candidate walk only words an error they found."""
    context, candidates = body.context, body.candidates
    if len(candidates) > max_candidates:
        raise BadRequest(f"{len(candidates)} candidates exceed the limit of {max_candidates}",
                         413)
    names = frozenset().union(*candidates)
    allowed = version.feature_set
    if names <= allowed and context.keys() <= allowed and names.isdisjoint(context):
        return context, candidates, names
    check_features(context, "context", version)
    for i, cand in enumerate(candidates):
        check_features(cand, f"candidates[{i}]", version)
        if not context.keys().isdisjoint(cand):
            both = [k for k in cand if k in context]
            raise BadRequest(f"candidates[{i}]: feature(s) {both} also given in 'context'")
    raise AssertionError("unreachable: a name check failed, the walk found nothing")


def request_batch(version: ServedVersion, context: Mapping[str, Any],
                  candidates: list[dict[str, Any]], where: str,
                  row_names: frozenset[str] | None = None) -> Batch:
    """The Batch of the rows ``{**context, **c}``; a bad value is a 422 naming
    ``where[i]`` and the field."""
    try:
        return version.batch(context, candidates, row_names)
    except (DataError, ValueError, TypeError, pa.ArrowException) as exc:
        message = str(exc).replace("candidates[", f"{where}[", 1)
        raise BadRequest(message) from None


def columns_request_batch(version: ServedVersion, columns: dict[str, Any], rows: int
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
    return request_batch(version, {}, records, "row")


def _binary_batch_error(version: ServedVersion, columns: dict[str, Any], rows: int
                        ) -> Batch:
    """``batch_from_columns`` on binary tensors, its errors as 422s naming the row."""
    try:
        return batch_from_columns(columns, rows, version.schema)
    except (DataError, ValueError, TypeError, OverflowError, pa.ArrowException) as exc:
        raise BadRequest(relabel(str(exc), "row")) from None


async def scores(batcher: DynamicBatcher, version: ServedVersion, batch: Batch,
                 where: str) -> list[Any]:
    """The batch's scores (rows of one score per task for a model of several labels),
    scored together with the requests in flight (503 when the
    batcher's queue is full, 422 naming ``where`` for a score that is not finite)."""
    try:
        out = await batcher.score(version, batch)
    except QueueFull as exc:
        raise BadRequest(f"server overloaded: {exc}; retry later", 503) from None
    try:
        check_scores(out)
    except NonFiniteError as exc:
        raise BadRequest(f"{where}: {exc}") from None
    return list(out.tolist())


@dataclass
class ScoringRoutes:
    """``POST /predict`` and ``POST /v2/models/NAME/infer`` as plain ASGI handlers:
    ``(scope, receive)`` -> the JSON answer of a 200 (``ServingApp`` sends it)."""

    engine: ServingEngine
    batcher: DynamicBatcher
    _: KW_ONLY
    model_name: str
    max_candidates: int
    max_body_bytes: int
    top_k: TopK

    def served_model(self, name: str) -> ServedVersion:
        """The served version, if ``name`` is this server's model (404 if not)."""
        if name != self.model_name:
            raise BadRequest(f"unknown model {name!r}; this server serves "
                             f"{self.model_name!r}", 404)
        return self.engine.served()

    async def predict(self, scope: Scope, receive: Receive) -> dict[str, Any]:
        version = self.engine.served()
        require_route(version, "predict")
        raw = await read_body(scope, receive, self.max_body_bytes)
        context, candidates, names = predict_rows(decode(PredictRequest, raw), version,
                                                  self.max_candidates)
        batch = request_batch(version, context, candidates, "candidates", names)
        out = await scores(self.batcher, version, batch, "candidates")
        answer = {"model": self.model_name, "version": version.version, "scores": out}
        tasks = version.schema.task_names
        if len(tasks) > 1:  # several labels: "scores" is the first task's, as one had it
            answer["scores"] = [row[0] for row in out]
            answer["task_scores"] = {name: [row[t] for row in out]
                                     for t, name in enumerate(tasks)}
        return answer

    async def infer(self, scope: Scope, receive: Receive) -> dict[str, Any]:
        version = self.served_model(scope["path"].split("/")[3])
        raw = await read_body(scope, receive, self.max_body_bytes)
        binary_header = header(scope, binary.HEADER.encode())
        requested = None
        if binary_header is None:
            body = decode(InferRequest, raw)
            requested = body.outputs
            if "top_k" in body.parameters:  # retrieval (serving/retrieve.py)
                return await self.top_k(version, body)
            require_route(version, "predict")
            columns, rows = kserve.json_columns(body, version, self.max_candidates)
            request_id = body.id
        else:
            require_route(version, "predict")
            columns, rows, request_id = kserve.binary_columns(
                raw, binary_header, version, self.max_candidates)
        batch = columns_request_batch(version, columns, rows)
        out = await scores(self.batcher, version, batch, "row")
        return kserve.score_answer(self.model_name, version, out, request_id, requested)


def add_v2_routes(app: FastAPI, engine: ServingEngine, scoring: ScoringRoutes) -> None:
    """The v2 health and metadata routes and ``GET /metrics``."""
    model_name = scoring.model_name

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
        return kserve.model_metadata(scoring.served_model(name), model_name)

    @app.get("/v2/models/{name}/ready")
    async def model_ready(name: str) -> JSONResponse:
        if name != model_name:
            raise BadRequest(f"unknown model {name!r}; this server serves {model_name!r}",
                             404)
        ok = engine.current is not None
        return JSONResponse({"name": model_name, "ready": ok}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(engine.metrics.registry),
                        media_type=CONTENT_TYPE_LATEST)
