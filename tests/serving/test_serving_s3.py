"""Round trip through an S3-compatible store (moto's server on loopback): train, export a
full version and a delta to s3://, serve from there, score as the trainer does."""

from __future__ import annotations

import json

import numpy as np
import pytest
from serving_helpers import SCHEMA, make_data, raw_records, small_config

from terarec.cli.main import main as cli_main
from terarec.data.readers import batch_from_records
from terarec.export import IncrementalExporter, Storage, latest_version, read_manifest
from terarec.modeldir import save_checkpoint
from terarec.serving.engine import ServingEngine
from terarec.train.trainer import Trainer

pytest.importorskip("s3fs")
pytest.importorskip("moto.server")


@pytest.fixture
def s3(s3_server):
    """Storage options for a fresh S3 server with one bucket."""
    Storage("s3://models", s3_server).fs.mkdir("models")
    return s3_server


def test_export_and_serve_through_s3(s3, tmp_path):
    data = make_data(tmp_path / "train.tsv", 2000)
    records = raw_records(data, 48)
    batch = batch_from_records(records, SCHEMA)
    uri = "s3://models/ctr"
    trainer = Trainer(SCHEMA, small_config())
    exporter = IncrementalExporter(uri, trainer, every_passes=1, storage_options=s3)
    engine = ServingEngine(uri, storage_options=s3, cache_dir=tmp_path / "cache")
    expected = {}

    def on_pass_end(t, record):
        result = exporter.on_pass_end(t, record)
        expected[result.name] = t.predict_batches([batch])
        assert engine.refresh()
        assert engine.current.name == result.name
        np.testing.assert_allclose(engine.score_batch(batch), expected[result.name],
                                   atol=1e-5)

    trainer.fit([data], progress=False, on_pass_end=on_pass_end)
    assert sorted(expected) == ["v000001", "v000002"]
    storage = Storage(uri, s3)
    assert latest_version(storage) == "v000002"
    assert read_manifest(storage, "v000002").kind == "delta"
    # Shards came down to the local cache folder to be memory-mapped there.
    assert list((tmp_path / "cache" / "v000001" / "sparse").glob("shard-*.safetensors"))

    # A corrupted object is refused; the engine keeps serving version 2.
    exporter.export(trainer)
    storage.write_bytes("v000003/dense.safetensors", b"not a tensor file")
    assert not engine.refresh()
    assert engine.current.name == "v000002"
    assert "v000003" in engine.refused

    # `terarec export` writes a checkpoint straight to the bucket as a full version.
    save_checkpoint(tmp_path / "model", trainer)
    assert cli_main(["export", "--model", str(tmp_path / "model"), "--out", uri,
                     "--storage-options", json.dumps(s3)]) == 0
    assert engine.refresh()
    assert engine.current.manifest.kind == "full" and engine.current.name == "v000004"
    np.testing.assert_allclose(engine.score_batch(batch), trainer.predict_batches([batch]),
                               atol=1e-5)
    engine.close()
