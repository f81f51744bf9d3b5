"""Hostile request bodies (hypothesis) against the app: every answer is a 200 with one
finite score per row or a 4xx naming the problem, never a 500."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from serving_helpers import SCHEMA, app_client

FEATURES = [f.name for f in SCHEMA.fields]
SETTINGS = settings(max_examples=150, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])

scalars = (st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False)
           | st.text(max_size=20) | st.integers(min_value=10**30, max_value=10**40))
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=5), inner, max_size=4),
                           max_leaves=12)
feature_dicts = st.dictionaries(st.sampled_from(FEATURES) | st.text(max_size=4),
                                json_values, max_size=6)
predict_bodies = (st.fixed_dictionaries({"candidates": st.lists(feature_dicts, max_size=5)},
                                        optional={"context": feature_dicts | json_values,
                                                  "extra": json_values})
                  | json_values)


@pytest.fixture(scope="module")
def client(live_run):
    with app_client(live_run.export, max_candidates=4) as c:
        yield c


def _check(response, rows: int | None = None) -> None:
    assert response.status_code < 500, response.text
    body = response.json()
    if response.status_code == 200:
        scores = body["scores"] if "scores" in body else body["outputs"][0]["data"]
        assert rows is None or len(scores) == rows
        assert all(isinstance(s, float) and math.isfinite(s) for s in scores), scores
    else:
        assert 400 <= response.status_code < 500 and body["error"]


@SETTINGS
@given(body=predict_bodies)
def test_predict_bodies(client, body):
    response = client.post("/predict", content=json.dumps(body),
                           headers={"Content-Type": "application/json"})
    rows = len(body["candidates"]) if isinstance(body, dict) and isinstance(
        body.get("candidates"), list) else None
    _check(response, rows)


@SETTINGS
@given(raw=st.binary(max_size=200) | st.text(max_size=200).map(str.encode))
def test_raw_bytes(client, raw):
    for path in ("/predict", "/v2/models/terarec/infer"):
        _check(client.post(path, content=raw, headers={"Content-Type": "application/json"}))


@SETTINGS
@given(inputs=st.lists(st.fixed_dictionaries({
    "name": st.sampled_from(FEATURES) | st.text(max_size=4),
    "shape": st.lists(st.integers(-2, 5), max_size=3) | json_values,
    "datatype": st.sampled_from(["BYTES", "INT64", "FP32", "nope"]),
    "data": st.lists(scalars, max_size=5) | json_values}), max_size=4))
def test_infer_bodies(client, inputs):
    response = client.post("/v2/models/terarec/infer", content=json.dumps({"inputs": inputs}),
                           headers={"Content-Type": "application/json"})
    _check(response)


@pytest.mark.parametrize("raw", [b'{"candidates": [{"I1": ' + b"9" * 5000 + b"}]}",
                                 b'{"candidates": [{"C1": ' + b"1" * 4301 + b"}]}",
                                 b'{"candidates": [{"I1": 1e999999}]}'],
                         ids=["5000-digit number", "4301-digit category", "1e999999"])
def test_numbers_past_what_json_converts_answer_4xx(client, raw):
    response = client.post("/predict", content=raw,
                           headers={"Content-Type": "application/json"})
    assert response.status_code in (400, 422), response.text
    error = response.json()["error"]
    assert "number" in error or "digits" in error or "finite" in error, error
