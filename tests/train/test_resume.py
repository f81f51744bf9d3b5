"""Checkpoint and resume: a run killed with SIGKILL at a random moment and resumed ends
with the model of an uninterrupted run; damaged checkpoints are refused."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from terarec.data.synth import generate
from terarec.modeldir import CheckpointError, list_checkpoints, load_checkpoint
from terarec.train.trainer import Trainer

SRC = Path(__file__).resolve().parents[2] / "src"
TRAIN_ARGS = ["--pass-rows", "2000", "--batch-size", "500", "--threads", "1", "--no-progress",
              "--model", "deepfm", "--embedding-dim", "4", "--seed", "5",
              "--valid-split", "0"]  # every row every epoch: the resumed state is the point
# Small enough that rows move between RAM and disk on this data, large enough for the
# key index (see docs/tiered-store.md).
BUDGET = ["--memory-budget", "5MB"]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(SRC), env.get("PYTHONPATH", "")])
    return env


def _train_cmd(data: Path, out: Path, extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "terarec", "train", "--train", str(data), "--out", str(out),
            *TRAIN_ARGS, *extra]


def _train(data: Path, out: Path, extra: list[str]) -> float:
    start = time.perf_counter()
    done = subprocess.run(_train_cmd(data, out, extra), env=_env(), capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return time.perf_counter() - start


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("resume") / "train.tsv"
    generate(path, 16_000, model_seed=3, sample_seed=4)
    return path


@pytest.fixture(scope="module")
def reference(data, tmp_path_factory) -> Path:
    """An uninterrupted run of the tiered store, committing a checkpoint every pass."""
    out = tmp_path_factory.mktemp("reference") / "model"
    _train(data, out, BUDGET)
    return out


def _assert_same_model(a: Path, b: Path) -> None:
    ca, cb = load_checkpoint(a), load_checkpoint(b)
    assert ca.meta["pass_id"] == cb.meta["pass_id"] == 8
    for name, tensor in ca.dense.items():
        torch.testing.assert_close(tensor, cb.dense[name], rtol=0, atol=1e-6)
    sa, sb = ca.sparse, cb.sparse
    np.testing.assert_array_equal(sa["keys"], sb["keys"])
    for name in ("values", "state", "show", "click", "last_seen"):
        np.testing.assert_allclose(sa[name], sb[name], rtol=0, atol=1e-6, err_msg=name)


def _kill_at_random_point(cmd: list[str], out: Path, rng: random.Random) -> None:
    """Start ``cmd`` and SIGKILL it at a random moment after its k-th committed pass
    (random k): inside a pass, a write-back or a checkpoint being written."""
    k, delay = rng.randint(1, 6), rng.uniform(0.0, 0.4)
    proc = subprocess.Popen(cmd, env=_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        while not (out / "checkpoints" / f"pass-{k:06d}").exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                break
            time.sleep(0.01)
        time.sleep(delay)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()


@pytest.mark.parametrize("store", ["memory", "tiered", "tiered-disk-index"])
def test_sigkill_at_a_random_moment_then_resume_matches_uninterrupted(
        data, reference, tmp_path, store):
    """Every store resumes to the uninterrupted tiered run's model (which also shows the
    tiered and in-memory stores, and both key indexes, train the same model)."""
    extra = {"memory": [], "tiered": BUDGET,
             "tiered-disk-index": [*BUDGET, "--key-index", "disk"]}[store]
    seed = random.randrange(1 << 30)
    out = tmp_path / "model"
    _kill_at_random_point(_train_cmd(data, out, extra), out, random.Random(seed))
    killed_at = [p.name for p in list_checkpoints(out)]
    _train(data, out, [*extra, "--resume"])
    # Passes committed before the kill were kept and not trained again.
    history = load_checkpoint(out).meta["history"]
    assert [h["pass_id"] for h in history] == list(range(8)), (seed, killed_at)
    assert load_checkpoint(out).meta["sparse_format"] == (
        "arrays" if store == "memory" else "tiered")
    _assert_same_model(reference, out)


def test_tiered_checkpoint_records_both_tiers(reference):
    meta = load_checkpoint(reference).meta
    assert meta["sparse_format"] == "tiered"
    tiers = meta["store"]["tiers"]
    assert tiers["disk_keys"] == meta["store"]["keys"] > tiers["memory_capacity"]
    assert tiers["spilled"] > 0 and tiers["prefetched"] > 0


def _copy_model(src: Path, dst: Path) -> Path:
    subprocess.run(["cp", "-a", str(src), str(dst)], check=True)
    return dst


def test_corrupted_checkpoint_is_refused_and_the_previous_loads(reference, tmp_path, caplog):
    model = _copy_model(reference, tmp_path / "model")
    newest, previous = list_checkpoints(model)[:2]
    index = load_checkpoint(model, newest.name).sparse_dir / "index.safetensors"
    raw = bytearray(index.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    index.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        load_checkpoint(model, newest.name)
    ckpt = load_checkpoint(model)
    assert ckpt.path == previous
    assert "index.safetensors: checksum mismatch" in caplog.text
    trainer = Trainer.from_checkpoint(model)
    assert trainer.pass_id == int(previous.name.split("-")[1])
    assert len(trainer.store) == len(ckpt.sparse["keys"])


def test_half_written_checkpoint_is_refused(reference, tmp_path):
    model = _copy_model(reference, tmp_path / "model")
    newest, previous = list_checkpoints(model)[:2]
    (newest / "meta.json").unlink()
    with pytest.raises(CheckpointError, match="half-written"):
        load_checkpoint(model, newest.name)
    assert load_checkpoint(model).path == previous
    for ckpt in (newest, previous):
        (ckpt / "meta.json").unlink(missing_ok=True)
    with pytest.raises(CheckpointError, match="no loadable checkpoint"):
        load_checkpoint(model)


def test_tiered_checkpoint_loads_into_a_memory_store(reference):
    """Resuming without --memory-budget reads the slab snapshot into RAM."""
    from terarec.modeldir import read_model_meta

    _, config = read_model_meta(reference)
    config.store.memory_budget = None
    config.store.disk_path = None
    trainer = Trainer.from_checkpoint(reference, config)
    assert type(trainer.store).__name__ == "MemoryStore"
    got = trainer.store.to_arrays()
    tiered = Trainer.from_checkpoint(reference)  # the same checkpoint through the slab files
    assert type(tiered.store).__name__ == "TieredStore"
    assert len(tiered.store) == len(got["keys"])
    values, found = tiered.store.lookup(got["keys"])
    assert found.all()
    np.testing.assert_array_equal(values, got["values"])
