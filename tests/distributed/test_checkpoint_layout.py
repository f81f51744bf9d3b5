"""One checkpoint layout at every world size: a shard per rank, restored into any number of
processes by key hash, for memory and tiered stores; checkpoints in the layouts written
before (``sparse.safetensors``, ``sparse/``, 2-rank files without a format) still load.

The ranks run in-process (gloo over ``torch.multiprocessing``, ``ranks.run_ranks``).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from ranks import run_ranks

from terarec.config import ModelConfig, StoreConfig, TrainConfig
from terarec.distributed.context import DistContext
from terarec.distributed.sharding import shard_of
from terarec.io import sha256_file
from terarec.train.checkpoint import (
    list_checkpoints,
    load_checkpoint,
    restore_trainer,
    save_checkpoint,
)
from terarec.train.trainer import Trainer
from terarec.types import Batch, FeatureSchema, FieldSpec, KeyedIds

SCHEMA = FeatureSchema(label="label", fields=(
    FieldSpec("x", "numeric"), FieldSpec("a", "categorical"), FieldSpec("b", "categorical")),
    missing_flags=False)


def _config(store_dir: Path | None = None) -> TrainConfig:
    store = StoreConfig(memory_budget="600KB", disk_path=str(store_dir)) if store_dir else (
        StoreConfig())
    return TrainConfig(batch_size=64, pass_rows=256, threads=1, seed=3,
                       model=ModelConfig(name="deepfm", embedding_dim=4), store=store)


def _batches(seed: int, n: int = 4) -> list[Batch]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        keys = rng.integers(0, 3000, size=(64, 2)).astype(np.int64)
        out.append(Batch(torch.from_numpy(rng.random((64, 1), np.float32)),
                         KeyedIds.from_dense(SCHEMA.sparse_names, torch.from_numpy(keys)),
                         torch.from_numpy((rng.random(64) < 0.3).astype(np.float32))))
    return out


def _trained(model: Path, store_dir: Path | None = None) -> dict[str, np.ndarray]:
    trainer = Trainer(SCHEMA, _config(store_dir))
    for seed in range(3):
        trainer.train_pass(_batches(seed))
    save_checkpoint(model, trainer)
    return trainer.store.to_arrays()


def _reshard(ctx: DistContext, src: str, dst: str, store_dir: str | None) -> dict:
    """On each rank: restore ``src`` (any layout) and commit it again to ``dst``."""
    config = _config(Path(store_dir) if store_dir else None)
    trainer = restore_trainer(src, config, ctx=ctx)
    arrays = trainer.store.to_arrays()
    save_checkpoint(dst, trainer)
    return {"keys": arrays["keys"], "values": arrays["values"], "store": type(
        trainer.store).__name__, "counters": arrays["counters"]}


def _assert_same_rows(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    np.testing.assert_array_equal(got["keys"], want["keys"])
    for name in ("values", "state", "show", "click", "cand_keys", "cand_show"):
        np.testing.assert_allclose(got[name], want[name], atol=1e-6, err_msg=name)
    np.testing.assert_array_equal(got["counters"], want["counters"])


@pytest.mark.parametrize("tiered", [False, True], ids=["memory", "tiered"])
def test_one_process_to_two_ranks_and_back(tmp_path, tiered):
    stores = tmp_path / "stores" if tiered else None
    want = _trained(tmp_path / "one", stores / "one" if stores else None)
    one = load_checkpoint(tmp_path / "one")
    assert one.world_size == 1 and one.shards == ["sparse"]
    assert one.meta["sparse_format"] == ("tiered" if tiered else "arrays")

    ranks = run_ranks(_reshard, 2, str(tmp_path / "one"), str(tmp_path / "two"),
                      str(stores / "two") if stores else None)
    # each rank holds exactly the keys it owns, and together all of them
    for rank, part in enumerate(ranks):
        assert len(part["keys"]) and np.all(shard_of(part["keys"], 2) == rank)
        assert part["store"] == ("TieredStore" if tiered else "MemoryStore")
    assert sum(len(p["keys"]) for p in ranks) == len(want["keys"])
    two = load_checkpoint(tmp_path / "two")
    assert two.world_size == 2 and len(two.shards) == 2
    if tiered:  # the ranks' tiered stores wrote their own slab folders
        assert all((two.path / s / "index.safetensors").exists() for s in two.shards)
        assert sorted(p.name for p in (stores / "two").iterdir()) == [
            "rank-00000", "rank-00001"]
    for rank, shard in enumerate(two.shards):
        keys = two.shard_arrays(shard)["keys"]
        assert np.all(shard_of(keys, 2) == rank)
    assert two.meta["store"]["keys"] == len(want["keys"])  # summed over the ranks

    # back into one process (memory store), and into 3 ranks
    _assert_same_rows(restore_trainer(tmp_path / "two").store.to_arrays(), want)
    three = run_ranks(_reshard, 3, str(tmp_path / "two"), str(tmp_path / "three"), None)
    assert sum(len(p["keys"]) for p in three) == len(want["keys"])
    assert sum(int(p["counters"][0]) for p in three) == int(want["counters"][0])
    _assert_same_rows(restore_trainer(tmp_path / "three").store.to_arrays(), want)


def _relayout(model: Path, rename: dict[str, str], drop: tuple[str, ...]) -> None:
    """Turn the newest checkpoint of ``model`` into an older layout: files renamed,
    meta keys dropped, checksums rewritten."""
    path = list_checkpoints(model)[0]
    meta = json.loads((path / "meta.json").read_text())
    for old, new in rename.items():
        shutil.move(path / old, path / new)
        folder = (path / old).parent
        if folder != path and not any(folder.iterdir()):
            folder.rmdir()
        if "sparse_shards" in meta:
            meta["sparse_shards"] = [new if s == old.split("/")[0] else s
                                     for s in meta["sparse_shards"]]
    digests = {}
    for name in meta["sha256"]:
        for old, new in rename.items():
            if name == old or name.startswith(old + "/"):
                name = new + name[len(old):]
        digests[name] = sha256_file(path / name)
    meta["sha256"] = digests
    for key in drop:
        meta.pop(key, None)
    (path / "meta.json").write_text(json.dumps(meta))


def test_single_process_layouts_from_before_still_load(tmp_path):
    want = _trained(tmp_path / "memory")
    # before stores saved themselves: the rows file beside the dense files
    _relayout(tmp_path / "memory", {"sparse/rows.safetensors": "sparse.safetensors"},
              ("world_size",))
    ckpt = load_checkpoint(tmp_path / "memory")
    assert ckpt.shards == ["sparse.safetensors"]
    _assert_same_rows(restore_trainer(tmp_path / "memory").store.to_arrays(), want)

    want = _trained(tmp_path / "tiered", tmp_path / "store")
    _relayout(tmp_path / "tiered", {}, ("world_size",))
    ckpt = load_checkpoint(tmp_path / "tiered")
    assert ckpt.shards == ["sparse"] and ckpt.tiered
    _assert_same_rows(ckpt.sparse, want)
    restored = restore_trainer(tmp_path / "tiered", _config(tmp_path / "store-2"))
    assert type(restored.store).__name__ == "TieredStore"  # adopted the slab folder
    _assert_same_rows(restored.store.to_arrays(), want)


def test_two_rank_layout_from_before_still_loads(tmp_path):
    want = _trained(tmp_path / "one")
    run_ranks(_reshard, 2, str(tmp_path / "one"), str(tmp_path / "two"), None)
    # 2-rank checkpoints used to hold one file per rank, no format, no summed figures
    _relayout(tmp_path / "two", {f"sparse-0000{r}-of-00002/rows.safetensors":
                                 f"sparse-0000{r}-of-00002.safetensors" for r in range(2)},
              ("sparse_format", "store"))
    ckpt = load_checkpoint(tmp_path / "two")
    assert ckpt.shards == [f"sparse-0000{r}-of-00002.safetensors" for r in range(2)]
    _assert_same_rows(restore_trainer(tmp_path / "two").store.to_arrays(), want)
