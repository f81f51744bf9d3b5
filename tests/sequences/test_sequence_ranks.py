"""A sequence field with a shared table on 2 gloo ranks under torchrun trains the model
one process trains (the slots' keys go to their owners like any field's)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from terarec.data.synth_history import HistorySettings, generate_history
from terarec.train.trainer import Trainer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
from test_torchrun import single, torchrun  # noqa: E402

pytestmark = pytest.mark.dist

ARGS = ["--format", "csv", "--label", "label", "--categorical", "user,item",
        "--sequence", "hist:4", "--share-table", "hist=item", "--model", "din",
        "--batch-size", "256", "--pass-rows", "512", "--epochs", "1",
        "--sparse-optimizer", "adam", "--embedding-dim", "8", "--threads", "1",
        "--no-progress", "--autocast", "off"]  # fp32: parity to 2e-5 (bf16 drifts)


def test_two_ranks_train_the_sequence_model_of_one_process(tmp_path: Path) -> None:
    world = HistorySettings(users=40, items=80, topics=4, subtopics=4, max_history=6)
    train, valid = tmp_path / "train.csv", tmp_path / "valid.csv"
    generate_history(train, 1100, settings=world)
    generate_history(valid, 300, sample_seed=1, settings=world)
    common = ["--train", str(train), "--valid", str(valid), *ARGS]
    single([*common, "--out", str(tmp_path / "one")])
    torchrun([*common, "--out", str(tmp_path / "two")])
    one = Trainer.from_checkpoint(tmp_path / "one")
    two = Trainer.from_checkpoint(tmp_path / "two")  # the two ranks' shards merged
    a, b = one.store.to_arrays(), two.store.to_arrays()
    assert len(a["keys"]) > 50
    assert np.array_equal(a["keys"], b["keys"])
    np.testing.assert_allclose(b["values"], a["values"], atol=2e-5)
    for name, weight in one.model.state_dict().items():
        torch.testing.assert_close(two.model.state_dict()[name], weight, atol=2e-5, rtol=1e-4)


def test_two_ranks_export_a_sequence_model_that_serves_as_it_predicts(tmp_path: Path) -> None:
    """A 2-rank run exporting as it trains (``--export-to``), and ``terarec export`` of
    its checkpoint after: ``/predict`` with the history as a list scores each row as
    ``Model.predict`` does."""
    import pyarrow.csv as pa_csv
    from fastapi.testclient import TestClient

    import terarec
    from terarec.cli.main import main
    from terarec.serving.app import create_app
    from terarec.serving.engine import ServingEngine

    world = HistorySettings(users=40, items=80, topics=4, subtopics=4, max_history=6)
    train, valid = tmp_path / "train.csv", tmp_path / "valid.csv"
    generate_history(train, 1100, settings=world)
    generate_history(valid, 40, sample_seed=1, settings=world)
    torchrun(["--train", str(train), "--valid-split", "0", *ARGS, "--out",
              str(tmp_path / "two"), "--export-to", str(tmp_path / "live")])
    want = terarec.Model(tmp_path / "two").predict(valid)
    assert np.ptp(want) > 0
    rows = pa_csv.read_csv(valid, convert_options=pa_csv.ConvertOptions(
        column_types={"user": "string", "item": "string", "hist": "string"})).to_pylist()
    records = [{"user": r["user"], "item": r["item"],
                "hist": r["hist"].split("|") if r["hist"] else []} for r in rows]
    assert main(["export", "--model", str(tmp_path / "two"), "--out",
                 str(tmp_path / "after")]) == 0
    for folder in ("live", "after"):
        engine = ServingEngine(tmp_path / folder)
        engine.refresh()
        with TestClient(create_app(engine), raise_server_exceptions=False) as client:
            r = client.post("/predict", json={"context": {}, "candidates": records})
            assert r.status_code == 200, r.text
            np.testing.assert_allclose(r.json()["scores"], want, atol=1e-5, err_msg=folder)
        engine.close()
