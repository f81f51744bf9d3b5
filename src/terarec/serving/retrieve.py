"""``POST /retrieve``: a user's features in, the top-k items of the faiss index out.

::

    {"context": {"user": "u42"}, "top_k": 100}
    -> {"model": "terarec", "version": 3, "index": "g000002",
        "items": ["7010", "13202", ...], "scores": [0.93, 0.91, ...]}

The user vector comes from the served version's user tower (a whole DSSM or its
``user_tower`` slice); ``scores`` are inner products with the item vectors (cosine
similarities for ``tower_similarity = "cosine"``). With ``"rank": true`` and a whole model
served, the retrieved items are scored by that model in the same process (through the
same batcher as ``/predict``) and returned best first, with ``rank_scores``. Bodies are
read and validated as ``/predict``'s are: errors name the JSON path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any

import msgspec
import numpy as np
import torch
from fastapi import FastAPI, Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from terarec.finite import NonFiniteError, check_scores
from terarec.models.dssm import DSSM
from terarec.retrieval.faiss_import import import_faiss
from terarec.retrieval.index import IndexWatcher, ItemIndex
from terarec.serving import routes
from terarec.serving.asgi import read_body
from terarec.serving.batching import DynamicBatcher
from terarec.serving.engine import ServedVersion, ServingEngine
from terarec.serving.errors import BadRequest
from terarec.serving.kserve import check_data, check_datatype
from terarec.serving.routes import check_features, request_batch, require_route
from terarec.serving.schemas import Features, InferRequest, decode, encode

DEFAULT_TOP_K = 100
RETRIEVAL_OUTPUTS = ("items", "scores")

if TYPE_CHECKING:
    import faiss
else:  # its loader's lines about builds it lacks are debug events, not errors
    faiss = import_faiss()


class RetrieveRequest(msgspec.Struct, forbid_unknown_fields=True):
    """``/retrieve`` body."""

    context: Annotated[Features, msgspec.Meta(description="the user's feature values")]
    # None: DEFAULT_TOP_K, or the server's limit where that is lower
    top_k: Annotated[int, msgspec.Meta(ge=1, description="how many items to return")] \
        | None = None
    rank: bool = False


def _user_tower(version: ServedVersion) -> DSSM:
    require_route(version, "retrieve")
    if not isinstance(version.model, DSSM):
        raise BadRequest(f"/retrieve needs a dssm model (two towers); this server serves "
                         f"{type(version.model).__name__}", 404)
    return version.model


@torch.no_grad()
def user_vector(engine: ServingEngine, version: ServedVersion,
                context: dict[str, Any], where: str = "context") -> np.ndarray:
    """``[1, K]`` user vector of one request's user features; errors name them as
    ``where`` (the /retrieve body's ``context``, a v2 request's ``inputs``)."""
    model = _user_tower(version)
    context = dict(check_features(context, where, version))
    item_side = [k for k in context if k in model.item_fields]
    if item_side:
        raise BadRequest(f"{where}.{item_side[0]}: an item-side feature; /retrieve takes "
                         f"the user's features {list(model.user_fields)}")
    batch = request_batch(version, context, [{}], where)
    emb = engine.pooled(batch, version)
    vector = model.user_embedding(batch.dense, emb.index_select(1, model.user_index))
    out = vector.numpy()
    if not np.isfinite(out).all():
        raise BadRequest(f"{where}: the user vector is not finite")
    return out


def watcher_of(index: ItemIndex | IndexWatcher) -> IndexWatcher:
    """``serve --index`` passes a watcher (it follows new generations); a loaded
    ``ItemIndex`` is searched as it is."""
    return index if isinstance(index, IndexWatcher) else IndexWatcher.fixed(index)


async def _search(engine: ServingEngine, index: ItemIndex, version: ServedVersion,
                  context: dict[str, Any], top_k: int, where: str = "context"
                  ) -> tuple[np.ndarray, np.ndarray]:
    """(item positions, inner products) of the user's ``top_k`` nearest items."""
    vector = user_vector(engine, version, context, where)
    if vector.shape[1] != index.dim:
        raise BadRequest(f"the user vector has {vector.shape[1]} values, the item index "
                         f"{index.dim}: the index was built from another model", 503)
    items, sims = await run_in_threadpool(index.search, vector, top_k)
    keep = items[0] >= 0
    return items[0][keep], sims[0][keep]


async def infer_top_k(engine: ServingEngine, index: ItemIndex | IndexWatcher | None,
                      version: ServedVersion, body: InferRequest, model_name: str,
                      max_top_k: int) -> dict[str, Any]:
    """A v2 inference request with ``parameters.top_k``: one user's features as inputs
    of shape [1] (or [1, 1]); outputs ``items`` (BYTES) and ``scores`` (FP32)."""
    top_k = body.parameters["top_k"]
    if type(top_k) is not int or not 1 <= top_k <= max_top_k:
        raise BadRequest(f"parameters.top_k: expected an integer from 1 to {max_top_k}, "
                         f"got {encode(top_k).decode()[:60]}")
    if index is None:
        raise BadRequest("parameters.top_k: this server has no item index (serve --index)",
                         404)
    if any(o.get("name") not in RETRIEVAL_OUTPUTS for o in body.outputs):
        raise BadRequest("'outputs' may only request the outputs 'items' and 'scores'")
    context: dict[str, Any] = {}
    for i, tensor in enumerate(body.inputs):
        if tensor.name not in version.feature_set:
            raise BadRequest(f"inputs[{i}]: unknown input {tensor.name!r}; the model's "
                             f"inputs are {list(version.feature_names)}")
        if tensor.name in context:
            raise BadRequest(f"inputs[{i}]: input {tensor.name!r} given twice")
        if tensor.shape not in ([1], [1, 1]) or len(tensor.data) != 1:
            raise BadRequest(f"inputs[{i}]: retrieval takes one user: shape [1] and one "
                             f"value, got shape {tensor.shape} and {len(tensor.data)} values")
        where = f"input {tensor.name!r}"
        check_datatype(where, tensor.datatype)
        value = tensor.data[0]
        if tensor.shape == [1, 1] and isinstance(value, list) and len(value) == 1:
            value = value[0]
        check_data(where, tensor.datatype, [value])  # as the scoring path checks it
        context[tensor.name] = value
    index = watcher_of(index).for_version(version.name)
    found, scores = await _search(engine, index, version, context, top_k, "inputs")
    try:
        check_scores(scores)
    except NonFiniteError as exc:
        raise BadRequest(f"scores: {exc}") from None
    out: dict[str, Any] = {
        "model_name": model_name, "model_version": str(version.version),
        "outputs": [{"name": "items", "datatype": "BYTES", "shape": [len(found)],
                     "data": index.ids[found].tolist()},
                    {"name": "scores", "datatype": "FP32", "shape": [len(found)],
                     "data": scores.tolist()}]}
    if body.id is not None:
        out["id"] = body.id
    return out


def add_retrieve_routes(app: FastAPI, engine: ServingEngine,
                        index: ItemIndex | IndexWatcher, *, model_name: str,
                        max_body_bytes: int, max_top_k: int,
                        batcher: DynamicBatcher) -> None:
    """Register ``POST /retrieve`` on ``app``, searching ``index``; a watcher is
    refreshed by the engine's version poller, right after each version check, so new
    generations are picked up while the server runs. Each search runs on one thread:
    requests run side by side, and an OpenMP team per single query costs more than it
    saves."""
    faiss.omp_set_num_threads(1)
    watcher = watcher_of(index)
    if watcher.out is not None:
        engine.poll_hooks.append(watcher.refresh)

    @app.post("/retrieve")
    async def retrieve(request: Request) -> Response:
        version = engine.served()
        index = watcher.for_version(version.name)  # one generation for the whole request
        raw = await read_body(request.scope, request.receive, max_body_bytes)
        body = decode(RetrieveRequest, raw)
        top_k = min(DEFAULT_TOP_K, max_top_k) if body.top_k is None else body.top_k
        if top_k > max_top_k:
            raise BadRequest(f"top_k: {top_k} exceeds the limit of {max_top_k}", 413)
        found, scores = await _search(engine, index, version, body.context, top_k)
        out: dict[str, Any] = {"model": model_name, "version": version.version,
                               "index": index.folder.name}
        if body.rank:
            if version.manifest.data.get("slice") is not None:
                raise BadRequest("rank: ranking needs the whole model; this server serves "
                                 f"slice {version.manifest.data['slice']['name']!r}", 422)
            records = index.records(found)
            batch = request_batch(version, body.context, records, "candidates")
            ranked = np.asarray(await routes.scores(batcher, version, batch, "candidates"))
            if ranked.ndim == 2:  # several labels: ranked by the first task's score
                ranked = ranked[:, 0]
            order = np.argsort(-ranked, kind="stable")
            found, scores = found[order], scores[order]
            out["rank_scores"] = ranked[order].tolist()
        try:
            check_scores(scores)
        except NonFiniteError as exc:
            raise BadRequest(f"scores: {exc}") from None
        out["items"] = index.ids[found].tolist()
        out["scores"] = scores.tolist()
        return Response(encode(out), media_type="application/json")
