"""The device tier (embedding/device.py): rows kept on the training device across passes.

A cache is transparent: a run with ``device_budget`` trains the same model as one without,
bit for bit where the codec is exact (fp32, fp16), whatever the budget, optimizer, admission
and eviction; it only changes which rows cross to the device. Run on CPU here (the same
code on ``--device cpu``); the CUDA case at the end runs where a GPU is present.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from terarec.cli.main import main as cli_main
from terarec.config import ModelConfig, SparseOptimizerConfig, StoreConfig, TrainConfig
from terarec.data.synth import generate, generate_arrays
from terarec.embedding.device import (
    DeviceRowCache,
    codec_bytes,
    decode,
    encode,
)
from terarec.embedding.quant import decode_rows, encode_rows, read_scale_bias
from terarec.embedding.working_set import plan_pass
from terarec.export import IncrementalExporter, Storage, latest_version, read_manifest
from terarec.kernels import splitmix64_array
from terarec.modeldir import load_checkpoint, save_checkpoint
from terarec.train.trainer import Trainer
from terarec.types import Batch, FeatureSchema, FieldSpec, KeyedIds

DIM = 4
BATCH = 200
PASS_BATCHES = 3


def _schema() -> FeatureSchema:
    numeric = tuple(FieldSpec(f"I{i}", "numeric") for i in range(1, 14))
    cats = tuple(FieldSpec(f"C{i}", "categorical") for i in range(1, 27))
    return FeatureSchema(label="label", fields=numeric + cats, missing_flags=False)


def _passes(n_passes: int, seed: int = 0) -> list[list[Batch]]:
    rows = n_passes * PASS_BATCHES * BATCH
    arrays = generate_arrays(rows, model_seed=seed, sample_seed=seed + 1)
    dense = np.log1p(np.nan_to_num(arrays.dense, nan=0.0).clip(min=0)).astype(np.float32)
    field = np.arange(arrays.categorical.shape[1], dtype=np.uint64)
    keys = splitmix64_array(arrays.categorical.astype(np.uint64) + (field << np.uint64(40)))
    keys = np.ascontiguousarray(keys.view(np.int64))
    names = _schema().sparse_names
    batches = [Batch(torch.from_numpy(dense[s:s + BATCH]),
                     KeyedIds.from_dense(names, torch.from_numpy(keys[s:s + BATCH])),
                     torch.from_numpy(arrays.labels[s:s + BATCH].astype(np.float32)))
               for s in range(0, rows, BATCH)]
    return [batches[p * PASS_BATCHES:(p + 1) * PASS_BATCHES] for p in range(n_passes)]


def _config(budget: str | int | None, optimizer: str = "adagrad", dim: int = DIM,
            **store) -> TrainConfig:
    return TrainConfig(
        batch_size=BATCH, seed=3, device="cpu", threads=1, device_budget=budget,
        model=ModelConfig(name="dlrm", embedding_dim=dim, bottom_mlp=(8, dim),
                          top_mlp=(8,)),
        sparse_optimizer=SparseOptimizerConfig(
            name=optimizer, lr=0.05, group_lasso=store.pop("group_lasso", 0.0)),
        store=StoreConfig(**store))


def _train(config: TrainConfig, passes: list[list[Batch]], trainer: Trainer | None = None
           ) -> tuple[Trainer, list[float]]:
    trainer = trainer or Trainer(_schema(), config)
    plans = [trainer.plan(p) for p in passes]
    losses = []
    for i, plan in enumerate(plans):
        upcoming = plans[i + 1] if i + 1 < len(plans) else None
        losses.append(trainer.train_pass(plan, upcoming=upcoming).train_loss)
    return trainer, losses


def _assert_same_store(a: Trainer, b: Trainer, atol: float = 0.0) -> None:
    a.sync_store()
    b.sync_store()
    sa, sb = a.store.to_arrays(), b.store.to_arrays()
    np.testing.assert_array_equal(sa["keys"], sb["keys"])
    for name in ("values", "state"):
        if atol:
            np.testing.assert_allclose(sa[name], sb[name], rtol=0, atol=atol, err_msg=name)
        else:
            np.testing.assert_array_equal(sa[name], sb[name], err_msg=name)
    for name in ("show", "click", "last_seen", "counters"):
        np.testing.assert_array_equal(sa[name], sb[name], err_msg=name)


def _row_bytes(config: TrainConfig) -> int:
    state = {"adagrad": 1, "adam": 2 * DIM + 1, "ftrl": 2 * DIM, "sgd": 0}
    return codec_bytes(config.store.precision, DIM) + 4 * state[config.sparse_optimizer.name]


# -- the codec ------------------------------------------------------------------------------
@pytest.mark.parametrize("precision", ["fp16", "int8"])
def test_codec_matches_the_store_codec_byte_for_byte(precision):
    rng = np.random.default_rng(0)
    rows = (rng.normal(0, 0.05, (500, 16)) + rng.normal(0, 1, (500, 1))).astype(np.float32)
    rows[0] = 0.25  # a constant row
    coded = encode(torch.from_numpy(rows), precision)
    reference = encode_rows(rows, precision)
    if precision == "fp16":
        np.testing.assert_array_equal(coded.values.numpy().view(np.uint8).reshape(500, -1),
                                      reference)
    else:
        scale, bias = read_scale_bias(reference, precision, 16)
        np.testing.assert_array_equal(coded.values.numpy(), reference[:, :16])
        np.testing.assert_array_equal(coded.scale.numpy(), scale)
        np.testing.assert_array_equal(coded.bias.numpy(), bias)
    np.testing.assert_array_equal(decode(coded).numpy(), decode_rows(reference, precision, 16))


def test_codec_refuses_non_finite_rows():
    rows = torch.zeros(3, 4)
    rows[1, 2] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        encode(rows, "int8")
    rows[1, 2] = 3e38  # beyond the float32 grid, as the store's codec refuses it
    with pytest.raises(ValueError, match=r"beyond \+-1e\+38, which int8 rows cannot store"):
        encode(rows, "int8")


# -- budget ---------------------------------------------------------------------------------
def test_budget_sets_capacity_and_bad_settings_are_refused():
    cache = DeviceRowCache(16, 1, "1MB", "cpu", StoreConfig(precision="int8"))
    assert cache.row_bytes == 16 + 8 + 4
    assert cache.capacity == (1 << 20) // 28
    with pytest.raises(ValueError, match="one row takes 68 bytes"):
        DeviceRowCache(16, 1, 64, "cpu", StoreConfig())
    with pytest.raises(ValueError, match="int4"):
        DeviceRowCache(16, 1, "1MB", "cpu", StoreConfig(precision="int4"))
    with pytest.raises(ValueError, match="stochastic"):
        DeviceRowCache(16, 1, "1MB", "cpu", StoreConfig(stochastic_rounding=True))


def test_no_budget_no_cache():
    assert Trainer(_schema(), _config(None)).device_cache is None


# -- transparency ---------------------------------------------------------------------------
CASES = {
    "adagrad": dict(optimizer="adagrad"),
    "adam": dict(optimizer="adam"),
    "ftrl": dict(optimizer="ftrl"),
    "fp16": dict(optimizer="adagrad", precision="fp16"),
    "admission+ttl": dict(optimizer="adagrad", admit_min_count=2, evict_after_passes=1),
    "group-lasso": dict(optimizer="adagrad", group_lasso=0.002),
    "capacity-lfu": dict(optimizer="adagrad", max_keys=3000),
    "capacity-l2": dict(optimizer="adam", max_keys=3000, evict_score="l2"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_cached_run_trains_the_plain_run_bit_for_bit(case):
    settings = dict(CASES[case])
    optimizer = settings.pop("optimizer")
    passes = _passes(5)
    plain, plain_losses = _train(_config(None, optimizer, **dict(settings)), passes)
    config = _config("1MB", optimizer, **dict(settings))
    # A budget well below the pass's rows: the cache fills, rows come and go.
    budget = 600 * _row_bytes(config)
    cached, cached_losses = _train(replace(config, device_budget=budget), passes)
    cache = cached.device_cache
    assert cache is not None and 0 < len(cache) <= cache.capacity == 600
    assert cache.stats.hits > 0 and cache.stats.misses > 0
    assert cached_losses == plain_losses
    np.testing.assert_array_equal(plain.predict_batches(passes[0]),
                                  cached.predict_batches(passes[0]))
    _assert_same_store(plain, cached)
    for name, tensor in plain.model.state_dict().items():
        torch.testing.assert_close(tensor, cached.model.state_dict()[name], rtol=0, atol=0)


def test_int8_rows_round_on_the_device_as_in_the_store():
    passes = _passes(4)
    # 16 wide: narrower int8 rows are kept as fp16 (fewer bytes), on the device too.
    plain, plain_losses = _train(_config(None, dim=16, precision="int8"), passes)
    cached, cached_losses = _train(_config("40KB", dim=16, precision="int8"), passes)
    assert cached.device_cache is not None and cached.device_cache.precision == "int8"
    np.testing.assert_allclose(cached_losses, plain_losses, rtol=1e-4)
    # A sync re-encodes decoded rows, which may move a value by one int8 step.
    _assert_same_store(plain, cached, atol=1e-3)


def test_tiered_store_behind_the_cache(tmp_path):
    passes = _passes(4)
    plain, plain_losses = _train(_config(None, memory_budget="4MB",
                                         disk_path=str(tmp_path / "a")), passes)
    cached, cached_losses = _train(_config("30KB", memory_budget="4MB",
                                           disk_path=str(tmp_path / "b")), passes)
    assert cached_losses == plain_losses
    _assert_same_store(plain, cached)


# -- the policy -----------------------------------------------------------------------------
def test_hottest_rows_stay_and_only_leaving_rows_are_written_back():
    passes = _passes(3)
    config = _config("20KB")
    trainer, _ = _train(config, passes[:1])
    cache = trainer.device_cache
    assert cache is not None
    keys, slots = cache.index.items()
    plan = plan_pass(passes[0])
    shows = dict(zip(plan.keys.tolist(), plan.show.tolist(), strict=True))
    cached_min = min(shows[k] for k in keys.tolist())
    left_out = set(shows) - set(keys.tolist())
    assert len(keys) == cache.capacity  # full: more keys than room
    assert max(shows[k] for k in left_out) <= cached_min  # LFU: the hottest stayed
    # The store's copy of a cached row is the pre-pass one until a sync; a row that did
    # not fit went back trained.
    before = trainer.store.lookup(keys)[0]
    fresh = Trainer(_schema(), _config(None))
    fresh.store.pull(plan.keys, plan.show, plan.click, 0)
    np.testing.assert_array_equal(before, fresh.store.lookup(keys)[0])
    assert cache.dirty[slots].all()
    pushed_rows = cache.stats.d2h_bytes // _row_bytes(config)
    assert pushed_rows == len(plan.keys) - len(keys)
    assert cache.sync() == len(keys)
    assert not cache.dirty[slots].any()
    np.testing.assert_array_equal(trainer.store.lookup(keys)[0], cache._read(slots).numpy())
    assert cache.sync() == 0  # clean rows are not pushed again


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_misses_are_read_ahead_while_the_previous_pass_trains(precision):
    passes = _passes(4)
    plain, plain_losses = _train(_config(None, precision=precision), passes)
    trainer, losses = _train(_config("10KB", precision=precision), passes)
    stats = trainer.device_cache.stats  # type: ignore[union-attr]
    assert stats.hidden_bytes > 0
    assert 0 < stats.hidden_share < 1  # misses' optimizer state is copied at staging
    assert 0 < stats.hit_rate < 1
    # Rows the cache had no room for but the next pass needs stay on the device.
    assert stats.carried > 0
    assert losses == plain_losses
    _assert_same_store(plain, trainer)


def test_keys_the_store_evicts_leave_the_cache():
    passes = _passes(4)
    trainer, _ = _train(_config("1MB", evict_after_passes=1), passes)
    cache = trainer.device_cache
    assert cache is not None
    keys, _ = cache.index.items()
    assert trainer.store.lookup(keys)[1].all()


# -- checkpoint and resume ------------------------------------------------------------------
def test_resume_from_a_checkpoint_equals_an_uninterrupted_plain_run(tmp_path):
    passes = _passes(4)
    plain, plain_losses = _train(_config(None), passes)
    config = _config("20KB")
    first, losses = _train(config, passes[:2])
    save_checkpoint(tmp_path / "model", first)
    # The run goes on after the checkpoint as if nothing happened ...
    _, rest = _train(config, passes[2:], trainer=first)
    assert losses + rest == plain_losses
    # ... and a resumed run (empty cache) continues it exactly.
    resumed = Trainer.from_checkpoint(tmp_path / "model", config)
    assert resumed.device_cache is not None and len(resumed.device_cache) == 0
    _, resumed_rest = _train(config, passes[2:], trainer=resumed)
    assert losses + resumed_rest == plain_losses
    _assert_same_store(plain, resumed)
    _assert_same_store(plain, first)


def test_a_replaced_store_gets_the_cached_rows_first():
    passes = _passes(2)
    trainer, _ = _train(_config("20KB"), passes[:1])
    old = trainer.store
    cache = trainer.device_cache
    assert cache is not None
    keys, slots = cache.index.items()
    rows = cache._read(slots).numpy()
    trainer.store = Trainer(_schema(), _config(None)).store
    trainer.train_pass(trainer.plan(passes[1]))
    np.testing.assert_array_equal(old.lookup(keys)[0], rows)


def test_cli_run_with_a_device_budget_checkpoints_and_exports_the_plain_run(tmp_path):
    data = tmp_path / "train.tsv"
    generate(data, 3000, model_seed=1, sample_seed=2)
    args = ["train", "--train", str(data), "--pass-rows", "1000", "--batch-size", "250",
            "--embedding-dim", "4", "--threads", "1", "--no-progress", "--device", "cpu",
            "--delta-every", "1", "--valid-split", "0"]  # one epoch: three versions
    for name, extra in (("plain", []), ("cached", ["--device-budget", "20KB"])):
        assert cli_main([*args, "--out", str(tmp_path / name), "--export-to",
                         str(tmp_path / f"{name}-export"), *extra]) == 0
    a, b = load_checkpoint(tmp_path / "plain"), load_checkpoint(tmp_path / "cached")
    for name in ("keys", "values", "state", "show", "click", "last_seen"):
        np.testing.assert_array_equal(a.sparse[name], b.sparse[name], err_msg=name)
    plain, cached = Storage(tmp_path / "plain-export"), Storage(tmp_path / "cached-export")
    assert latest_version(plain) == latest_version(cached) == "v000003"
    for version in ("v000001", "v000002", "v000003"):
        fa, fb = read_manifest(plain, version).data["files"], read_manifest(
            cached, version).data["files"]
        assert {k: v["sha256"] for k, v in fa.items()} == {k: v["sha256"]
                                                           for k, v in fb.items()}


def test_an_export_takes_the_rows_newer_on_the_device(tmp_path):
    passes = _passes(2)
    files = []
    for name, budget in (("plain", None), ("cached", "20KB")):
        trainer, _ = _train(_config(budget), passes)
        if budget:
            assert trainer.device_cache is not None and trainer.device_cache.dirty.any()
        IncrementalExporter(tmp_path / name, trainer).export(trainer)
        manifest = read_manifest(Storage(tmp_path / name), "v000001")
        files.append({k: v["sha256"] for k, v in manifest.data["files"].items()})
    assert files[0] == files[1]


# -- on a GPU -------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_cache_trains_the_cpu_run():
    passes = _passes(4)
    cpu, cpu_losses = _train(_config(None), passes)
    gpu, gpu_losses = _train(replace(_config("20KB"), device="cuda", threads=None), passes)
    np.testing.assert_allclose(gpu_losses, cpu_losses, rtol=1e-3)
    assert gpu.device_cache is not None and gpu.device_cache.stats.hidden_bytes > 0
    _assert_same_store(cpu, gpu, atol=1e-3)
