"""The request decoders (serving/schemas.py) against malformed bodies (hypothesis): deep,
mixed-type, truncated and garbled. Every one gets a 4xx whose message says where, never
a 500, and the server answers /v2/health/ready afterwards."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from serving_helpers import SCHEMA, app_client

NUMERIC = [f.name for f in SCHEMA.fields if f.kind == "numeric"]
CATEGORICAL = [f.name for f in SCHEMA.fields if f.kind != "numeric"]
FEATURES = NUMERIC + CATEGORICAL
SETTINGS = settings(max_examples=60, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])
PREDICT, INFER = "/predict", "/v2/models/terarec/infer"


@pytest.fixture(scope="module")
def client(live_run):
    with app_client(live_run.export, max_candidates=8) as c:
        yield c


def _post(client, path: str, raw: bytes):
    return client.post(path, content=raw, headers={"Content-Type": "application/json"})


def _refused(client, path: str, raw: bytes) -> str:
    """The 4xx answer's message; the server still answers ready after it."""
    response = _post(client, path, raw)
    assert 400 <= response.status_code < 500, (response.status_code, response.text[:300])
    error = response.json()["error"]
    assert error and "None" not in error
    assert client.get("/v2/health/ready").status_code == 200
    return str(error)


scalars = st.none() | st.integers(-10**6, 10**6) | st.floats(-1e6, 1e6) | st.text(max_size=8)
good_rows = st.dictionaries(st.sampled_from(FEATURES), scalars.filter(
    lambda v: not isinstance(v, float)) | st.text(max_size=8), max_size=4)


def _nested(depth: int, kind: str) -> bytes:
    """A JSON value nested ``depth`` levels deep: arrays or objects."""
    if kind == "array":
        return b"[" * depth + b"1" + b"]" * depth
    return b'{"a": ' * depth + b"1" + b"}" * depth


deep = st.builds(_nested, st.integers(3, 3000), st.sampled_from(["array", "object"]))
# No feature takes these: a boolean, an object, an array inside an array.
bad_values = (st.booleans() | st.dictionaries(st.text(max_size=3), scalars, max_size=2)
              | st.lists(st.lists(scalars, min_size=1, max_size=2), min_size=1, max_size=2))


@st.composite
def deep_predict_bodies(draw) -> bytes:
    """A /predict body with one value nested deep: a feature's, the context, a
    candidate, the candidate list or an unknown top-level field."""
    nested = draw(deep)
    rows = [json.dumps(r).encode() for r in draw(st.lists(good_rows, min_size=1, max_size=3))]
    where = draw(st.sampled_from(["feature", "context", "candidate", "candidates", "extra"]))
    name = json.dumps(draw(st.sampled_from(FEATURES))).encode()
    if where == "feature":
        rows[0] = b"{" + name + b": " + nested + b"}"
    elif where == "candidate":
        rows.append(nested)
    candidates = b"[" + b", ".join(rows) + b"]"
    if where == "candidates":
        candidates = nested
    body = b'{"candidates": ' + candidates
    if where == "context":
        body += b', "context": ' + nested
    if where == "extra":
        body += b', "more": ' + nested
    return body + b"}"


@st.composite
def mixed_predict_bodies(draw) -> bytes:
    """A /predict body whose rows hold one value no feature takes, among good ones."""
    rows = draw(st.lists(good_rows, min_size=1, max_size=4))
    i = draw(st.integers(0, len(rows)))  # len(rows): the context
    bad = {draw(st.sampled_from(FEATURES)): draw(bad_values)}
    if i == len(rows):
        return json.dumps({"candidates": rows, "context": bad}).encode()
    rows[i] = {k: v for k, v in rows[i].items() if k not in bad} | bad
    return json.dumps({"candidates": rows}).encode()


def _tensor(name: str, values: list) -> dict:
    return {"name": name, "shape": [len(values)], "datatype": "BYTES", "data": values}


@st.composite
def deep_infer_bodies(draw) -> bytes:
    """A v2 body with a value nested deep: in a tensor's data, its parameters, the
    request's parameters or outputs, or as a field of the tensor."""
    nested = draw(deep)
    where = draw(st.sampled_from(["data", "tensor parameters", "parameters", "outputs",
                                  "shape", "name"]))
    tensor = {"name": draw(st.sampled_from(CATEGORICAL)), "shape": [1], "datatype": "BYTES",
              "data": ["a"]}
    marker = "@@nested@@"
    body: dict = {"inputs": [tensor]}
    if where == "data":
        tensor["data"] = [marker]
    elif where == "tensor parameters":
        tensor["parameters"] = {"p": marker}
    elif where == "parameters":
        body["parameters"] = {"p": marker}
    elif where == "outputs":
        body["outputs"] = [{"name": "score", "parameters": {"p": marker}}]
    else:
        tensor[where] = marker
    return json.dumps(body).encode().replace(json.dumps(marker).encode(), nested)


@st.composite
def broken_bodies(draw) -> tuple[str, bytes]:
    """A well-formed body of either route, cut short, or with a byte or a token that is
    no JSON put somewhere in it."""
    path = draw(st.sampled_from([PREDICT, INFER]))
    rows = draw(st.lists(good_rows, min_size=1, max_size=3))
    if path == PREDICT:
        body = json.dumps({"candidates": rows}).encode()
    else:
        body = json.dumps({"inputs": [_tensor("C1", ["a", "b"])]}).encode()
    how = draw(st.sampled_from(["cut", "insert"]))
    if how == "cut":
        return path, body[:draw(st.integers(1, len(body) - 1))]
    at = draw(st.integers(1, len(body) - 1))
    junk = draw(st.sampled_from([b"NaN", b"Infinity", b"\xff", b"\x00", b"}", b"]", b",,",
                                 b"'", b"tru", b"01"]))
    return path, body[:at] + junk + body[at:]


@SETTINGS
@given(raw=deep_predict_bodies())
def test_deep_predict_bodies_get_a_4xx(client, raw):
    _refused(client, PREDICT, raw)


@SETTINGS
@given(raw=mixed_predict_bodies())
def test_values_no_feature_takes_get_a_4xx_naming_where(client, raw):
    error = _refused(client, PREDICT, raw)
    assert "context" in error or "candidates[" in error, error


@SETTINGS
@given(raw=deep_infer_bodies())
def test_deep_infer_bodies_get_a_4xx(client, raw):
    _refused(client, INFER, raw)


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is no JSON")


@SETTINGS
@given(case=broken_bodies())
def test_broken_json_gets_a_4xx(client, case):
    path, raw = case
    try:
        json.loads(raw, parse_constant=_no_constant)
    except ValueError:
        # malformed JSON names the byte; a body whose first bad part is a wrong value
        # (a "}" cutting the object short before its candidates) names that part
        _refused(client, path, raw)
    else:  # the junk happened to land where it keeps the JSON valid: nothing to check
        pass


# -- the two bugs, as they were reported --------------------------------------------------

def test_value_nested_1000_levels_deep_is_a_4xx_not_a_500(client):
    """It was a RecursionError in the app, a 500 (/infer answered 400)."""
    for path, raw in [(PREDICT, b'{"candidates": [{"C1": ' + _nested(1000, "array") + b"}]}"),
                      (PREDICT, b'{"candidates": [{"C1": ' + _nested(1000, "object") + b"}]}"),
                      (INFER, b'{"inputs": [{"name": "C1", "shape": [1], "datatype": "BYTES",'
                              b' "data": ' + _nested(1000, "array") + b"}]}")]:
        error = _refused(client, path, raw)
        assert "candidates[0]" in error or "inputs[0].data" in error, error


@pytest.mark.parametrize("value", [True, False])
def test_boolean_for_a_numeric_feature_is_refused(client, live_run, value):
    """JSON true / false for a numeric feature was scored as 1 / 0, where a categorical
    feature and a training file refuse it."""
    name = NUMERIC[0]
    for body in ({"candidates": [{name: value}]},
                 {"context": {name: value}, "candidates": [{}]}):
        error = _refused(client, PREDICT, json.dumps(body).encode())
        assert f"field {name!r}" in error and "boolean" in error, error
    good = _post(client, PREDICT, json.dumps({"candidates": [{name: 1}]}).encode())
    assert good.status_code == 200, good.text
