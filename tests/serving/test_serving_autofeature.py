"""A model trained with AutoFeature tables serves raw requests with the same features:
the export carries the tables and the server joins them onto every request."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.csv as pa_csv
import pytest
from serving_helpers import ServerThread, split_context

from terarec.autofeature import Candidate, compute_tables
from terarec.autofeature.features import FeatureConfig
from terarec.cli.main import main
from terarec.data.synth_features import generate_planted
from terarec.serving.app import create_app
from terarec.serving.engine import ServingEngine

FEATURES = [Candidate("count", ("C3",)), Candidate("cross_count", ("C5", "C7")),
            Candidate("groupby", ("I1", "C3"), "avg")]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """Planted data, a feature config, a model trained on it (exported during training
    too), its offline predictions for rows with unseen values, and the rows as records."""
    root = tmp_path_factory.mktemp("autofeature-serving")
    data = generate_planted(root / "train.csv", root / "valid.csv", 6000, 1500, seed=2)
    tables = compute_tables(FEATURES, data.train, data.schema, root / "all")
    FeatureConfig(data.schema, tables).save(root / "features.json")
    model, live = root / "model", root / "live-export"
    assert main(["train", "--features", str(root / "features.json"), "--train",
                 str(data.train), "--valid", str(data.valid), "--out", str(model),
                 "--model", "deepfm", "--embedding-dim", "4", "--batch-size", "500",
                 "--pass-rows", "3000", "--threads", "1", "--no-progress",
                 "--export-to", str(live)]) == 0

    names = ["label", "I1", "I2", *[f"C{i}" for i in range(1, 9)]]
    table = pa_csv.read_csv(data.valid, convert_options=pa_csv.ConvertOptions(
        column_types={n: pa.string() for n in names}))
    records = [{k: v for k, v in r.items() if k != "label"}
               for r in table.slice(0, 200).to_pylist()]
    for i in range(0, 200, 4):
        records[i]["C3"] = f"never-{i}"       # unseen: count bucket "0", avg missing
    for i in range(1, 200, 5):
        del records[i]["C5"]                   # missing: the count of missing values
    rows = tmp_path_factory.mktemp("rows") / "rows.csv"
    with open(rows, "w") as fh:
        fh.write(",".join(names) + "\n")
        for r in records:
            fh.write(",".join(["0", *[r.get(n) or "" for n in names[1:]]]) + "\n")
    scores = root / "scores.txt"
    # The live export follows every pass and ends on the model BEST names.
    assert main(["predict", "--model", str(model), "--data", str(rows),
                 "--out", str(scores)]) == 0
    return model, live, records, np.loadtxt(scores), root


def test_exported_version_carries_the_tables_and_scores_like_predict(run):
    model, _, records, offline, root = run
    uri = root / "export"
    assert main(["export", "--model", str(model), "--out", str(uri)]) == 0
    engine = ServingEngine(uri)
    try:
        assert engine.refresh()
        version = engine.served()
        manifest = version.manifest.data
        assert manifest["features"] == "features"
        assert {f"features/{p.name}" for p in (model / "features").iterdir()} <= \
            set(manifest["files"])
        assert version.features is not None
        assert "count(C3)" not in version.feature_names and "C3" in version.feature_names
        served, _ = engine.score_records(records)
        np.testing.assert_allclose(served, offline, rtol=1e-5, atol=1e-6)
    finally:
        engine.close()


def test_http_server_and_live_export_score_like_predict(run):
    _, live, records, offline, _ = run
    engine = ServingEngine(live)
    try:
        assert engine.refresh()
        assert engine.served().features is not None  # deltas keep the base's tables
        with ServerThread(create_app(engine)) as server:
            context, candidates, merged = split_context(records, ("C1", "C2"))
            assert merged == [{**context, **c} for c in candidates]
            # Rows sharing the first record's C1, C2 as context.
            same = [i for i, r in enumerate(records)
                    if r.get("C1") == context.get("C1") and r.get("C2") == context.get("C2")]
            assert same
            _, scores = server.predict(context, [candidates[i] for i in same])
            np.testing.assert_allclose(scores, offline[same], rtol=1e-5, atol=1e-6)
            status, body = server.request("POST", "/predict", {
                "candidates": [{**records[0], "count(C3)": "5"}]})
            assert status == 422 and "count(C3)" in json.dumps(body)
    finally:
        engine.close()
