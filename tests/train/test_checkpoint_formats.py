"""Every sparse layout a checkpoint may hold restores, exports and inspects alike:
``sparse/`` written by ``store.save`` (memory or tiered), ``sparse.safetensors`` of
checkpoints written before stores saved themselves, and per-rank torchrun shards."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file

from terarec.cli.inspect import show_histogram, summarise
from terarec.config import ModelConfig, StoreConfig, TrainConfig
from terarec.data.synth import generate
from terarec.embedding.store import STORE_TOTALS
from terarec.export import Storage, export_model_dir, read_manifest
from terarec.io import sha256_file
from terarec.kernels import shard_of
from terarec.modeldir import load_checkpoint, save_checkpoint
from terarec.train.trainer import Trainer
from terarec.types import FeatureSchema


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    path = tmp_path_factory.mktemp("formats") / "train.tsv"
    generate(path, 2400, model_seed=0, sample_seed=5, vocab_scale=0.01)
    return path


def _train(data, model_dir, budget=None, store_dir=None) -> Trainer:
    torch.set_num_threads(1)
    config = TrainConfig(batch_size=200, pass_rows=600, seed=1, threads=1,
                         model=ModelConfig(name="fm", embedding_dim=4),
                         store=StoreConfig(admit_min_count=2, memory_budget=budget,
                                           disk_path=store_dir))
    trainer = Trainer(FeatureSchema.criteo(), config)
    trainer.fit([data], progress=False)
    save_checkpoint(model_dir, trainer)
    return trainer


def _rewrite_meta(ckpt_path, sha: dict, **changes) -> None:
    meta = json.loads((ckpt_path / "meta.json").read_text())
    meta.update(sha256=sha, **changes)
    (ckpt_path / "meta.json").write_text(json.dumps(meta))


def _as_old_layout(model_dir) -> None:
    """Turn the newest checkpoint into the layout written before ``store.save``."""
    path = load_checkpoint(model_dir).path
    shutil.move(path / "sparse" / "rows.safetensors", path / "sparse.safetensors")
    (path / "sparse").rmdir()
    meta = json.loads((path / "meta.json").read_text())
    sha = {k: v for k, v in meta["sha256"].items() if not k.startswith("sparse/")}
    sha["sparse.safetensors"] = sha256_file(path / "sparse.safetensors")
    _rewrite_meta(path, sha)


def _as_two_rank_shards(model_dir) -> None:
    """Split the newest checkpoint's rows into the per-rank files torchrun writes."""
    path = load_checkpoint(model_dir).path
    arrays = load_file(str(path / "sparse" / "rows.safetensors"))
    shutil.rmtree(path / "sparse")
    meta = json.loads((path / "meta.json").read_text())
    sha = {k: v for k, v in meta["sha256"].items() if not k.startswith("sparse/")}
    names = []
    for rank in range(2):
        rows = shard_of(arrays["keys"], 2) == rank
        cands = shard_of(arrays["cand_keys"], 2) == rank
        part = {k: (v[cands] if k.startswith("cand_") else
                    v if k in STORE_TOTALS and rank == 0 else
                    np.zeros_like(v) if k in STORE_TOTALS else v[rows])
                for k, v in arrays.items()}
        name = f"sparse-{rank:05d}-of-00002.safetensors"
        save_file(part, str(path / name))
        sha[name] = sha256_file(path / name)
        names.append(name)
    _rewrite_meta(path, sha, sparse_shards=names, world_size=2)


@pytest.mark.parametrize("layout", ["memory", "tiered", "old-memory", "two-ranks"])
def test_every_layout_restores_exports_and_inspects_the_same_table(data, tmp_path, layout):
    model = tmp_path / "model"
    budget = "4MB" if layout == "tiered" else None
    trainer = _train(data, model, budget, str(tmp_path / "live") if budget else None)
    want = trainer.store.to_arrays()
    if layout == "old-memory":
        _as_old_layout(model)
    elif layout == "two-ranks":
        _as_two_rank_shards(model)
    ckpt = load_checkpoint(model)
    chunks = list(ckpt.iter_sorted(97))
    assert all(0 < len(c) <= 97 for c in chunks)
    keys = np.concatenate([c.keys for c in chunks])
    np.testing.assert_array_equal(keys, want["keys"])
    np.testing.assert_array_equal(np.concatenate([c.values for c in chunks]), want["values"])
    # restore
    got = Trainer.from_checkpoint(model).store.to_arrays()
    for name in ("keys", "values", "state", "show", "cand_keys", "counters"):
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    # export, streamed shard by shard
    uri = tmp_path / "export"
    result = export_model_dir(model, uri, shard_rows=150)
    manifest = read_manifest(Storage(uri), result.name)
    assert result.rows == len(want["keys"]) and len(manifest.shards) == -(-result.rows // 150)
    folder = Storage(uri).local_path(result.name)
    shards = [load_file(str(folder / s["file"])) for s in manifest.shards]
    np.testing.assert_array_equal(np.concatenate([s["keys"] for s in shards]), want["keys"])
    np.testing.assert_array_equal(np.concatenate([s["values"] for s in shards]),
                                  want["values"])
    # inspect
    info = summarise(model)
    assert info["keys"] == len(want["keys"])
    assert info["show_histogram"] == show_histogram(want["show"])


def test_show_histogram_sums_chunks_as_one_array():
    show = np.random.default_rng(0).zipf(1.5, 5000).astype(np.float32) - 1
    assert show_histogram(iter(np.array_split(show, 7))) == show_histogram(show)
