"""Admission and eviction through whole training runs: a run resumed from a checkpoint
ends with the store of an uninterrupted one (sketch state included), evicted keys reach
the deltas as deletions, and history records say what each pass admitted, rejected and
evicted."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

from terarec.config import ModelConfig, SparseOptimizerConfig, StoreConfig, TrainConfig
from terarec.data.synth import generate
from terarec.embedding.eviction import store_bytes
from terarec.export import IncrementalExporter, Storage, read_manifest
from terarec.export.format import DELETED_FILE
from terarec.modeldir import save_checkpoint
from terarec.train.trainer import Trainer
from terarec.types import FeatureSchema

SCHEMA = FeatureSchema.criteo()
POLICIES = dict(admit_min_count=2, admit_sketch_bytes="32KB", evict_l2_below=0.03,
                max_keys=900, evict_score="lfu")


@pytest.fixture(autouse=True)
def single_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    path = tmp_path_factory.mktemp("admission-data") / "train.tsv"
    generate(path, 3000, model_seed=0, sample_seed=5, vocab_scale=0.01)
    return path


def _config(store_dir=None, **store) -> TrainConfig:
    tiered = {"memory_budget": "1MB", "disk_path": str(store_dir)} if store_dir else {}
    # Full first steps: rows clear the L2 eviction bar the policies are set against.
    return TrainConfig(batch_size=200, pass_rows=600, seed=1, threads=1,
                       model=ModelConfig(name="deepfm", embedding_dim=4, deep_mlp=(16,)),
                       sparse_optimizer=SparseOptimizerConfig(initial_accumulator=0.0),
                       store=StoreConfig(**store, **tiered))


@pytest.mark.parametrize("tiered", [False, True])
def test_resumed_run_matches_the_uninterrupted_one(data, tmp_path, tiered):
    config = _config(tmp_path / "live" if tiered else None, **POLICIES)
    mid = tmp_path / "mid"
    sizes = []

    def on_pass_end(t: Trainer, record: dict) -> None:
        sizes.append(len(t.store))
        if t.pass_id == 2:
            save_checkpoint(mid, t)

    whole = Trainer(SCHEMA, config)
    whole.fit([data], progress=False, on_pass_end=on_pass_end)
    assert len(sizes) == 5 and max(sizes) == 900  # the capacity target binds, every pass
    cfg = _config(tmp_path / "resumed" if tiered else None, **POLICIES)
    resumed = Trainer.from_checkpoint(mid, cfg)
    assert resumed.pass_id == 2
    resumed.fit([data], progress=False, skip_passes=2)
    a, b = whole.store.to_arrays(), resumed.store.to_arrays()
    assert sorted(a) == sorted(b) and "admission_sketch" in a
    np.testing.assert_array_equal(a["admission_sketch"], b["admission_sketch"])
    np.testing.assert_array_equal(a["keys"], b["keys"])
    for name in ("values", "state", "show", "click", "last_seen", "counters", "rejected"):
        np.testing.assert_allclose(a[name], b[name], rtol=0, atol=1e-6, err_msg=name)
    keys = ("new_keys", "rejected_keys", "evicted_keys", "store_keys")
    assert [[h[k] for k in keys] for h in whole.history] == \
        [[h[k] for k in keys] for h in resumed.history]


def test_history_counts_add_up_to_the_store(data):
    trainer = Trainer(SCHEMA, _config(**POLICIES))
    trainer.fit([data], progress=False)
    h = trainer.history
    stats = trainer.store.stats()
    assert sum(r["new_keys"] for r in h) == stats.admitted
    assert sum(r["evicted_keys"] for r in h) == stats.evicted > 0
    assert sum(r["rejected_keys"] for r in h) == stats.rejected > 0
    assert all(r["store_keys"] == before + r["new_keys"] - r["evicted_keys"]
               for before, r in zip([0] + [x["store_keys"] for x in h], h, strict=False))


def _replay(uri, name: str) -> set[int]:
    """The keys version ``name`` holds, rebuilt from its files."""
    storage = Storage(str(uri))
    keys: set[int] = set()
    for version in read_manifest(storage, name).chain:
        m = read_manifest(storage, version)
        folder = storage.local_path(version)
        if m.kind == "delta":
            keys -= set(load_file(str(folder / DELETED_FILE))["keys"].tolist())
        for shard in m.shards:
            keys |= set(load_file(str(folder / shard["file"]))["keys"].tolist())
    return keys


@pytest.mark.parametrize("store", [{"max_keys": 700}, {"max_store_bytes": "30KB",
                                                       "evict_score": "l2"}])
def test_capacity_evictions_reach_the_deltas_as_deletions(data, tmp_path, store):
    trainer = Trainer(SCHEMA, _config(**store))
    uri = tmp_path / "export"
    exporter = IncrementalExporter(uri, trainer, every_passes=1)
    deleted = []

    def on_pass_end(t: Trainer, record: dict) -> None:
        result = exporter.on_pass_end(t, record)
        assert _replay(uri, result.name) == set(t.store.to_arrays()["keys"].tolist())
        deleted.append(result.deleted)
        if "max_keys" in store:
            assert len(t.store) <= store["max_keys"]
        else:
            assert store_bytes(t.store) <= 30 << 10

    trainer.fit([data], progress=False, on_pass_end=on_pass_end)
    assert all(d > 0 for d in deleted[1:])
