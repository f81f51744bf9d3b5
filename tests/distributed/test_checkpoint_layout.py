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
from terarec.io import sha256_file
from terarec.kernels import shard_of
from terarec.modeldir import list_checkpoints, load_checkpoint, save_checkpoint
from terarec.train.trainer import Trainer
from terarec.types import Batch, FeatureSchema, FieldSpec, KeyedIds

SCHEMA = FeatureSchema(label="label", fields=(
    FieldSpec("x", "numeric"), FieldSpec("a", "categorical"), FieldSpec("b", "categorical")),
    missing_flags=False)


def _config(store_dir: Path | None = None, admit: int = 1) -> TrainConfig:
    store = StoreConfig(memory_budget="600KB", disk_path=str(store_dir),
                        admit_min_count=admit) if store_dir else (
        StoreConfig(admit_min_count=admit))
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


def _trained(model: Path, store_dir: Path | None = None, admit: int = 1
             ) -> dict[str, np.ndarray]:
    trainer = Trainer(SCHEMA, _config(store_dir, admit))
    for seed in range(3):
        trainer.train_pass(trainer.plan(_batches(seed)))
    save_checkpoint(model, trainer)
    return trainer.store.to_arrays()


def _reshard(ctx: DistContext, src: str, dst: str, store_dir: str | None,
             admit: int = 1) -> dict:
    """On each rank: restore ``src`` (any layout) and commit it again to ``dst``."""
    config = _config(Path(store_dir) if store_dir else None, admit)
    trainer = Trainer.from_checkpoint(src, config, ctx=ctx)
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
    _assert_same_rows(Trainer.from_checkpoint(tmp_path / "two").store.to_arrays(), want)
    three = run_ranks(_reshard, 3, str(tmp_path / "two"), str(tmp_path / "three"), None)
    assert sum(len(p["keys"]) for p in three) == len(want["keys"])
    assert sum(int(p["counters"][0]) for p in three) == int(want["counters"][0])
    _assert_same_rows(Trainer.from_checkpoint(tmp_path / "three").store.to_arrays(), want)


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
    _assert_same_rows(Trainer.from_checkpoint(tmp_path / "memory").store.to_arrays(), want)

    want = _trained(tmp_path / "tiered", tmp_path / "store")
    _relayout(tmp_path / "tiered", {}, ("world_size",))
    ckpt = load_checkpoint(tmp_path / "tiered")
    assert ckpt.shards == ["sparse"] and ckpt.tiered
    _assert_same_rows(ckpt.sparse, want)
    restored = Trainer.from_checkpoint(tmp_path / "tiered", _config(tmp_path / "store-2"))
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
    _assert_same_rows(Trainer.from_checkpoint(tmp_path / "two").store.to_arrays(), want)


def _rows(arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {k: v for k, v in arrays.items() if k != "pruned"}


def _assert_exact(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert sorted(_rows(got)) == sorted(_rows(want))
    for name, values in _rows(want).items():
        np.testing.assert_array_equal(got[name], values, err_msg=name)


def _restore_once(src: Path, dst: Path, store_dir: Path | None) -> dict[str, np.ndarray]:
    """One process: restore ``src`` and commit it to ``dst``."""
    trainer = Trainer.from_checkpoint(src, _config(store_dir, 2))
    save_checkpoint(dst, trainer)
    return trainer.store.to_arrays()


@pytest.mark.parametrize("tiered", [False, True], ids=["memory", "tiered"])
def test_restores_across_world_sizes_stay_exact(tmp_path, tiered):
    """1 -> 2 -> 1 -> 3 ranks: every row, optimizer state, counter and admission
    candidate comes back bit for bit (each re-shard streams the shards by chunks)."""
    stores = tmp_path / "stores" if tiered else None
    want = _trained(tmp_path / "w1", stores / "w1" if stores else None, admit=2)
    assert len(want["cand_keys"])  # admission candidates travel too
    run_ranks(_reshard, 2, str(tmp_path / "w1"), str(tmp_path / "w2"),
              str(stores / "w2") if stores else None, 2)
    _assert_exact(load_checkpoint(tmp_path / "w2").sparse, want)
    back = _restore_once(tmp_path / "w2", tmp_path / "w1b", stores / "w1b" if stores else None)
    _assert_exact(back, want)
    three = run_ranks(_reshard, 3, str(tmp_path / "w1b"), str(tmp_path / "w3"),
                      str(stores / "w3") if stores else None, 2)
    for rank, part in enumerate(three):
        assert np.all(shard_of(part["keys"], 3) == rank)
    _assert_exact(load_checkpoint(tmp_path / "w3").sparse, want)
    _assert_exact(Trainer.from_checkpoint(tmp_path / "w3").store.to_arrays(), want)


def test_reshard_reads_a_chunk_at_a_time(tmp_path):
    """A rank's share of another world size's checkpoint is streamed: the RAM it takes
    stays a small fraction of a shard, however large the shard."""
    import tracemalloc

    trainer = Trainer(SCHEMA, _config())
    n = 200_000
    rng = np.random.default_rng(0)
    keys = np.sort(rng.choice(1 << 40, n, replace=False)).astype(np.int64)
    store = trainer.store
    trainer.store.load_arrays({
        "keys": keys, "values": rng.random((n, store.row_dim), np.float32),
        "state": rng.random((n, store.state_dim), np.float32),
        "show": np.ones(n, np.float32), "click": np.zeros(n, np.float32),
        "last_seen": np.zeros(n, np.int32), "counters": np.array([n, 0], np.int64)})
    save_checkpoint(tmp_path / "model", trainer)
    ckpt = load_checkpoint(tmp_path / "model")
    shard_bytes = n * 4 * (store.row_dim + store.state_dim + 3)

    tracemalloc.start()
    try:
        chunks, extras = ckpt.rank_rows(1, 2, chunk_rows=4096)
        seen, last = 0, -1
        for chunk in chunks:
            assert len(chunk) <= 4096
            assert np.all(shard_of(chunk.keys, 2) == 1) and chunk.keys[0] > last
            last = int(chunk.keys[-1])
            seen += len(chunk)
        streamed_peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.reset_peak()
        whole = ckpt.shard_arrays("sparse")  # the whole shard, as restores used to read it
        whole_peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert seen == int(np.sum(shard_of(keys, 2) == 1))
    assert int(extras["counters"][0]) == 0  # store-wide totals stay with rank 0
    assert whole_peak >= shard_bytes * 0.9  # the measurement sees numpy's allocations
    assert streamed_peak < shard_bytes / 10
    del whole


def _two_commits(ctx: DistContext, model: str) -> None:
    trainer = Trainer.from_checkpoint(model, _config(), ctx=ctx)  # the 1-process checkpoint
    for seed in (10, 11):
        local = [b.slice(ctx.rank * 32, (ctx.rank + 1) * 32) for b in _batches(seed)]
        trainer.train_pass(trainer.plan(local))
        save_checkpoint(model, trainer)


def _restored_pass(ctx: DistContext, model: str) -> int:
    return Trainer.from_checkpoint(model, _config(), ctx=ctx).pass_id


def test_ranks_share_the_checksums_and_all_refuse_a_corrupted_shard(tmp_path):
    model = tmp_path / "model"
    _trained(model)  # pass 3, one process
    run_ranks(_two_commits, 2, str(model))  # passes 4 and 5, two ranks
    newest = list_checkpoints(model)[0]
    assert newest.name == "pass-000005"
    assert run_ranks(_restored_pass, 2, str(model)) == [5, 5]
    # rank 1 hashes the second half of the files: corrupt rank 1's own shard
    shard = newest / "sparse-00001-of-00002" / "rows.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert run_ranks(_restored_pass, 2, str(model)) == [4, 4]  # both fall back
