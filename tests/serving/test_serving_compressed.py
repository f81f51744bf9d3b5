"""A model exported with 1-8 bit or codebook rows serves exactly its offline (decoded)
predictions."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from terarec.cli.main import main as cli_main
from terarec.config import ModelConfig, TrainConfig
from terarec.data.readers import iter_batches
from terarec.data.synth import generate
from terarec.export import Storage, read_manifest
from terarec.export.compressed import RowCodec, compress_rows, decompress_rows
from terarec.modeldir import save_checkpoint
from terarec.serving.engine import ServingEngine
from terarec.train.trainer import Trainer
from terarec.types import FeatureSchema

SCHEMA = FeatureSchema.criteo()


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A small DeepFM trained on synthetic data, its model folder and some test rows."""
    root = tmp_path_factory.mktemp("compressed-serving")
    generate(root / "train.tsv", 3000, model_seed=0, sample_seed=5, vocab_scale=0.02)
    generate(root / "test.tsv", 600, model_seed=0, sample_seed=6, vocab_scale=0.02)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    config = TrainConfig(batch_size=300, pass_rows=1000, seed=1, threads=1,
                         model=ModelConfig(name="deepfm", embedding_dim=7, deep_mlp=(16,)))
    trainer = Trainer(SCHEMA, config)
    trainer.fit([root / "train.tsv"], progress=False)
    save_checkpoint(root / "model", trainer)
    batch = next(iter(iter_batches(root / "test.tsv", SCHEMA, 600)))
    yield trainer, root, batch
    torch.set_num_threads(threads)


def offline_scores(trainer: Trainer, batch, codec: RowCodec) -> np.ndarray:
    """The trainer's predictions with every row replaced by its decoded export."""
    arrays = trainer.store.to_arrays()
    decoded = decompress_rows(compress_rows(arrays["keys"], arrays["values"], codec))
    trainer.store.load_arrays({**arrays, "values": decoded})
    try:
        return trainer.predict_batches([batch])
    finally:
        trainer.store.load_arrays(arrays)


@pytest.mark.parametrize("flags", [["--bits", "2"], ["--bits", "1"], ["--bits", "8"],
                                   ["--bits", "2", "--codebook"]])
def test_compressed_export_serves_its_offline_predictions(trained, tmp_path, capsys, flags):
    trainer, root, batch = trained
    uri = tmp_path / "export"
    assert cli_main(["export", "--model", str(root / "model"), "--out", str(uri),
                     "--shard-rows", "500", *flags]) == 0
    codec = RowCodec(int(flags[1]), codebook="--codebook" in flags)
    manifest = read_manifest(Storage(uri), "v000001")
    assert manifest.data["sparse"]["codec"] == codec.name and len(manifest.shards) > 1
    shard_bytes = sum(manifest.files[s["file"]]["bytes"] for s in manifest.shards)
    rows = manifest.data["sparse"]["rows"]
    assert shard_bytes < rows * (8 + codec.row_bytes(8)) + 4096 * len(manifest.shards)
    engine = ServingEngine(uri)
    assert engine.refresh()
    served = engine.score_batch(batch)
    # shards are encoded one by one, so codebooks are fitted per shard: compare row-wise
    # codecs exactly with the offline model, codebooks with the decoded shards themselves
    if not codec.codebook:
        np.testing.assert_allclose(served, offline_scores(trainer, batch, codec),
                                   rtol=0, atol=1e-6)
    exact = trainer.predict_batches([batch])
    err = np.abs(served - exact).max()
    assert (err > 0) if codec.bits < 8 else (err < 5e-3)
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert printed["rows"] == rows


def test_codebook_shards_score_as_their_decoded_rows(trained, tmp_path):
    trainer, root, batch = trained
    uri = tmp_path / "export"
    assert cli_main(["export", "--model", str(root / "model"), "--out", str(uri),
                     "--bits", "2", "--codebook"]) == 0  # one shard: one codebook
    engine = ServingEngine(uri)
    assert engine.refresh()
    np.testing.assert_allclose(engine.score_batch(batch),
                               offline_scores(trainer, batch, RowCodec(2, codebook=True)),
                               rtol=0, atol=1e-6)


def test_export_rejects_a_codebook_without_integer_bits(trained, tmp_path, capsys):
    _, root, _ = trained
    assert cli_main(["export", "--model", str(root / "model"), "--out", str(tmp_path / "x"),
                     "--bits", "16", "--codebook"]) != 0
    assert "--codebook takes --bits 1, 2, 4, 8, got --bits 16" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
