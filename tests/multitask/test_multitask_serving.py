"""A model of several labels exported and served: every task's score from ``/predict``
and one v2 output per task, equal to ``Model.predict``."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pa_csv
import pytest
from multitask_helpers import FIELDS, QUICK, write_pair

import terarec

ROWS = 40


@pytest.fixture(scope="module", params=["mmoe", "esmm"])
def served(request, tmp_path_factory):
    """(model, export folder, request records, the records' file) for one model kind."""
    folder = tmp_path_factory.mktemp(f"serve-{request.param}")
    train, valid = write_pair(folder, rows=2000, valid_rows=ROWS)
    model = terarec.fit(train, out=folder / "model", label="click,conversion",
                        model={**QUICK["model"], "name": request.param},
                        **{k: v for k, v in QUICK.items() if k not in ("model", "refit")},
                        **FIELDS)
    model.export(str(folder / "export"))
    table = pa_csv.read_csv(valid, convert_options=pa_csv.ConvertOptions(
        column_types={n: pa.string() for n in ("click", "conversion")},
        strings_can_be_null=True))
    records = [{k: v for k, v in r.items() if k not in ("click", "conversion")
                and v not in (None, "")} for r in table.to_pylist()]
    return model, folder / "export", records, valid


@pytest.fixture(scope="module")
def client(served):
    from fastapi.testclient import TestClient

    from terarec.serving.app import create_app
    from terarec.serving.engine import ServingEngine

    engine = ServingEngine(served[1])
    engine.refresh()
    with TestClient(create_app(engine), raise_server_exceptions=False) as c:
        yield c
    engine.close()


def test_the_export_records_the_tasks(served) -> None:
    manifests = list(Path(served[1]).rglob("manifest.json"))
    assert manifests
    text = manifests[0].read_text()
    assert '"extra_labels"' in text and '"conversion"' in text


def test_predict_gives_every_task_and_matches_model_predict(served, client) -> None:
    model, _, records, valid = served
    want = model.predict(valid)
    assert want.shape == (ROWS, 2)
    response = client.post("/predict", json={"context": {}, "candidates": records})
    assert response.status_code == 200, response.text
    body = response.json()
    tasks = body["task_scores"]
    assert list(tasks) == ["click", "conversion"]
    got = np.stack([tasks["click"], tasks["conversion"]], axis=1)
    np.testing.assert_allclose(got, want, atol=2e-5)
    assert body["scores"] == tasks["click"]
    assert not np.allclose(got[:, 0], got[:, 1])  # two tasks, two scores


def test_v2_infer_gives_one_output_per_task(served, client) -> None:
    model, _, records, valid = served
    meta = client.get("/v2/models/terarec").json()
    assert [o["name"] for o in meta["outputs"]] == ["click", "conversion"]
    names = [f.name for f in model.schema.fields]
    inputs = [{"name": n, "datatype": "BYTES", "shape": [ROWS],
               "data": [r.get(n) for r in records]} for n in names
              if model.schema.fields[names.index(n)].kind == "categorical"]
    inputs += [{"name": n, "datatype": "FP64", "shape": [ROWS],
                "data": [float(r[n]) if n in r else None for r in records]} for n in names
               if model.schema.fields[names.index(n)].kind == "numeric"]
    response = client.post("/v2/models/terarec/infer", json={"inputs": inputs})
    assert response.status_code == 200, response.text
    outputs = response.json()["outputs"]
    assert [o["name"] for o in outputs] == ["click", "conversion"]
    want = model.predict(valid)
    for t, out in enumerate(outputs):
        assert out["shape"] == [ROWS]
        np.testing.assert_allclose(out["data"], want[:, t], atol=2e-5)
    one = client.post("/v2/models/terarec/infer",
                      json={"inputs": inputs, "outputs": [{"name": "conversion"}]})
    assert [o["name"] for o in one.json()["outputs"]] == ["conversion"]
    bad = client.post("/v2/models/terarec/infer",
                      json={"inputs": inputs, "outputs": [{"name": "score"}]})
    assert bad.status_code == 422
    assert "['click', 'conversion']" in json.dumps(bad.json())
