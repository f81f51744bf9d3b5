"""Slices, the faiss item index, /retrieve and the sampled-softmax loss, end to end on a
small planted-affinity log: real training, real exports, real faiss, a real app."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient

from terarec.cli.main import main
from terarec.config import ModelConfig
from terarec.data.synth_retrieval import Affinity, catalog_path, write_retrieval
from terarec.export.format import read_manifest
from terarec.export.storage import Storage
from terarec.models.dssm import DSSM
from terarec.retrieval.index import load_index
from terarec.serving.app import create_app
from terarec.serving.engine import ServingEngine
from terarec.types import FeatureSchema, FieldSpec

USERS, ITEMS = 300, 600


def _train(tmp, loss: str, log) -> str:
    cfg = tmp / "cfg.json"
    cfg.write_text(json.dumps({"model": {"name": "dssm", "embedding_dim": 8,
                                         "deep_mlp": [16], "user_fields": ["user"]}}))
    out = tmp / f"m_{loss}"
    assert main(["train", "--config", str(cfg), "--train", str(log), "--out", str(out),
                 "--format", "csv", "--label", "label", "--categorical", "user,item,topic",
                 "--delimiter", "\t", "--loss", loss, "--epochs", "2", "--batch-size", "256",
                 "--pass-rows", "20000", "--no-progress"]) == 0
    return str(out)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("retrieval")
    log = tmp / "log.tsv"
    write_retrieval(log, 20_000, users=USERS, items=ITEMS, seed=3)
    model = _train(tmp, "sampled_softmax", log)
    for name in ("user_tower", "item_tower"):
        assert main(["export", "--model", model, "--out", str(tmp / name), "--slice", name,
                     "--keys-from", str(log)]) == 0
    assert main(["export", "--model", model, "--out", str(tmp / "full")]) == 0
    assert main(["index", str(tmp / "item_tower"), "--items", str(catalog_path(log)),
                 "--out", str(tmp / "idx")]) == 0
    return tmp, log, model


def test_planted_clicks_follow_the_truth():
    truth = Affinity(50, 400, 20, seed=1)
    users, items = truth.draw(40_000, np.random.default_rng(0))
    top = truth.true_top(np.array([7]), 5)[0]
    counts = np.bincount(items[users == 7], minlength=400)
    assert set(np.argsort(-counts)[:3]) & set(top[:5])  # the likeliest items are drawn most
    ids, prob = truth.probability(7)
    assert prob.sum() == pytest.approx(1.0)
    assert set(truth.item_topic[ids]) <= set(truth._users[0][7])


def test_sampled_softmax_masks_duplicates_and_corrects_for_popularity():
    schema = FeatureSchema(label="y", fields=(FieldSpec("u", "categorical"),
                                              FieldSpec("i", "categorical")))
    model = DSSM(schema, ModelConfig(name="dssm", embedding_dim=4, deep_mlp=(4,),
                                     user_fields=("u",)))
    emb = torch.randn(4, 2, 4)
    dense = torch.zeros(4, 0)
    labels = torch.tensor([1.0, 1.0, 1.0, 0.0])
    loss = model.sampled_softmax_loss(dense, emb, labels, torch.tensor([5, 6, 7, 8]))
    assert torch.isfinite(loss) and loss > 0
    # all positives share one item: nothing is a negative, each row's softmax is certain
    same = model.sampled_softmax_loss(dense, emb, labels, torch.tensor([5, 5, 5, 8]))
    assert same.item() == pytest.approx(0.0, abs=1e-6)
    none = model.sampled_softmax_loss(dense, emb, torch.zeros(4), torch.tensor([1, 2, 3, 4]))
    assert none.item() == 0.0


def test_slices_hold_only_their_fields_and_layers(trained):
    tmp, _, _ = trained
    user = read_manifest(Storage(str(tmp / "user_tower")), "v000001")
    item = read_manifest(Storage(str(tmp / "item_tower")), "v000001")
    full = read_manifest(Storage(str(tmp / "full")), "v000001")
    assert user.data["slice"]["fields"] == ["user"]
    assert item.data["slice"]["fields"] == ["item", "topic"]
    rows = [m.data["sparse"]["rows"] for m in (user, item, full)]
    assert rows[0] + rows[1] == rows[2] and rows[0] <= USERS + 1
    engine = ServingEngine(str(tmp / "user_tower"), cache_dir=tmp / "cache-u")
    assert engine.refresh()
    state = engine.served().model.state_dict()
    assert all(float(v.abs().sum()) == 0 for k, v in state.items() if k.startswith("item_tower"))
    engine.close()


def test_index_recall_and_retrieve_route(trained):
    tmp, log, model = trained
    index = load_index(tmp / "idx")
    assert len(index) == ITEMS and index.meta["kind"] == "ivfpq"  # the default
    queries = np.random.default_rng(0).standard_normal((20, index.dim)).astype(np.float32)
    queries /= np.linalg.norm(queries, axis=1, keepdims=True)
    ann, _ = index.search(queries, 50)
    exact, _ = index.exact(queries, 50)
    recall = np.mean([len(set(a) & set(e)) / 50 for a, e in zip(ann, exact, strict=True)])
    assert recall >= 0.95

    engine = ServingEngine(str(tmp / "user_tower"), cache_dir=tmp / "cache-r")
    assert engine.refresh()
    with TestClient(create_app(engine, index=index, max_top_k=100)) as client:
        ok = client.post("/retrieve", json={"context": {"user": 5}, "top_k": 10})
        assert ok.status_code == 200, ok.text
        body = ok.json()
        assert len(body["items"]) == 10 and body["scores"] == sorted(body["scores"], reverse=True)
        bad = client.post("/retrieve", json={"context": {"user": 5}, "top_k": 0})
        assert bad.status_code == 422 and "top_k" in bad.json()["error"]
        bad = client.post("/retrieve", json={"context": {"item": 3}})
        assert bad.status_code == 422 and "context.item" in bad.json()["error"]
        bad = client.post("/retrieve", json={"context": {"nope": 3}})
        assert bad.status_code == 422 and "context" in bad.json()["error"]
        bad = client.post("/retrieve", json={"context": {"user": 1}, "top_k": 101})
        assert bad.status_code == 413
        bad = client.post("/retrieve", json={"context": {"user": 1}, "rank": "yes"})
        assert bad.status_code == 422 and "rank" in bad.json()["error"]
        infer = client.post("/v2/models/terarec/infer", json={
            "inputs": [{"name": "user", "shape": [1], "datatype": "BYTES", "data": ["5"]}],
            "parameters": {"top_k": 10}})
        assert infer.status_code == 200, infer.text
        assert infer.json()["outputs"][0]["data"] == body["items"]
        bad = client.post("/v2/models/terarec/infer", json={
            "inputs": [{"name": "user", "shape": [2], "datatype": "BYTES", "data": ["5", "6"]}],
            "parameters": {"top_k": 10}})
        assert bad.status_code == 422 and "inputs[0]" in bad.json()["error"]
        bad = client.post("/v2/models/terarec/infer", json={
            "inputs": [{"name": "user", "shape": [1], "datatype": "BYTES", "data": ["5"]}],
            "parameters": {"top_k": "ten"}})
        assert bad.status_code == 422 and "parameters.top_k" in bad.json()["error"]
        # a user tower cannot score candidates
        bad = client.post("/predict", json={"candidates": [{"user": 1, "item": 2}]})
        assert bad.status_code == 404 and "user_tower" in bad.json()["error"]

    # the whole model retrieves and ranks in one process
    engine = ServingEngine(str(tmp / "full"), cache_dir=tmp / "cache-f")
    assert engine.refresh()
    with TestClient(create_app(engine, index=index)) as client:
        ranked = client.post("/retrieve", json={"context": {"user": 5}, "top_k": 10,
                                                "rank": True}).json()
        assert ranked["rank_scores"] == sorted(ranked["rank_scores"], reverse=True)
        plain = client.post("/retrieve", json={"context": {"user": 5}, "top_k": 10}).json()
        assert set(ranked["items"]) == set(plain["items"])


def test_delta_slice_and_delta_index(trained, tmp_path):
    tmp, log, model = trained
    import shutil

    from terarec.retrieval.index import update_index

    uri, out = tmp_path / "items", tmp_path / "idx"
    shutil.copytree(tmp / "item_tower", uri)
    build = update_index(str(uri), catalog_path(log), out)
    assert build["mode"] == "full"
    again = update_index(str(uri), catalog_path(log), out)
    assert again["mode"] == "current" and again["embedded"] == 0
    # same checkpoint again: a delta with nothing changed, the index keeps every vector
    assert main(["export", "--model", model, "--out", str(uri), "--slice", "item_tower",
                 "--keys-from", str(log)]) == 0
    delta = read_manifest(Storage(str(uri)), "v000002")
    assert delta.kind == "delta" and delta.data["sparse"]["rows"] == 0
    step = update_index(str(uri), catalog_path(log), out)
    assert step["mode"] == "delta" and step["embedded"] == 0


RETRIEVAL_INFER_CASES = [
    # each was answered 200 (the datatype, the element and the outputs never checked) or
    # named "context" and Python's spelling of the value
    ({"datatype": "STRING"}, "input 'user': unknown datatype 'STRING'"),
    ({"datatype": "BOOL"}, "input 'user': data[0] is string \"5\", not a BOOL value"),
    ({"data": [{"a": 1}]}, "inputs[0].data[0] must be a boolean or an integer or a number or "
                           "a string or an array or null, got object"),
    ({"data": [["5", "6"]], "shape": [1, 1]}, "input 'user': data[0] is array"),
    ({"parameters": {"top_k": None}}, "parameters.top_k: expected an integer from 1 to 100, "
                                      "got null"),
    ({"outputs": [{"name": "logit"}]}, "'outputs' may only request the outputs 'items' and "
                                       "'scores'"),
]


@pytest.mark.parametrize("change,message", RETRIEVAL_INFER_CASES,
                         ids=[m.split(":")[-1][:30] for _, m in RETRIEVAL_INFER_CASES])
def test_retrieval_infer_checks_its_tensor_like_scoring_does(trained, change, message):
    tmp, _, _ = trained
    engine = ServingEngine(str(tmp / "user_tower"), cache_dir=tmp / "cache-ri")
    assert engine.refresh()
    tensor = {"name": "user", "shape": [1], "datatype": "BYTES", "data": ["5"]}
    body: dict = {"inputs": [tensor], "parameters": {"top_k": 10}}
    for key in ("datatype", "data", "shape"):
        if key in change:
            tensor[key] = change[key]
    body.update({k: v for k, v in change.items() if k in ("parameters", "outputs")})
    with TestClient(create_app(engine, index=load_index(tmp / "idx"), max_top_k=100)) as c:
        bad = c.post("/v2/models/terarec/infer", json=body)
        assert bad.status_code == 422, bad.text
        assert message in bad.json()["error"]
        ok = c.post("/v2/models/terarec/infer", json={
            "inputs": [{"name": "user", "shape": [1], "datatype": "INT64", "data": [5]}],
            "parameters": {"top_k": 10}, "outputs": [{"name": "items"}]})
        assert ok.status_code == 200, ok.text


def test_retrieval_infer_errors_name_the_inputs_not_a_context(trained):
    """The v2 request has no ``context``: its errors name its ``inputs``."""
    tmp, _, _ = trained
    engine = ServingEngine(str(tmp / "user_tower"), cache_dir=tmp / "cache-rn")
    assert engine.refresh()
    with TestClient(create_app(engine, index=load_index(tmp / "idx"), max_top_k=100)) as c:
        bad = c.post("/v2/models/terarec/infer", json={
            "inputs": [{"name": "item", "shape": [1], "datatype": "BYTES", "data": ["7"]}],
            "parameters": {"top_k": 5}})
        assert bad.status_code == 422, bad.text
        assert bad.json()["error"].startswith("inputs.item: an item-side feature")


def test_index_knobs_given_again_rebuild_rather_than_being_ignored(trained, tmp_path,
                                                                    capsys):
    """A second `terarec index` with other --nlist / --pq-m answered "mode": "current"
    and kept the index built with the first ones."""
    tmp, log, _ = trained
    out = tmp_path / "idx"
    argv = ["index", str(tmp / "item_tower"), "--items", str(catalog_path(log)),
            "--out", str(out), "--kind", "ivfpq"]
    assert main([*argv, "--nlist", "4", "--pq-m", "2"]) == 0
    assert main([*argv, "--nlist", "4", "--pq-m", "2"]) == 0
    capsys.readouterr()
    assert main([*argv, "--nlist", "8", "--pq-m", "4"]) == 0
    again = json.loads(capsys.readouterr().out)
    assert again["mode"] == "full" and again["generation"] == "g000002"
    assert load_index(out).meta["options"]["nlist"] == 8
    assert load_index(out).meta["options"]["pq_m"] == 4


def test_a_catalog_listing_an_item_twice_is_refused(trained, tmp_path, capsys):
    """Every copy was indexed: /retrieve answered the same item id over and over."""
    tmp, log, _ = trained
    lines = catalog_path(log).read_text().splitlines(keepends=True)
    catalog = tmp_path / "twice.items"
    catalog.write_text("".join(lines[:6] + [lines[3]] + lines[6:10]))
    item = lines[3].split("\t")[0]
    assert main(["index", str(tmp / "item_tower"), "--items", str(catalog), "--out",
                 str(tmp_path / "idx")]) == 2
    err = capsys.readouterr().err
    assert (f"{catalog}: item {item!r} (id field 'item') is on lines 4 and 7; a catalog "
            "lists each item once") in err
    assert not (tmp_path / "idx").exists()


def test_index_out_naming_a_file_is_refused(trained, tmp_path, capsys):
    tmp, log, _ = trained
    afile = tmp_path / "afile"
    afile.write_text("x")
    assert main(["index", str(tmp / "item_tower"), "--items", str(catalog_path(log)),
                 "--out", str(afile)]) == 2
    assert f"--out {afile} is a file, not an index folder" in capsys.readouterr().err
    assert afile.read_text() == "x"


def test_slice_errors_name_the_problem(trained, tmp_path):
    tmp, log, model = trained
    assert main(["export", "--model", model, "--out", str(tmp_path / "x"), "--slice",
                 "wide", "--keys-from", str(log)]) == 2
    assert main(["export", "--model", model, "--out", str(tmp_path / "x"), "--slice",
                 "user_tower"]) == 2
    assert main(["export", "--model", model, "--out", str(tmp_path / "x"), "--slice",
                 "user,nope", "--keys-from", str(log)]) == 2


INDEX_ERRORS = [
    (["--kind", "hnsw", "--nlist", "8"],
     "--nlist applies only with --kind ivfpq (got --kind hnsw)"),
    (["--ef-search", "64"], "--ef-search applies only with --kind hnsw (got --kind ivfpq)"),
    (["--kind", "ivfpq", "--pq-m", "0"], "--pq-m must be >= 1, got 0"),
    (["--kind", "ivfpq", "--nlist", "-3"], "--nlist must be >= 1, got -3"),
    (["--kind", "ivfpq", "--nlist", "100000"],
     f"--nlist 100000: more clusters than the {ITEMS} items sampled to train them"),
]


@pytest.mark.parametrize("extra,message", INDEX_ERRORS, ids=[" ".join(a) for a, _ in INDEX_ERRORS])
def test_index_flags_of_the_other_kind_or_out_of_range_are_refused(trained, tmp_path, capsys,
                                                                    extra, message):
    """A knob of the other kind was ignored, --nlist 0 / --pq-m 0 meant "sized from the
    data" without saying so, and more clusters than items ended in a faiss traceback."""
    tmp, log, _ = trained
    capsys.readouterr()
    assert main(["index", str(tmp / "item_tower"), "--items", str(catalog_path(log)),
                 "--out", str(tmp_path / "idx"), *extra]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"terarec index: error: {message}"
    assert not (tmp_path / "idx").exists()


def test_a_field_list_slice_takes_single_valued_categorical_fields_once():
    """A repeated field failed in the keys file's reader, and a bucketed numeric field
    was refused there, blaming the file."""
    from dataclasses import replace

    from terarec.retrieval.slices import slice_spec

    schema = FeatureSchema.criteo()
    schema = replace(schema, fields=tuple(replace(f, buckets=(0.5, 1.5)) if f.name == "I1"
                                          else f for f in schema.fields))
    spec = slice_spec(schema, ModelConfig(), "C2, C1,C2")
    assert spec.fields == ("C2", "C1") and spec.name == "C2,C1"
    with pytest.raises(ValueError, match=r"--slice 'I1,C1': expected .* single-valued "
                                         r"categorical fields from \['C1', .*'C26'\]; not "
                                         r"among them: \['I1'\]"):
        slice_spec(schema, ModelConfig(), "I1,C1")


def test_a_slice_with_no_row_of_the_model_is_refused(trained, tmp_path, capsys):
    """A --keys-from file sharing no key with the model was exported as a 0-row slice,
    which answered every lookup with zero rows."""
    _, _, model = trained
    other = tmp_path / "other.tsv"
    other.write_text("item\ttopic\nno-such-item\tno-such-topic\n")
    out = tmp_path / "x"
    capsys.readouterr()
    assert main(["export", "--model", model, "--out", str(out), "--slice", "item_tower",
                 "--keys-from", str(other)]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "is a row of the model" in err and "no version written" in err
    assert not (out / "LATEST").exists()


def test_keys_from_a_folder_says_so(tmp_path):
    from terarec.retrieval.slices import field_keys

    with pytest.raises(FileNotFoundError, match=f"{tmp_path}: a folder, expected a file"):
        field_keys([tmp_path], FeatureSchema.criteo(), ["C1"])
    with pytest.raises(FileNotFoundError, match="none.tsv: no such file"):
        field_keys([tmp_path / "none.tsv"], FeatureSchema.criteo(), ["C1"])


@pytest.mark.parametrize("kind", ["ivfpq", "hnsw"])
def test_delta_reembeds_only_changed_items(trained, tmp_path, kind):
    import shutil

    from safetensors.torch import load_file

    from terarec.export.reader import VersionReader
    from terarec.export.writer import ModelExporter
    from terarec.retrieval.index import IndexOptions, update_index
    from terarec.retrieval.slices import version_rows

    tmp, log, _ = trained
    uri, out = tmp_path / "items", tmp_path / "idx"
    shutil.copytree(tmp / "item_tower", uri)
    options = IndexOptions(kind=kind, nlist=8, nprobe=8)
    assert update_index(str(uri), catalog_path(log), out, options)["mode"] == "full"
    before = load_index(out)
    exporter = ModelExporter(uri)
    latest = exporter.latest()
    keys, values = version_rows(exporter, latest)
    item_keys = before.keys[:5, 0]  # the item-id keys of the first five items
    pick = np.flatnonzero(np.isin(keys, item_keys))
    dense = load_file(str(VersionReader(exporter.storage, tmp_path / "c").fetch(
        latest, latest.data["dense"])))
    exporter.write_delta(dense=dense, keys=keys[pick], values=values[pick] + 0.5,
                         deleted=np.empty(0, np.int64), pass_id=latest.pass_id + 1)
    step = update_index(str(uri), catalog_path(log), out, options)
    assert step["mode"] == "delta" and step["embedded"] == 5
    after = load_index(out)
    moved = np.abs(after.vectors - before.vectors).sum(axis=1) > 0
    assert moved[:5].all() and not moved[5:].any()
    query = after.vectors[:1].copy()
    items, _ = after.search(query, 5)
    assert items[0][0] == 0  # the changed item is found by its new vector
    assert len(set(after.search(after.vectors[:20], 1)[0][:, 0])) > 10


@pytest.mark.slow
def test_wide_and_deep_slices_add_up_to_the_whole_model(trained, tmp_path):
    tmp, log, _ = trained
    model = tmp_path / "wd"
    assert main(["train", "--train", str(log), "--out", str(model), "--format", "csv",
                 "--label", "label", "--categorical", "user,item,topic", "--delimiter", "\t",
                 "--model", "widedeep", "--epochs", "1", "--batch-size", "512",
                 "--no-progress"]) == 0
    logits = {}
    for name in ("wide", "deep", None):
        out = tmp_path / (name or "whole")
        argv = ["export", "--model", str(model), "--out", str(out)]
        if name:
            argv += ["--slice", name, "--keys-from", str(log)]
        assert main(argv) == 0
        engine = ServingEngine(str(out), cache_dir=tmp_path / f"c-{name}")
        assert engine.refresh()
        with TestClient(create_app(engine)) as client:
            reply = client.post("/predict", json={"context": {"user": 3}, "candidates": [
                {"item": 1, "topic": 2}, {"item": 7, "topic": 5}]})
            assert reply.status_code == 200, reply.text
            p = np.array(reply.json()["scores"], np.float64)
        logits[name] = np.log(p / (1 - p))
    np.testing.assert_allclose(logits["wide"] + logits["deep"], logits[None], atol=1e-4)
    assert not np.allclose(logits["wide"], logits[None], atol=1e-4)


def _start(app):
    """uvicorn serving ``app`` on a free loopback port in a thread: (server, thread, port)."""
    import threading
    import time

    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning",
                                           lifespan="on"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive()
        time.sleep(0.02)
    return server, thread, server.servers[0].sockets[0].getsockname()[1]


def test_schemathesis_on_retrieve_finds_no_5xx_and_no_answer_off_the_document(trained):
    import urllib.request

    import schemathesis
    from hypothesis import HealthCheck, given, settings
    from schemathesis.checks import (
        content_type_conformance,
        not_a_server_error,
        response_schema_conformance,
        status_code_conformance,
    )

    tmp, _, _ = trained
    engine = ServingEngine(str(tmp / "user_tower"), cache_dir=tmp / "cache-s")
    assert engine.refresh()
    server, thread, port = _start(create_app(engine, index=load_index(tmp / "idx"),
                                             max_top_k=50))
    base = f"http://127.0.0.1:{port}"
    codes: list[int] = []
    try:
        with urllib.request.urlopen(f"{base}/openapi.json") as r:
            doc = json.loads(r.read())
        context = doc["components"]["schemas"]["RetrieveRequest"]["properties"]["context"]
        assert "user" in context["properties"] and context["additionalProperties"] is False
        schema = schemathesis.openapi.from_url(f"{base}/openapi.json")
        operation = next(op.ok() for op in schema.get_all_operations()
                         if op.ok().label == "POST /retrieve")
        for mode in (schemathesis.GenerationMode.POSITIVE,
                     schemathesis.GenerationMode.NEGATIVE):
            @settings(max_examples=40, deadline=None, derandomize=True, database=None,
                      suppress_health_check=list(HealthCheck))
            @given(case=operation.as_strategy(generation_mode=mode))
            def run(case) -> None:
                response = case.call(base_url=base)
                case.validate_response(response, checks=[
                    not_a_server_error, status_code_conformance, content_type_conformance,
                    response_schema_conformance])
                codes.append(response.status_code)

            run()
    finally:
        server.should_exit = True
        thread.join(timeout=30)
    assert codes.count(200) >= 5 and all(code < 500 for code in codes)


def test_running_server_follows_new_index_generations(trained, tmp_path):
    """`terarec index` writes a new generation while the server runs: /retrieve searches
    it after the next poll, no request fails meanwhile, and a generation built from a
    newer item tower waits until the matching user-tower version is served."""
    import http.client
    import shutil
    import threading
    import time

    from terarec.retrieval.index import IndexWatcher, update_index

    tmp, log, model = trained
    users, items, out = tmp_path / "users", tmp_path / "items", tmp_path / "idx"
    shutil.copytree(tmp / "user_tower", users)
    shutil.copytree(tmp / "item_tower", items)
    lines = catalog_path(log).read_text().splitlines(keepends=True)
    first = tmp_path / "first.items"
    first.write_text("".join(lines[:401]))  # header and the first 400 items
    assert update_index(str(items), first, out)["generation"] == "g000001"

    engine = ServingEngine(str(users), cache_dir=tmp_path / "cache")
    assert engine.refresh()
    app = create_app(engine, index=IndexWatcher(out), max_top_k=1000, poll_interval_s=0.1)
    server, thread, port = _start(app)

    def retrieve(user: int = 5, top_k: int = 1000) -> dict:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        try:
            conn.request("POST", "/retrieve", body=json.dumps(
                {"context": {"user": user}, "top_k": top_k}),
                headers={"Content-Type": "application/json"})
            reply = conn.getresponse()
            body = json.loads(reply.read())
            assert reply.status == 200, body
            return body
        finally:
            conn.close()

    failures: list[BaseException] = []
    stop = threading.Event()

    def hammer() -> None:
        while not stop.is_set():
            try:
                retrieve(user=int(np.random.default_rng().integers(USERS)), top_k=50)
            except BaseException as exc:  # noqa: BLE001 - any failure fails the test
                failures.append(exc)

    def wait_for(generation: str) -> dict:
        deadline = time.monotonic() + 30
        while (body := retrieve())["index"] != generation:
            assert time.monotonic() < deadline, body["index"]
            time.sleep(0.05)
        return body

    clients = [threading.Thread(target=hammer) for _ in range(2)]
    try:
        for c in clients:
            c.start()
        before = retrieve()
        old_ids = {line.split("\t")[0] for line in lines[1:401]}
        assert before["index"] == "g000001" and set(before["items"]) <= old_ids
        assert len(before["items"]) > 300
        # the whole catalog: a rebuild from the same item tower; served at the next poll
        assert update_index(str(items), catalog_path(log), out)["generation"] == "g000002"
        after = wait_for("g000002")
        assert len(after["items"]) > 400 and len(set(after["items"]) - old_ids) > 50
        # an item tower exported from a newer version: its index waits for that version
        assert main(["export", "--model", model, "--out", str(items), "--slice",
                     "item_tower", "--keys-from", str(log)]) == 0
        assert update_index(str(items), catalog_path(log), out)["version"] == "v000002"
        time.sleep(0.5)  # several polls: the watcher has loaded g000003 by now
        assert retrieve()["index"] == "g000002" and retrieve()["version"] == 1
        assert main(["export", "--model", model, "--out", str(users), "--slice",
                     "user_tower", "--keys-from", str(log)]) == 0
        served = wait_for("g000003")
        assert served["version"] == 2
    finally:
        stop.set()
        for c in clients:
            c.join(timeout=30)
        server.should_exit = True
        thread.join(timeout=30)
    assert not failures, failures[:3]
