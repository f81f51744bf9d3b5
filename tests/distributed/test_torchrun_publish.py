"""Publishing from distributed training: 2 torchrun ranks, each with a tiered store under
``--memory-budget``, AutoFeature tables (``--features``) and ``--export-to``; the versions
they write serve the scores ``terarec predict`` gives on the model directory, and the
other commands read that directory shard by shard."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pa_csv
import pytest
from test_torchrun import _run, torchrun

from terarec.autofeature import Candidate, compute_tables
from terarec.autofeature.features import FeatureConfig
from terarec.data.synth_features import generate_planted
from terarec.export import latest_version, read_manifest
from terarec.export.storage import Storage
from terarec.modeldir import load_checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "serving"))
from serving_helpers import ServerThread, split_context  # noqa: E402

from terarec.serving.app import create_app  # noqa: E402
from terarec.serving.engine import ServingEngine  # noqa: E402

pytestmark = [pytest.mark.dist, pytest.mark.slow]

FEATURES = [Candidate("count", ("C3",)), Candidate("cross_count", ("C5", "C7"))]
NAMES = ["label", "I1", "I2", *[f"C{i}" for i in range(1, 9)]]


def terarec(*args: str) -> str:
    return _run([sys.executable, "-m", "terarec", *args]).stdout


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    root = tmp_path_factory.mktemp("publish")
    data = generate_planted(root / "train.csv", root / "valid.csv", 6000, 1500, seed=2)
    tables = compute_tables(FEATURES, data.train, data.schema, root / "all")
    FeatureConfig(data.schema, tables).save(root / "features.json")
    model, live = root / "model", root / "live"
    # With --valid: the versions follow the passes, then the selected model (the best
    # pass: passes cut from epochs are not refit) is written last, the one predict scores.
    torchrun(["--features", str(root / "features.json"), "--train", str(data.train),
              "--valid", str(data.valid), "--out", str(model), "--model", "deepfm",
              "--embedding-dim", "4", "--batch-size", "500", "--pass-rows", "2000",
              "--threads", "1", "--no-progress", "--memory-budget", "600KB",
              "--export-to", str(live)])
    table = pa_csv.read_csv(data.valid, convert_options=pa_csv.ConvertOptions(
        column_types={n: pa.string() for n in NAMES}))
    records = [{k: v for k, v in r.items() if k != "label"}
               for r in table.slice(0, 200).to_pylist()]
    rows = root / "rows.csv"
    with open(rows, "w") as fh:
        fh.write(",".join(NAMES) + "\n")
        for r in records:
            fh.write(",".join(["0", *[r.get(n) or "" for n in NAMES[1:]]]) + "\n")
    terarec("predict", "--model", str(model), "--data", str(rows), "--out",
            str(root / "scores.txt"))
    return root, model, live, records, np.loadtxt(root / "scores.txt"), data


def test_two_ranks_with_tiered_stores_write_one_shard_each(published):
    _, model, _, _, _, _ = published
    ckpt = load_checkpoint(model)
    assert ckpt.world_size == 2 and ckpt.tiered and len(ckpt.shards) == 2
    assert len(ckpt.meta["stores"]) == 2
    for rank_store in ckpt.meta["stores"]:  # the budget held: rows went to disk
        assert rank_store["tiers"]["disk_keys"] > rank_store["tiers"]["memory_keys"] > 0
    info = json.loads(terarec("inspect", str(model), "--json").splitlines()[-1])
    assert info["keys"] == ckpt.meta["store"]["keys"] == len(ckpt.sparse["keys"]) > 1000
    assert info["store"] == "tiered"


def test_versions_published_by_the_ranks_serve_the_scores_of_predict(published):
    _, _, live, records, offline, _ = published
    storage = Storage(str(live))
    name = latest_version(storage)
    metrics = json.loads((published[1] / "metrics.json").read_text())
    assert metrics["passes"] > metrics["best_pass"]  # later passes were published too
    assert metrics["selected_version"] == name
    manifest = read_manifest(storage, name)
    assert manifest.kind == "full" and manifest.data["features"] == "features"
    assert manifest.pass_id == metrics["best_pass"]
    assert manifest.data["sparse"]["rows"] > 1000
    trained = read_manifest(storage, f"v{int(name[1:]) - 1:06d}")  # the last pass's
    assert trained.kind == "delta" and read_manifest(storage, trained.base).kind == "full"
    engine = ServingEngine(live)
    try:
        assert engine.refresh()
        assert engine.served().name == manifest.name
        with ServerThread(create_app(engine)) as server:
            context, candidates, _ = split_context(records, ("C1", "C2"))
            same = [i for i, r in enumerate(records)
                    if r.get("C1") == context.get("C1") and r.get("C2") == context.get("C2")]
            assert same
            _, scores = server.predict(context, [candidates[i] for i in same])
            np.testing.assert_allclose(scores, offline[same], rtol=1e-5, atol=1e-6)
            status, body = server.request("POST", "/predict", {"candidates": records})
            assert status == 200
            np.testing.assert_allclose(body["scores"], offline, rtol=1e-5, atol=1e-6)
    finally:
        engine.close()


def test_export_and_eval_read_the_distributed_model(published):
    root, model, _, records, offline, data = published
    terarec("export", "--model", str(model), "--out", str(root / "export"))
    engine = ServingEngine(root / "export")
    try:
        assert engine.refresh()
        served, _ = engine.score_records(records)
        np.testing.assert_allclose(served, offline, rtol=1e-5, atol=1e-6)
    finally:
        engine.close()
    metrics = json.loads(terarec("eval", "--model", str(model), "--data",
                                 str(data.valid)).splitlines()[-1])
    trained = json.loads((model / "metrics.json").read_text())
    assert trained["world_size"] == 2 and trained["evaluated_on"] == "valid"
    assert metrics["auc"] == pytest.approx(trained["auc"], abs=1e-6)
