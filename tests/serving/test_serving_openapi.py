"""schemathesis against the running server's own OpenAPI document: cases generated from
every operation (valid ones and, on request bodies, deliberately invalid ones) get no
5xx, and every answer matches the document (status code, content type, body schema;
for a 200 that means finite scores in [0, 1])."""

from __future__ import annotations

import json
import urllib.request

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)
from serving_helpers import SCHEMA, ServerThread

from terarec.serving.app import create_app
from terarec.serving.engine import ServingEngine

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance,
          response_schema_conformance]


@pytest.fixture(scope="module")
def server(live_run):
    engine = ServingEngine(live_run.export)
    engine.refresh()
    with ServerThread(create_app(engine, max_candidates=4)) as s:
        yield s


def test_the_document_names_the_served_features(server):
    with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/openapi.json") as r:
        doc = json.loads(r.read())
    row = doc["components"]["schemas"]["PredictRequest"]["properties"]["candidates"]["items"]
    assert sorted(row["properties"]) == sorted(f.name for f in SCHEMA.fields)
    assert row["additionalProperties"] is False
    assert set(doc["paths"]) >= {"/predict", "/v2/models/{name}/infer", "/metrics"}


def test_schemathesis_finds_no_5xx_and_no_answer_off_the_document(server):
    base = f"http://127.0.0.1:{server.port}"
    schema = schemathesis.openapi.from_url(f"{base}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) == 8
    calls: dict[str, list[int]] = {}
    for operation in operations:
        modes = [schemathesis.GenerationMode.POSITIVE]
        if "requestBody" in operation.definition.raw:
            modes.append(schemathesis.GenerationMode.NEGATIVE)
        for mode in modes:
            @settings(max_examples=40 if "requestBody" in operation.definition.raw else 5,
                      deadline=None, derandomize=True, database=None,
                      suppress_health_check=list(HealthCheck))
            @given(case=operation.as_strategy(generation_mode=mode))
            def run(case) -> None:
                response = case.call(base_url=base)
                case.validate_response(response, checks=CHECKS)
                calls.setdefault(case.operation.label, []).append(response.status_code)

            run()
    # Valid /predict bodies were scored, not only refused (a v2 tensor's shape must match
    # its data's length, which a schema cannot say: those cases are refused with a 4xx).
    assert calls["POST /predict"].count(200) >= 5
    assert len(calls["POST /v2/models/{name}/infer"]) >= 40
    assert all(code < 500 for codes in calls.values() for code in codes)
