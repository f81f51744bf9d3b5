"""``terarec export --delta`` (``Model.export(..., delta=True)``): a model directory's
checkpoint written as a delta on the export's newest version. Applied on that version it
gives exactly the checkpoint's rows, and a server that loaded the previous version swaps
to it and scores as the model does."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from terarec.api.model import Model
from terarec.cli.main import main
from terarec.embedding.store import CHUNK_ROWS
from terarec.export import ModelExporter
from terarec.export.delta import version_rows
from terarec.export.format import read_manifest
from terarec.export.storage import Storage
from terarec.modeldir import checkpoint_name, load_checkpoint, read_model_meta
from terarec.serving.engine import ServingEngine
from tests.serving.serving_helpers import make_data, raw_records

# every row every epoch (no validation rows carved): resumed with a second file
TRAIN = ["--model", "lr", "--epochs", "1", "--batch-size", "250", "--threads", "1",
         "--no-progress", "--valid-split", "0"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A model trained on one file, exported; then trained on a second file too."""
    root = tmp_path_factory.mktemp("delta")
    first, second = make_data(root / "a.tsv", 1500), make_data(root / "b.tsv", 1500, 7)
    model = root / "m"
    assert main(["train", "--train", str(first), "--out", str(model), *TRAIN]) == 0
    assert main(["export", "--model", str(model), "--out", str(root / "export")]) == 0
    shutil.copytree(root / "export", root / "export-v1")  # the full version alone
    assert main(["train", "--resume", "--train", str(first), str(second), "--out",
                 str(model), *TRAIN]) == 0
    return root, model, second


def _checkpoint_rows(model):
    ckpt = load_checkpoint(model, checkpoint_name(model, "best"))
    chunks = list(ckpt.iter_sorted(CHUNK_ROWS))
    return (np.concatenate([c.keys for c in chunks]),
            np.concatenate([c.values for c in chunks]))


def test_the_delta_applies_on_the_previous_version_and_a_server_swaps_to_it(
        trained, tmp_path, capsys):
    root, model, second = trained
    export = tmp_path / "export"
    shutil.copytree(root / "export-v1", export)
    engine = ServingEngine(str(export), cache_dir=tmp_path / "cache")
    try:
        assert engine.refresh() and engine.served().manifest.name == "v000001"
        capsys.readouterr()
        assert main(["export", "--model", str(model), "--out", str(export), "--delta"]) == 0
        written = json.loads(capsys.readouterr().out)
        manifest = read_manifest(Storage(str(export)), "v000002")
        assert manifest.kind == "delta" and manifest.data["parent"] == "v000001"
        keys, values = _checkpoint_rows(model)
        # only what changed: the second file's new keys and the rows it trained
        assert 0 < manifest.data["sparse"]["rows"] < len(keys)
        assert written["rows"] == manifest.data["sparse"]["rows"]
        got_keys, got_values = version_rows(ModelExporter(str(export)), manifest)
        np.testing.assert_array_equal(got_keys, keys)
        np.testing.assert_array_equal(got_values, values)
        assert engine.refresh() and engine.served().manifest.name == "v000002"
        records = raw_records(second, 50)
        served = engine.score_records(records)[0]
        np.testing.assert_allclose(served, Model(model).predict(second)[:50], atol=1e-5)
    finally:
        engine.close()


def test_keys_gone_from_the_model_are_deleted(trained, tmp_path):
    root, model, _ = trained
    schema, config = read_model_meta(model)
    keys, values = _checkpoint_rows(model)
    gone = np.int64(keys.max() + 1)  # a key the version holds and the model does not
    ckpt = load_checkpoint(model, checkpoint_name(model, "best"))
    ModelExporter(str(tmp_path / "e")).write_full(
        schema=schema, model_config=config.model, dense=ckpt.dense,
        keys=np.append(keys, gone), values=np.vstack([values, values[:1]]), pass_id=1)
    Model(model).export(str(tmp_path / "e"), delta=True)
    manifest = read_manifest(Storage(str(tmp_path / "e")), "v000002")
    assert manifest.data["sparse"]["rows"] == 0  # every other row is the same
    got_keys, _ = version_rows(ModelExporter(str(tmp_path / "e")), manifest)
    np.testing.assert_array_equal(got_keys, keys)


@pytest.mark.parametrize("extra, message", [
    ([], "holds no version to build a delta on"),
    (["--bits", "8"], "--delta writes fp32 rows"),
    (["--slice", "wide"], "leave out --delta"),
])
def test_a_delta_that_cannot_be_written_is_one_line(trained, tmp_path, capsys, extra,
                                                    message):
    _, model, _ = trained
    assert main(["export", "--model", str(model), "--out", str(tmp_path / "empty"),
                 "--delta", *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_a_delta_on_another_models_version_is_refused(trained, tmp_path, capsys):
    root, model, second = trained
    other = tmp_path / "fm"
    assert main(["train", "--train", str(second), "--out", str(other), "--model", "fm",
                 "--epochs", "1", "--threads", "1", "--no-progress"]) == 0
    assert main(["export", "--model", str(other), "--out", str(tmp_path / "e")]) == 0
    capsys.readouterr()
    assert main(["export", "--model", str(model), "--out", str(tmp_path / "e"),
                 "--delta"]) == 2
    err = capsys.readouterr().err
    assert "is of another model" in err and "v000001" in err
