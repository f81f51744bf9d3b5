"""The server's OpenAPI 3.1 document (``GET /openapi.json``).

Request bodies are described by the JSON Schema of the same types the app validates them
with (``PredictRequest``, ``InferRequest``, and ``RetrieveRequest`` where the server
has an item index), narrowed to the served model's features, so a
client or a schema-driven test (schemathesis: tests/serving/test_serving_openapi.py) sees
exactly what the server takes; every answer other than a 200 is ``{"error": ...}``.
"""

from __future__ import annotations

from typing import Any

import msgspec

from terarec.types import FieldSpec

_ERROR = {"type": "object", "required": ["error"], "additionalProperties": False,
          "properties": {"error": {"type": "string", "minLength": 1}}}
_ERRORS = {"default": {"description": "the request was not scored: why",
                       "content": {"application/json": {"schema": _ERROR}}}}
_VALUE = {"type": ["string", "number", "integer", "boolean", "array", "object", "null"]}
_FINITE_SCORES = {"type": "array", "items": {"type": "number", "minimum": 0, "maximum": 1}}


def _json(schema: dict[str, Any], description: str = "") -> dict[str, Any]:
    return {"description": description or "OK",
            "content": {"application/json": {"schema": schema}}}


def _object(required: dict[str, Any], optional: dict[str, Any] | None = None
            ) -> dict[str, Any]:
    return {"type": "object", "required": list(required),
            "properties": {**required, **(optional or {})}}


def _feature_value(spec: FieldSpec) -> dict[str, Any]:
    """What a request may send for one raw feature (docs/serving.md)."""
    if spec.kind == "numeric":
        return {"type": ["number", "string", "null"]}
    if spec.separator is not None:
        return {"type": ["array", "string", "null"],
                "items": {"type": ["string", "integer", "null"]}}
    return {"type": ["string", "integer", "null"]}


def _body_schemas(features: tuple[FieldSpec, ...] | None, max_top_k: int | None = None
                  ) -> dict[str, Any]:
    """components/schemas: the request types' JSON Schema, feature objects narrowed to
    ``features`` (names and value types) when a version is served."""
    from terarec.serving.schemas import InferRequest, PredictRequest

    types: list[type] = [PredictRequest, InferRequest]
    if max_top_k is not None:
        from terarec.serving.retrieve import RetrieveRequest

        types.append(RetrieveRequest)
    _, out = msgspec.json.schema_components(types, ref_template="#/components/schemas/{name}")
    if max_top_k is not None:
        from terarec.serving.retrieve import DEFAULT_TOP_K

        out["RetrieveRequest"]["properties"]["top_k"] = {
            "type": "integer", "minimum": 1, "maximum": max_top_k,
            "default": min(DEFAULT_TOP_K, max_top_k), "description": "how many items"}
    if features is not None:
        row = {"type": "object", "additionalProperties": False,
               "properties": {f.name: _feature_value(f) for f in features}}
        props = out["PredictRequest"]["properties"]
        props["candidates"]["items"] = row
        props["context"] = {**props["context"], **row}
        if max_top_k is not None:
            retrieve_props = out["RetrieveRequest"]["properties"]
            retrieve_props["context"] = {**retrieve_props["context"], **row}
        names = {"type": "string", "enum": [f.name for f in features]}
        out["InferInput"]["properties"]["name"] = names
    return out


def openapi_document(model_name: str, features: tuple[FieldSpec, ...] | None = None,
                     version: str = "", max_top_k: int | None = None) -> dict[str, Any]:
    """The document for a server serving ``model_name`` whose requests carry
    ``features`` (None before a version is loaded: any feature names); ``max_top_k``
    (None: no item index): ``POST /retrieve`` and ``parameters.top_k`` on infer."""
    name = {"name": "name", "in": "path", "required": True,
            "schema": {"type": "string", "enum": [model_name]}}
    ready = _object({"ready": {"type": "boolean"}})
    model_ready = _object({"name": {"type": "string"}, "ready": {"type": "boolean"}})
    tensor = _object({"name": {"type": "string"}, "datatype": {"type": "string"},
                      "shape": {"type": "array", "items": {"type": "integer"}}})
    model_meta = _object({"name": {"type": "string"},
                          "versions": {"type": "array", "items": {"type": "string"}},
                          "platform": {"type": "string"},
                          "inputs": {"type": "array", "items": tensor},
                          "outputs": {"type": "array", "items": tensor}})
    infer_out = _object({"model_name": {"type": "string"}, "model_version": {"type": "string"},
                         "outputs": {"type": "array", "items": _object({
                             "name": {"type": "string", "const": "score"},
                             "datatype": {"type": "string", "const": "FP32"},
                             "shape": {"type": "array", "items": {"type": "integer"}},
                             "data": _FINITE_SCORES})}},
                        {"id": {"type": "string"}})
    predict_out = _object({"model": {"type": "string"}, "version": {"type": "integer"},
                           "scores": _FINITE_SCORES})
    finite = {"type": "array", "items": {"type": "number"}}  # inner products: unbounded
    item_ids = {"type": "array", "items": {"type": "string"}}
    retrieve_out = _object({"model": {"type": "string"}, "version": {"type": "integer"},
                            "index": {"type": "string"}, "items": item_ids,
                            "scores": finite}, {"rank_scores": _FINITE_SCORES})
    if max_top_k is not None:  # parameters.top_k: item ids and their inner products
        top_k_out = _object({"model_name": {"type": "string"},
                             "model_version": {"type": "string"},
                             "outputs": {"type": "array", "items": _object({
                                 "name": {"type": "string", "enum": ["items", "scores"]},
                                 "datatype": {"type": "string", "enum": ["BYTES", "FP32"]},
                                 "shape": {"type": "array", "items": {"type": "integer"}},
                                 "data": {"type": "array",
                                          "items": {"type": ["string", "number"]}}})}},
                            {"id": {"type": "string"}})
        infer_out = {"anyOf": [infer_out, top_k_out]}

    def body(ref: str) -> dict[str, Any]:
        return {"required": True, "content": {"application/json": {
            "schema": {"$ref": f"#/components/schemas/{ref}"}}}}

    paths = {
        "/v2/health/live": {"get": {"responses": {
            "200": _json(_object({"live": {"type": "boolean", "const": True}}))}}},
        "/v2/health/ready": {"get": {"responses": {
            "200": _json(ready, "a version is loaded"),
            "503": _json(ready, "no version loaded yet")}}},
        "/v2": {"get": {"responses": {"200": _json(_object({
            "name": {"type": "string"}, "version": {"type": "string"},
            "extensions": {"type": "array"}}))}}},
        "/v2/models/{name}": {"get": {"parameters": [name], "responses": {
            "200": _json(model_meta), **_ERRORS}}},
        "/v2/models/{name}/ready": {"get": {"parameters": [name], "responses": {
            "200": _json(model_ready), "503": _json(model_ready, "no version loaded yet"),
            **_ERRORS}}},
        "/v2/models/{name}/infer": {"post": {"parameters": [name],
                                             "requestBody": body("InferRequest"),
                                             "responses": {"200": _json(infer_out),
                                                           **_ERRORS}}},
        "/predict": {"post": {"requestBody": body("PredictRequest"),
                              "responses": {"200": _json(predict_out), **_ERRORS}}},
        "/metrics": {"get": {"responses": {"200": {
            "description": "Prometheus text format",
            "content": {"text/plain": {"schema": {"type": "string"}}}}}}},
    }
    if max_top_k is not None:
        paths["/retrieve"] = {"post": {"requestBody": body("RetrieveRequest"),
                                       "responses": {"200": _json(retrieve_out), **_ERRORS}}}
    return {"openapi": "3.1.0",
            "info": {"title": "terarec", "version": version or "0"},
            "paths": paths, "components": {"schemas": _body_schemas(features, max_top_k)}}
