"""The fast request path: column-wise conversion, dynamic batching, binary tensors,
row sources and several workers, each against the plain per-record path."""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch
from fastapi.testclient import TestClient
from hypothesis import given, settings
from hypothesis import strategies as st
from serving_helpers import SCHEMA

from terarec.data.readers import DataError, batch_from_columns, batch_from_records, csv_schema
from terarec.loopback import free_port
from terarec.serving.app import create_app
from terarec.serving.batching import DynamicBatcher, QueueFull
from terarec.serving.binary import HEADER, encode_bytes
from terarec.serving.engine import ServingEngine
from terarec.serving.features import columns_batch, request_batch
from terarec.serving.rows import FallbackRows, ShardedRows, VersionRows

TOL = 1e-5
SINGLE = csv_schema("y", ["n1", "n2"], ["user", "item", "ctx"], transform={"n2": "log1p"})
MULTI = csv_schema("y", ["n1"], ["user", "tags"], multi_valued=["tags"], separator="|")


def _same(a, b) -> None:
    torch.testing.assert_close(a.dense, b.dense, rtol=0, atol=0)
    assert a.sparse.fields == b.sparse.fields
    assert torch.equal(a.sparse.values, b.sparse.values)
    assert torch.equal(a.sparse.offsets, b.sparse.offsets)


cat = st.one_of(st.none(), st.sampled_from(["a", "b", "", "é"]), st.integers(-3, 3),
                st.just(2**62 + 1))
num = st.one_of(st.none(), st.integers(-5, 10**6), st.just(2**60 + 3),
                st.floats(-1e6, 1e6, allow_nan=False), st.sampled_from(["7", "1e3", "-0.5"]))


def _records(draw, n: int) -> list[dict]:
    value = {"n1": num, "n2": num, "user": cat, "item": cat, "ctx": cat}
    return [draw(st.fixed_dictionaries({}, optional=value)) for _ in range(n)]


@settings(max_examples=80, deadline=None)
@given(data=st.data(), n=st.integers(1, 5))
def test_request_batch_equals_the_record_path(data, n):
    """Context and candidates converted together give exactly the keys and dense values
    of every merged row through ``batch_from_records``."""
    context_names = data.draw(st.sets(st.sampled_from(["n1", "n2", "user", "item", "ctx"])))
    context = {k: v for k, v in _records(data.draw, 1)[0].items() if k in context_names}
    candidates = [{k: v for k, v in r.items() if k not in context}
                  for r in _records(data.draw, n)]
    merged = [{**context, **c} for c in candidates]
    try:
        expected = batch_from_records(merged, SINGLE)
    except DataError:
        with pytest.raises(DataError):
            request_batch(context, candidates, SINGLE)
        return
    _same(request_batch(context, candidates, SINGLE), expected)


text_cat = st.one_of(st.none(), st.sampled_from(["a", "b", "", "é", "12"]))
number = st.one_of(st.none(), st.integers(-5, 10**6), st.just(2**60 + 3),
                   st.floats(-1e6, 1e6, allow_nan=False))
number_text = st.one_of(st.none(), st.sampled_from(["7", "1e3", "-0.5", "0"]))


@settings(max_examples=60, deadline=None)
@given(data=st.data(), n=st.integers(1, 5), texts=st.booleans())
def test_listed_path_takes_the_usual_request_and_equals_the_record_path(data, n, texts):
    """Requests of strings and numbers (or numeric texts) take the one-array path, and it
    gives exactly the record path's keys and dense values."""
    from terarec.serving.features import _listed_batch

    value = {"n1": number_text if texts else number, "n2": number_text if texts else number,
             "user": text_cat, "item": text_cat, "ctx": text_cat}
    rows = [data.draw(st.fixed_dictionaries({}, optional=value)) for _ in range(n + 1)]
    context_names = data.draw(st.sets(st.sampled_from(sorted(value))))
    context = {k: v for k, v in rows[0].items() if k in context_names}
    candidates = [{k: v for k, v in r.items() if k not in context} for r in rows[1:]]
    expected = batch_from_records([{**context, **c} for c in candidates], SINGLE)
    row_names = frozenset().union(*candidates)
    listed = _listed_batch(context, candidates, SINGLE, row_names)
    if listed is None:  # an empty numeric text, or an integer no float holds exactly
        # mixed with floats (pyarrow refuses the mix), takes the long way
        assert any(r.get(k) == "" or (type(r.get(k)) is int and r[k] > 2**53)
                   for r in rows for k in ("n1", "n2"))
    else:
        _same(listed, expected)
    _same(request_batch(context, candidates, SINGLE), expected)


context_text = st.one_of(
    st.none(), st.from_regex(r"-?[0-9]{1,40}(\.[0-9]{1,40})?", fullmatch=True),
    st.sampled_from(["", "+1", " 3", "1e5", "1.", ".5", "-0", "0x10", "inf", "nan",
                     "1_0", "1" * 40]))


@settings(max_examples=80, deadline=None)
@given(n1=context_text, n2=context_text)
def test_context_numeric_texts_equal_the_record_path(n1, n2):
    """Numeric texts that all come from the context (parsed in Python when they are
    plain decimals, else by Arrow or the record path) give exactly the record path's
    dense values and bucket keys, or its error."""
    context = {"ctx": "c", **{k: v for k, v in (("n1", n1), ("n2", n2)) if v is not None}}
    candidates = [{"user": "a", "item": "x"}, {"user": "b"}]
    try:
        expected = batch_from_records([{**context, **c} for c in candidates], SINGLE)
    except DataError:
        with pytest.raises(DataError):
            request_batch(context, candidates, SINGLE)
        return
    _same(request_batch(context, candidates, SINGLE), expected)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 1e39, True, 4.5])
def test_listed_path_leaves_bad_values_to_the_checked_path(bad):
    """A value the record path refuses (or converts) is not taken by the one-array path:
    the answer is the record path's, error included."""
    field = "user" if isinstance(bad, float) and abs(bad) < 1e6 else "n1"
    candidates = [{"user": "a", "n1": 1.0}, {"user": "b", field: bad}]
    try:
        expected = batch_from_records([{"ctx": "c", **c} for c in candidates], SINGLE)
    except DataError as exc:
        with pytest.raises(DataError, match=r"candidates\[1\]"):
            request_batch({"ctx": "c"}, candidates, SINGLE)
        assert "record 1" in str(exc)
        return
    _same(request_batch({"ctx": "c"}, candidates, SINGLE), expected)


def test_columns_batch_equals_the_record_path_for_typed_columns():
    records = [{"n1": 3, "n2": "2.5", "user": "u1", "item": 7, "ctx": None},
               {"n1": None, "n2": 1e6, "user": "", "item": 2**62, "ctx": "c"}]
    columns = {"n1": pa.array([3, None]), "n2": pa.array(["2.5", "1000000.0"]),
               "user": pa.array(["u1", ""]), "item": pa.array([7, 2**62]),
               "ctx": pa.array([None, b"c"], pa.binary())}
    _same(columns_batch(columns, 2, SINGLE), batch_from_records(records, SINGLE))
    multi = [{"n1": 1, "tags": "x|y"}, {"tags": ["x", None, ""]}, {"user": 5}]
    cols = {"n1": pa.array([1, None, None]), "tags": pa.array(["x|y", None, None]),
            "user": pa.array([None, None, 5])}
    expected = batch_from_records(multi, MULTI)
    got = batch_from_columns({**cols, "tags": pa.array([["x", "y"], ["x", None, ""], None])},
                             3, MULTI)
    _same(got, expected)
    _same(columns_batch(cols, 3, MULTI), batch_from_records(
        [{"n1": 1, "tags": "x|y"}, {}, {"user": 5}], MULTI))


@pytest.mark.parametrize("column, message", [
    (pa.array([1.0, float("nan")]), "record 1: field 'n1': not a finite number, got nan"),
    (pa.array(["3", "many"]), "record 1: field 'n1': not a finite number, got 'many'"),
    (pa.array([1e39, 0.0]), "record 0: field 'n1': outside the float32 range"),
])
def test_columns_with_bad_numbers_are_refused_naming_the_record(column, message):
    with pytest.raises(DataError, match=message):
        batch_from_columns({"n1": column}, 2, SINGLE)


def test_float_categoricals_are_refused_as_in_the_record_path():
    with pytest.raises(DataError, match=r"record 0: field 'user': 1.0 is a float"):
        batch_from_columns({"user": pa.array([1.0, 2.5])}, 2, SINGLE)


# -- dynamic batching -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def engine(live_run):
    engine = ServingEngine(live_run.export)
    engine.refresh()
    yield engine
    engine.close()


def test_concurrent_requests_share_passes_and_get_their_own_scores(engine, live_run):
    version = engine.served()
    older = engine.load_full(engine.reader.manifest("v000001"))
    records = live_run.records
    batches = [(older if i % 3 == 0 else version,
                batch_from_records(records[i:i + 5 + i % 4], SCHEMA)) for i in range(12)]
    passes: list[int] = []

    def score(batch, v):
        passes.append(len(batch))
        return engine.score_batch(batch, v)

    batcher = DynamicBatcher(score, max_rows=40)

    async def run():
        return await asyncio.gather(*(batcher.score(v, b) for v, b in batches))

    results = asyncio.run(run())
    for (v, b), got in zip(batches, results, strict=True):
        np.testing.assert_allclose(got, engine.score_batch(b, v), atol=TOL)
    # Fewer passes than requests; every pass within max_rows and of one version.
    assert batcher.requests == len(batches) and batcher.passes < len(batches)
    assert max(passes) <= 40 and sum(passes) == sum(len(b) for _, b in batches)


def test_a_full_queue_refuses_with_queue_full(engine, live_run):
    batch = batch_from_records(live_run.records[:2], SCHEMA)
    batcher = DynamicBatcher(engine.score_batch, max_queue=2)

    async def run():
        return await asyncio.gather(*(batcher.score(engine.served(), batch)
                                      for _ in range(3)), return_exceptions=True)

    results = asyncio.run(run())
    assert sum(isinstance(r, QueueFull) for r in results) == 1
    assert sum(isinstance(r, np.ndarray) for r in results) == 2


# -- binary tensors -------------------------------------------------------------------------

def _binary_body(records: list[dict]) -> tuple[bytes, int]:
    """A v2 request with every feature as a binary BYTES tensor ('' where missing)."""
    inputs, blobs = [], []
    for spec in SCHEMA.fields:
        blob = encode_bytes([str(r.get(spec.name, "")) for r in records])
        inputs.append({"name": spec.name, "shape": [len(records)], "datatype": "BYTES",
                       "parameters": {"binary_data_size": len(blob)}})
        blobs.append(blob)
    header = json.dumps({"id": "b", "inputs": inputs}).encode()
    return header + b"".join(blobs), len(header)


@pytest.fixture(scope="module")
def client(engine):
    with TestClient(create_app(engine), raise_server_exceptions=False) as c:
        yield c


def test_binary_tensors_score_like_json(client, live_run):
    records = live_run.records[:16]
    body, size = _binary_body(records)
    r = client.post("/v2/models/terarec/infer", content=body,
                    headers={HEADER: str(size), "Content-Type": "application/octet-stream"})
    assert r.status_code == 200, r.text
    got = np.asarray(r.json()["outputs"][0]["data"])
    want = client.post("/predict", json={"candidates": records}).json()["scores"]
    np.testing.assert_allclose(got, want, atol=TOL)
    assert r.json()["id"] == "b"
    numbers = {"name": "I1", "shape": [2], "datatype": "FP64",
               "parameters": {"binary_data_size": 16}}
    header = json.dumps({"inputs": [numbers]}).encode()
    r = client.post("/v2/models/terarec/infer",
                    content=header + np.array([3.0, 7.0]).tobytes(),
                    headers={HEADER: str(len(header))})
    want = client.post("/predict", json={"candidates": [{"I1": 3}, {"I1": 7}]}).json()
    np.testing.assert_allclose(r.json()["outputs"][0]["data"], want["scores"], atol=TOL)


@pytest.mark.parametrize("mangle, status, message", [
    (lambda b, h: (b, "x"), 400, "bad inference-header-content-length header 'x'"),
    (lambda b, h: (b + b"zz", str(h)), 400, "inputs declare"),
    (lambda b, h: (b[:-3], str(h)), 400, "runs past the end of the body"),
    (lambda b, h: (b[:h] + b"\xff\xff\xff\x7f" + b[h + 4:], str(h)), 422,
     "length-prefixed elements"),
    (lambda b, h: (b[:h].replace(b'"BYTES"', b'"INT64"', 1) + b[h:], str(h)), 422,
     "bytes, 2 INT64 values take 16"),
])
def test_bad_binary_bodies_get_a_4xx_naming_the_problem(client, live_run, mangle, status,
                                                        message):
    body, size = _binary_body(live_run.records[:2])
    body, header = mangle(body, size)
    r = client.post("/v2/models/terarec/infer", content=body, headers={HEADER: header})
    assert r.status_code == status, r.text
    assert message in r.json()["error"]
    assert client.get("/v2").json()["extensions"] == ["binary_tensor_data"]


def test_binary_numeric_text_that_is_no_number_names_the_row(client):
    blob = encode_bytes(["3", "lots"])
    tensor = {"name": "I2", "shape": [2], "datatype": "BYTES",
              "parameters": {"binary_data_size": len(blob)}}
    header = json.dumps({"inputs": [tensor]}).encode()
    r = client.post("/v2/models/terarec/infer", content=header + blob,
                    headers={HEADER: str(len(header))})
    assert r.status_code == 422
    assert "row[1]: field 'I2': not a finite number, got 'lots'" in r.json()["error"]


# -- row sources ----------------------------------------------------------------------------

def test_fallback_rows_ask_the_second_source_for_what_the_first_lacks():
    keys = np.array([1, 5, 9], np.int64)
    first = VersionRows(ShardedRows([(keys, np.ones((3, 2), np.float32))], 2))
    cold = ShardedRows([(np.array([2, 5, 7], np.int64), np.full((3, 2), 7, np.float32))], 2)
    rows, found = FallbackRows(first, cold).lookup(np.array([9, 7, 5, 4], np.int64))
    np.testing.assert_array_equal(rows[:, 0], [1, 7, 1, 0])
    np.testing.assert_array_equal(found, [True, True, True, False])
    with pytest.raises(ValueError, match="cannot be chained"):
        FallbackRows(first, ShardedRows([(keys, np.ones((3, 4), np.float32))], 4))


def test_a_poll_interval_of_inf_keeps_the_poller_alive(live_run, tmp_path):
    """``--poll-seconds inf`` (never look again) overflowed the poller's wait, which died
    with a traceback; its waits are capped, so it lives and stops promptly."""
    engine = ServingEngine(live_run.export, cache_dir=tmp_path / "cache")
    try:
        assert engine.refresh()
        engine.start_polling(float("inf"))
        time.sleep(0.3)
        assert engine._poller is not None and engine._poller.is_alive()
    finally:
        start = time.monotonic()
        engine.close()
    assert time.monotonic() - start < 5


# -- several workers ------------------------------------------------------------------------

def test_engines_sharing_a_swap_notice_follow_the_first_to_swap(live_run, tmp_path):
    export = tmp_path / "export"
    export.mkdir()
    shutil.copytree(live_run.export / "v000001", export / "v000001")
    (export / "LATEST").write_text("v000001")
    notice, shared = tmp_path / "cache" / "SERVED", tmp_path / "cache"
    engines = [ServingEngine(export, cache_dir=shared, swap_notice=notice)
               for _ in range(2)]
    try:
        for e in engines:
            assert e.refresh()
        engines[1].start_polling(60.0)  # its own poll would come far too late
        for name in ("v000002", "v000003"):
            shutil.copytree(live_run.export / name, export / name)
        (export / "LATEST").write_text("v000003")
        assert engines[0].refresh()
        deadline = time.monotonic() + 20
        while engines[1].current.version != 3 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert engines[1].current.version == 3
        assert notice.read_text().startswith("v000003 ")
    finally:
        for e in engines:
            e.close()


@pytest.mark.slow
def test_serve_workers_answer_on_one_port_and_swap_together(live_run, tmp_path):
    export = tmp_path / "export"
    export.mkdir()
    shutil.copytree(live_run.export / "v000001", export / "v000001")
    (export / "LATEST").write_text("v000001")
    port = free_port()
    src = Path(__file__).resolve().parents[2] / "src"
    server = subprocess.Popen(
        [sys.executable, "-m", "terarec", "serve", str(export), "--port", str(port),
         "--workers", "2", "--threads", "1", "--poll-seconds", "1", "--log-level",
         "warning"], env=dict(os.environ, PYTHONPATH=str(src)))
    body = json.dumps({"candidates": live_run.records[:8]}).encode()

    def versions(count: int) -> list[int]:
        seen = []
        for _ in range(count):  # a new connection each: the kernel spreads them
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
            conn.request("POST", "/predict", body, {"Content-Type": "application/json"})
            r = conn.getresponse()
            assert r.status == 200
            seen.append(json.loads(r.read())["version"])
            conn.close()
        return seen

    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                assert versions(1) == [1]
                break
            except (OSError, AssertionError):
                if time.monotonic() > deadline or server.poll() is not None:
                    raise
                time.sleep(0.5)
        assert set(versions(20)) == {1}
        shutil.copytree(live_run.export / "v000002", export / "v000002")
        (export / "LATEST").write_text("v000002")
        time.sleep(1 + 3)  # one poll interval, plus loading on a busy machine
        assert set(versions(30)) == {2}
    finally:
        server.terminate()
        server.wait(timeout=60)


# -- one write per answer -------------------------------------------------------------------

class _RecordingTransport(asyncio.Transport):
    """A connection's transport that keeps each write uvicorn makes."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[bytes] = []
        self.closed = False

    def write(self, data) -> None:
        self.writes.append(bytes(data))

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def get_extra_info(self, name, default=None):
        return {"peername": ("127.0.0.1", 9), "sockname": ("127.0.0.1", 8)}.get(name, default)

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


def _answer_writes(app, request: bytes) -> tuple[list[bytes], bool]:
    """The transport writes the server's protocol (uvicorn's httptools protocol, as
    ``terarec serve`` runs it) makes to answer ``request``."""
    import uvicorn
    from uvicorn.server import ServerState

    from terarec.serving.protocol import OneWriteHttp

    async def run() -> tuple[list[bytes], bool]:
        config = uvicorn.Config(app, http=OneWriteHttp, lifespan="off", access_log=False,
                                log_level="warning")
        config.load()
        protocol = OneWriteHttp(config, ServerState(), app_state={})
        transport = _RecordingTransport()
        protocol.connection_made(transport)
        protocol.data_received(request)
        deadline = time.monotonic() + 30
        while not any(b"\r\n\r\n" in w for w in transport.writes) or (
                protocol.cycle is not None and not protocol.cycle.response_complete):
            assert time.monotonic() < deadline, "no answer"
            await asyncio.sleep(0.01)
        closed = transport.closed
        protocol.connection_lost(None)
        return transport.writes, closed

    return asyncio.run(run())


@pytest.mark.parametrize("keep_alive", [True, False])
def test_scoring_answer_is_one_write(engine, live_run, keep_alive):
    """Status line, headers and body of a scoring answer (a score or an error) leave in
    one socket write; a closing connection is closed after it."""
    app = create_app(engine)
    body = json.dumps({"candidates": live_run.records[:4]}).encode()
    connection = b"keep-alive" if keep_alive else b"close"
    for path, payload, status in [(b"/predict", body, b"200"),
                                  (b"/predict", b"{", b"400")]:
        request = (b"POST " + path + b" HTTP/1.1\r\nhost: t\r\ncontent-type: application/json"
                   b"\r\nconnection: " + connection + b"\r\ncontent-length: "
                   + str(len(payload)).encode() + b"\r\n\r\n" + payload)
        writes, closed = _answer_writes(app, request)
        assert len(writes) == 1, writes
        head, _, answer = writes[0].partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 " + status), writes
        assert int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0]) == len(answer)
        parsed = json.loads(answer)
        assert ("scores" in parsed) if status == b"200" else ("error" in parsed)
        assert closed is not keep_alive, (path, payload, head)


def test_single_valued_pooling_gathers_each_slot_row(live_run):
    """One key per (field, row): the pooled input is every slot's own row, read from the
    version's rows, cold cache or warm, in [rows, fields, dim] order."""
    engine = ServingEngine(live_run.export, cache_rows=1500, onnx=False)
    try:
        engine.refresh()
        version = engine.served()
        batch = version.batch({}, live_run.records[:16])
        assert batch.sparse.one_per_slot
        keys = batch.sparse.values.numpy()
        fields, n = batch.sparse.num_fields, len(batch)
        rows = version.source.lookup(keys)[0]  # field-major, like the keys
        want = torch.from_numpy(rows.reshape(fields, n, -1).transpose(1, 0, 2).copy())
        assert engine.cache is not None and len(engine.cache) == 0
        for _ in range(2):  # cache misses, then hits
            got = engine.pooled(batch, version)
            assert got.shape == (n, fields, version.rows.row_dim)
            assert torch.equal(got, want)
        assert len(engine.cache) > 0
    finally:
        engine.close()
