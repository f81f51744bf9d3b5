"""Bad requests get a 4xx naming the problem; the server answers the next good one."""

from __future__ import annotations

import json

import numpy as np
import pytest
from fastapi.testclient import TestClient

from terarec.serving.app import create_app
from terarec.serving.engine import ServingEngine

MAX_CANDIDATES = 8
MAX_BODY = 20_000


@pytest.fixture(scope="module")
def client(live_run):
    engine = ServingEngine(live_run.export)
    engine.refresh()
    app = create_app(engine, max_candidates=MAX_CANDIDATES, max_body_bytes=MAX_BODY)
    with TestClient(app, raise_server_exceptions=False) as c:
        yield c


@pytest.fixture(scope="module")
def good(live_run) -> dict:
    return {"context": {"I1": 3, "C1": live_run.records[0]["C1"]},
            "candidates": [{"C3": live_run.records[i].get("C3", "x")} for i in range(3)]}


def _post(client, path: str, body) -> tuple[int, str]:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = client.post(path, content=raw, headers={"Content-Type": "application/json"})
    return r.status_code, r.json().get("error", "")


PREDICT_CASES = [
    ("malformed JSON", b'{"candidates": [', 400, "malformed JSON"),
    ("empty body", b"", 400, "empty request body"),
    ("nested too deeply", b"[" * 5000 + b"]" * 5000, 422, "request must be an object, got array"),
    # a value nested past the interpreter's stack was a RecursionError, a 500
    ("value nested 1,000 levels deep", b'{"candidates": [{"C1": ' + b"[" * 1000 + b"]" * 1000
     + b"}]}", 422, "candidates[0]: a value: an array inside an array is no feature value"),
    ("object nested 1,000 levels deep", b'{"candidates": [{}], "context": {"C1": '
     + b'{"a": ' * 1000 + b"1" + b"}" * 1000 + b"}}", 422, "context: a value: object is no"),
    ("not an object", [1, 2], 422, "request must be an object, got array"),
    ("null body", b"null", 422, "request must be an object, got null"),
    ("null candidate", {"candidates": [{}, None]}, 422,
     "candidates[1] must be an object, got null"),
    ("wrong type", {"candidates": "x"}, 422,
     "candidates must be an array of feature objects, one per item to score, got string"),
    ("unknown field", {"user": 1, "candidates": [{}]}, 422,
     "unknown field(s) ['user']; known: candidates, context"),
    ("missing candidates", {"context": {}}, 422, "missing field 'candidates'"),
    ("extra top-level field", {"candidates": [{}], "user": 1}, 422, "['user']"),
    ("candidates not a list", {"candidates": {"C1": "a"}}, 422, "must be an array"),
    ("no candidates", {"candidates": []}, 422, "empty"),
    ("candidate not an object", {"candidates": ["a"]}, 422, "candidates[0] must be an object"),
    ("context not an object", {"context": [1], "candidates": [{}]}, 422, "context must be"),
    ("unknown feature", {"candidates": [{}, {"C99": "a"}]}, 422, "candidates[1]: unknown"),
    ("label is no feature", {"candidates": [{"label": 1}]}, 422, "['label']"),
    ("feature in context and candidate", {"context": {"C1": "a"},
                                          "candidates": [{"C1": "b"}]}, 422, "['C1']"),
    ("numeric not a number", {"candidates": [{}, {"I2": "many"}]}, 422,
     "candidates[1]: field 'I2': not a finite number"),
    # NaN and Infinity are no JSON: refused by the decoder, not read as numbers
    ("numeric infinity", b'{"candidates": [{"I2": Infinity}]}', 400, "malformed JSON"),
    ("numeric NaN", b'{"candidates": [{"I2": NaN}]}', 400,
     "malformed JSON: invalid character (byte 23)"),
    ("numeric -Infinity", b'{"context": {"I3": -Infinity}, "candidates": [{}]}', 400,
     "malformed JSON"),
    ("numeric past a double", b'{"candidates": [{"I2": 1e400}]}', 422,
     "candidates[0]: a feature value: number out of range"),
    ("numeric with an underscore", {"candidates": [{"I2": "1_000"}]}, 422,
     "candidates[0]: field 'I2': not a finite number, got '1_000'"),
    ("numeric beyond float32", {"candidates": [{"I2": 1e39}]}, 422,
     "candidates[0]: field 'I2': outside the float32 range"),
    ("float categorical", {"candidates": [{"C4": 2.5}]}, 422, "field 'C4'"),
    ("boolean categorical", {"candidates": [{"C4": True}]}, 422, "field 'C4'"),
    # JSON true / false for a numeric feature was scored as 1 / 0
    ("boolean numeric", {"candidates": [{}, {"I2": False}]}, 422,
     "candidates[1]: field 'I2': boolean is no feature value"),
    ("boolean numeric in the context", {"context": {"I1": True}, "candidates": [{}]}, 422,
     "context: field 'I1': boolean is no feature value"),
    ("object value", {"candidates": [{"C4": {"a": 1}}]}, 422, "field 'C4'"),
    ("list for a single-valued field", {"candidates": [{"C4": ["a", "b"]}]}, 422, "field 'C4'"),
    ("too many candidates", {"candidates": [{}] * (MAX_CANDIDATES + 1)}, 413,
     f"limit of {MAX_CANDIDATES}"),
    ("body too large", {"candidates": [{"C1": "x" * MAX_BODY}]}, 413, "exceeds the limit"),
]


@pytest.mark.parametrize("case", PREDICT_CASES, ids=[c[0] for c in PREDICT_CASES])
def test_bad_predict_requests_get_a_4xx_naming_the_problem(client, good, case):
    _, body, status, message = case
    got_status, error = _post(client, "/predict", body)
    assert got_status == status, error
    assert message in error
    assert "None" not in error  # values are shown as JSON spells them
    # The server is unharmed: the next good request scores.
    ok, _ = _post(client, "/predict", good)
    assert ok == 200


def _kserve_typed(datatype: str, data: list) -> dict:
    return {"inputs": [{"name": "I1", "shape": [len(data)], "datatype": datatype,
                        "data": data}]}


def _kserve(n: int = 2, **override) -> dict:
    tensor = {"name": "C1", "shape": [n], "datatype": "BYTES", "data": ["a"] * n}
    tensor.update(override)
    return {"inputs": [tensor, {"name": "I1", "shape": [n], "datatype": "INT64",
                                "data": [1] * n}]}


INFER_CASES = [
    ("float in an INT64 tensor", _kserve_typed("INT64", [1, 1.5]), 422,
     "input 'I1': data[1] is number 1.5, not a INT64 value"),
    ("negative UINT8", _kserve_typed("UINT8", [-1, 2]), 422,
     "input 'I1': data[0] is integer -1, not a UINT8 value"),
    # values past the datatype's range were taken as the numbers they held
    ("UINT8 past 255", _kserve_typed("UINT8", [1, 256]), 422,
     "input 'I1': data[1] is integer 256, not a UINT8 value"),
    ("INT8 below -128", _kserve_typed("INT8", [-129, 2]), 422,
     "input 'I1': data[0] is integer -129, not a INT8 value"),
    ("INT64 past 2**63 - 1", _kserve_typed("INT64", [None, 2 ** 63]), 422,
     f"input 'I1': data[1] is integer {2 ** 63}, not a INT64 value"),
    ("string in an FP32 tensor", _kserve_typed("FP32", [1.0, "x"]), 422,
     "input 'I1': data[1] is string \"x\", not a FP32 value"),
    ("number in a BOOL tensor", _kserve_typed("BOOL", [True, 3]), 422,
     "input 'I1': data[1] is integer 3, not a BOOL value"),
    ("no inputs", {"id": "a"}, 422, "missing field 'inputs'"),
    ("inputs not a list", {"inputs": {}}, 422, "non-empty array"),
    ("extra field", {**_kserve(), "priority": 1}, 422, "['priority']"),
    ("tensor lacks data", {"inputs": [{"name": "C1", "shape": [1], "datatype": "BYTES"}]},
     422, "inputs[0]: missing field 'data'"),
    ("unknown input", _kserve(name="C99"), 422, "unknown input 'C99'"),
    ("unknown datatype", _kserve(datatype="STRING"), 422, "unknown datatype 'STRING'"),
    ("bad shape", _kserve(shape=[2, 3]), 422, "shape must be [N] or [N, 1]"),
    ("shape disagrees with data", _kserve(shape=[3]), 422, "does not match 2 values"),
    ("row counts differ", {"inputs": [_kserve()["inputs"][0],
                                      {"name": "I1", "shape": [3], "datatype": "INT64",
                                       "data": [1, 2, 3]}]}, 422, "3 rows, other inputs have 2"),
    ("input twice", {"inputs": [_kserve()["inputs"][0]] * 2}, 422, "given twice"),
    ("wrong value type", _kserve(name="I2", datatype="FP32", data=["x", "y"]), 422,
     "input 'I2': data[0] is string \"x\""),
    ("unknown output", {**_kserve(), "outputs": [{"name": "logit"}]}, 422, "'score'"),
    ("shape of strings", _kserve(shape=["2"]), 422,
     "inputs[0].shape[0] must be an integer, got string"),
    ("boolean shape", _kserve(shape=[True]), 422, "inputs[0].shape[0] must be an integer"),
    ("name not a string", _kserve(name=3), 422, "inputs[0].name must be a string, got integer"),
    ("id not a string", {**_kserve(), "id": 5}, 422, "id must be a string or null, got integer"),
    ("data nested 1,000 levels deep", b'{"inputs": [{"name": "C1", "shape": [1], '
     b'"datatype": "BYTES", "data": [' + b"[" * 1000 + b"]" * 1000 + b"]}]}", 422,
     "inputs[0].data[0][0] must be a boolean or an integer or a number or a string or null"),
    ("parameters nested", {**_kserve(), "parameters": {"a": {"b": [1]}}}, 422,
     "parameters: values must be strings, numbers, booleans or null, got object"),
    ("tensor not an object", {"inputs": ["C1"]}, 422, "inputs[0] must be an object, got string"),
    ("too many rows", _kserve(MAX_CANDIDATES + 1), 413, f"limit of {MAX_CANDIDATES}"),
]


@pytest.mark.parametrize("case", INFER_CASES, ids=[c[0] for c in INFER_CASES])
def test_bad_infer_requests_get_a_4xx_naming_the_problem(client, case):
    _, body, status, message = case
    got_status, error = _post(client, "/v2/models/terarec/infer", body)
    assert got_status == status, error
    assert message in error
    assert _post(client, "/v2/models/terarec/infer", _kserve())[0] == 200


def test_unknown_model_name_is_404(client):
    assert client.get("/v2/models/other").status_code == 404
    status, error = _post(client, "/v2/models/other/infer", _kserve())
    assert status == 404 and "'other'" in error


def test_chunked_body_past_the_limit_is_413(client):
    def chunks():
        yield b'{"candidates": [{"C1": "'
        for _ in range(MAX_BODY // 1000 + 1):
            yield b"x" * 1000
        yield b'"}]}'

    r = client.post("/predict", content=chunks(), headers={"Content-Type": "application/json"})
    assert r.status_code == 413


def test_nested_kserve_data_and_flat_data_agree(client):
    flat = _post(client, "/v2/models/terarec/infer", _kserve())
    assert flat[0] == 200
    nested = _kserve(shape=[2, 1], data=[["a"], ["a"]])
    r1 = client.post("/v2/models/terarec/infer", json=_kserve()).json()
    r2 = client.post("/v2/models/terarec/infer", json=nested).json()
    np.testing.assert_allclose(r1["outputs"][0]["data"], r2["outputs"][0]["data"])


def test_no_version_yet_means_not_ready(tmp_path):
    engine = ServingEngine(tmp_path / "empty")
    assert not engine.refresh()
    with TestClient(create_app(engine), raise_server_exceptions=False) as c:
        assert c.get("/v2/health/live").status_code == 200
        assert c.get("/v2/health/ready").status_code == 503
        r = c.post("/predict", json={"candidates": [{}]})
        assert r.status_code == 503 and "no model version" in r.json()["error"]


@pytest.mark.parametrize("path", ["/predict", "/v2/models/terarec/infer"])
def test_scoring_routes_refuse_other_methods_like_the_app(client, path):
    """The scoring routes' plain handlers answer a wrong method as FastAPI would, in the
    {"error": ...} shape, with the allowed method."""
    r = client.get(path)
    assert r.status_code == 405
    assert r.json() == {"error": f"GET {path}: Method Not Allowed"}
    assert r.headers["allow"] == "POST"
    assert r.headers["content-type"] == "application/json"


def test_scoring_routes_count_in_the_metrics(client, good):
    """Answers of the plain handlers are timed and counted per route and status."""
    def count(route: str, status: str) -> float:
        text = client.get("/metrics").text
        line = next((x for x in text.splitlines() if x.startswith(
            f'terarec_requests_total{{code="{status}",route="{route}"}}')), None)
        return 0.0 if line is None else float(line.split()[-1])

    before_ok, before_bad = count("predict", "200"), count("predict", "422")
    assert _post(client, "/predict", good)[0] == 200
    assert _post(client, "/predict", {"candidates": [{"nope": 1}]})[0] == 422
    assert count("predict", "200") == before_ok + 1
    assert count("predict", "422") == before_bad + 1


def test_compressed_bodies_are_inflated_within_the_limit(client, good):
    """A gzip body was parsed as it came (malformed JSON) and a Content-Encoding the server
    does not speak was ignored; inflation is bounded by the body limit."""
    import gzip
    import zlib

    raw = json.dumps(good).encode()
    plain = client.post("/predict", content=raw).json()["scores"]
    for encoding, packed in (("gzip", gzip.compress(raw)), ("deflate", zlib.compress(raw))):
        r = client.post("/predict", content=packed, headers={"Content-Encoding": encoding})
        assert r.status_code == 200 and r.json()["scores"] == plain, r.text
    r = client.post("/predict", content=raw, headers={"Content-Encoding": "br"})
    assert r.status_code == 415 and "Content-Encoding 'br' is not supported" in r.text
    r = client.post("/predict", content=raw, headers={"Content-Encoding": "gzip"})
    assert r.status_code == 400 and "not valid gzip data" in r.json()["error"]
    r = client.post("/predict", content=gzip.compress(raw)[:-12],
                    headers={"Content-Encoding": "gzip"})
    assert r.status_code == 400 and "truncated gzip" in r.json()["error"]
    bomb = gzip.compress(b" " * (MAX_BODY + 1) + raw)  # tiny on the wire, past the limit
    assert len(bomb) < MAX_BODY // 100
    r = client.post("/predict", content=bomb, headers={"Content-Encoding": "gzip"})
    assert r.status_code == 413 and "once decompressed" in r.json()["error"]
