"""Training under the real launcher: ``python -m torch.distributed.run`` with 2 gloo ranks.

Each test starts torchrun in a subprocess (so every rank is a fresh process with its own
process group), then compares what the ranks wrote against a single-process run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from terarec.kernels import shard_of
from terarec.loopback import free_port
from terarec.modeldir import list_checkpoints, rank_arrays
from terarec.train.trainer import Trainer

pytestmark = pytest.mark.dist

HERE = Path(__file__).resolve().parent
SRC = HERE.parents[1] / "src"
TIMEOUT_S = 240


def _env() -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(SRC), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}


def port_taken(cmd: list[str], done: subprocess.CompletedProcess) -> bool:
    """Whether a torchrun launch failed because its ``--master_port`` was taken between
    ``_free_port`` and the agent's bind (by another test process); then ``cmd`` gets a
    new port and the launch is retried. Nothing has run: the agent binds first."""
    if done.returncode == 0 or "EADDRINUSE" not in done.stderr or "--master_port" not in cmd:
        return False
    cmd[cmd.index("--master_port") + 1] = str(free_port())
    return True


def _run(cmd: list[str], env: dict | None = None,
         check: bool = True) -> subprocess.CompletedProcess:
    """Run ``cmd`` in its own session, so that a hang is ended with all its workers."""
    cmd = list(cmd)
    for _ in range(3):
        proc = subprocess.Popen(cmd, env={**_env(), **(env or {})}, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            out, err = proc.communicate(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            pytest.fail(f"timed out after {TIMEOUT_S}s: {' '.join(cmd)}\n{err[-6000:]}")
        if not port_taken(cmd, subprocess.CompletedProcess(cmd, proc.returncode, out, err)):
            break
    if check:
        assert proc.returncode == 0, f"{' '.join(cmd)}\n{out[-3000:]}\n{err[-6000:]}"
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def single(args: list[str]) -> subprocess.CompletedProcess:
    return _run([sys.executable, "-m", "terarec", "train", *args])


def torchrun(args: list[str], nproc: int = 2, script: Path | None = None,
             launcher: tuple[str, ...] = (), env: dict | None = None,
             check: bool = True) -> subprocess.CompletedProcess:
    target = [str(script)] if script else ["-m", "terarec"]
    return _run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
                 "--master_port", str(free_port()), *launcher, *target, "train", *args],
                env, check)


# -- sharded training equals single-process training -----------------------------------

CSV_ARGS = ["--format", "csv", "--label", "label", "--numeric", "x1,x2",
            "--categorical", "a,b,tags", "--multi-sep", "|", "--multi-valued", "tags",
            "--batch-size", "256", "--pass-rows", "512", "--admit-min-count", "2",
            "--sparse-optimizer", "adam", "--embedding-dim", "8", "--threads", "1",
            "--no-progress", "--autocast", "off"]  # fp32: parity to 2e-5 (bf16 drifts)


@pytest.fixture(scope="module")
def csv_runs(tmp_path_factory):
    """One CSV with a multi-valued field, trained by 1 process and by 2 ranks.

    6 full batches of 256 + 100 rows: the last pass is one step holding a single local
    batch (128 rows per rank), so rank 1 has no rows and no keys for that whole pass.
    """
    root = tmp_path_factory.mktemp("csv")
    rng = np.random.default_rng(3)
    n = 6 * 256 + 100
    a = rng.zipf(1.3, n) % 400
    b = rng.integers(0, 12, n)
    logit = 0.8 * np.sin(a) + 0.5 * (b % 3) - 1.0
    labels = (rng.random(n) < 1 / (1 + np.exp(-logit))).astype(int)
    lines = ["label,x1,x2,a,b,tags"]
    for i in range(n):
        tags = "|".join(f"t{t}" for t in rng.integers(0, 30, rng.integers(0, 4)))
        lines.append(f"{labels[i]},{rng.random():.3f},{rng.normal():.3f},a{a[i]},b{b[i]},{tags}")
    data, valid = root / "train.csv", root / "valid.csv"
    data.write_text("\n".join(lines) + "\n")
    valid.write_text("\n".join(lines[:1] + lines[-600:]) + "\n")  # a file of its own
    # One epoch (with --valid, --epochs is otherwise an upper bound for patience).
    common = ["--train", str(data), "--valid", str(valid), "--epochs", "1", *CSV_ARGS]
    single([*common, "--out", str(root / "single")])
    torchrun([*common, "--out", str(root / "dist")])
    return root


def test_two_ranks_train_the_same_model_as_one_process(csv_runs):
    one = Trainer.from_checkpoint(csv_runs / "single")
    two = Trainer.from_checkpoint(csv_runs / "dist")  # merges the two ranks' shards
    a, b = one.store.to_arrays(), two.store.to_arrays()
    assert len(a["keys"]) > 150
    assert np.array_equal(a["keys"], b["keys"])  # same admissions: counts summed over ranks
    assert np.array_equal(a["show"], b["show"]) and np.array_equal(a["click"], b["click"])
    np.testing.assert_allclose(b["values"], a["values"], atol=2e-5)
    np.testing.assert_allclose(b["state"], a["state"], atol=2e-5, rtol=1e-4)
    for name, weight in one.model.state_dict().items():
        torch.testing.assert_close(two.model.state_dict()[name], weight, atol=2e-5, rtol=1e-4)
    h1 = json.loads((csv_runs / "single" / "history.json").read_text())
    h2 = json.loads((csv_runs / "dist" / "history.json").read_text())
    assert [h["rows"] for h in h2] == [h["rows"] for h in h1] == [512, 512, 512, 100]
    assert [h["unique_keys"] for h in h2] == [h["unique_keys"] for h in h1]
    assert [h["admitted_keys"] for h in h2] == [h["admitted_keys"] for h in h1]
    np.testing.assert_allclose([h["train_loss"] for h in h2], [h["train_loss"] for h in h1],
                               rtol=1e-5)
    m1 = json.loads((csv_runs / "single" / "metrics.json").read_text())
    m2 = json.loads((csv_runs / "dist" / "metrics.json").read_text())
    assert m2["world_size"] == 2 and m2["eval_rows"] == m1["eval_rows"] == 600  # valid.csv
    assert m2["auc"] == pytest.approx(m1["auc"], abs=1e-5)


def test_checkpoint_has_one_disjoint_shard_per_rank_and_splits_for_any_world(csv_runs):
    path = list_checkpoints(csv_runs / "dist")[0]
    meta = json.loads((path / "meta.json").read_text())
    assert meta["world_size"] == 2 and meta["pass_id"] == 4
    assert "dense.safetensors" in meta["sha256"]
    for shard in meta["sparse_shards"]:  # each rank's store saved its own folder
        assert any(name.startswith(f"{shard}/") for name in meta["sha256"])
    shards = [rank_arrays(path, meta, r, 2)["keys"] for r in range(2)]
    for rank, keys in enumerate(shards):
        assert len(keys) and np.all(shard_of(keys, 2) == rank)
    merged = Trainer.from_checkpoint(csv_runs / "dist").store.to_arrays()
    # Resuming on 3 ranks: every rank keeps exactly the keys it now owns.
    three = [rank_arrays(path, meta, r, 3) for r in range(3)]
    assert sum(len(t["keys"]) for t in three) == len(merged["keys"])
    for rank, part in enumerate(three):
        assert np.all(shard_of(part["keys"], 3) == rank)
        where = np.searchsorted(merged["keys"], part["keys"])
        np.testing.assert_array_equal(merged["values"][where], part["values"])


# -- bad rows: each rank checks only its own rows -------------------------------------

def _bad_csv(path: Path, bad: dict[int, str]) -> Path:
    """A CSV of 4 batches of 256 rows (``CSV_ARGS``) whose data lines ``bad`` (0-based)
    are replaced; local batch k (128 rows) is read by rank k % 2 only."""
    rng = np.random.default_rng(5)
    lines = ["label,x1,x2,a,b,tags"]
    for i in range(4 * 256):
        lines.append(bad.get(i, f"{int(rng.random() < 0.3)},{rng.random():.3f},"
                                f"{rng.normal():.3f},a{rng.integers(50)},b{i % 5},t{i % 7}"))
    path.write_text("\n".join(lines) + "\n")
    return path


def test_bad_row_read_by_one_rank_stops_every_rank_with_file_line_and_field(tmp_path):
    # data line 300 sits in local batch 2 (rows 256-383): rank 0 reads it, rank 1 not
    data = _bad_csv(tmp_path / "train.csv", {300: "1,oops,0.5,a1,b1,t1"})
    done = torchrun(["--train", str(data), *CSV_ARGS, "--out", str(tmp_path / "m")],
                    check=False)
    assert done.returncode != 0
    message = f"{data}: line 302: field 'x1': not a finite number, got 'oops'"
    assert message in done.stderr
    assert "found by rank 0; every rank stops" in done.stderr  # rank 1 says so too
    assert not list_checkpoints(tmp_path / "m")


def test_skipped_rows_are_counted_over_all_ranks(tmp_path):
    bad = {10: "2,0.1,0.2,a1,b1,t1", 140: "1,0.1", 141: "0,x,0.2,a1,b1,t1",
           700: "1,0.1,inf,a1,b1,t1"}  # ranks 0, 1, 1, 1
    data = _bad_csv(tmp_path / "train.csv", bad)
    common = ["--train", str(data), *CSV_ARGS, "--on-bad-row", "skip", "--valid-split", "0"]
    single([*common, "--out", str(tmp_path / "one")])
    torchrun([*common, "--out", str(tmp_path / "two")])
    one = json.loads((tmp_path / "one" / "metrics.json").read_text())
    two = json.loads((tmp_path / "two" / "metrics.json").read_text())
    assert one["skipped_rows"] == two["skipped_rows"] == 4
    assert one["rows"] == two["rows"] == 4 * 256 - 4


# -- dense gradient compression and kill-and-resume on synthetic data ------------------

def _synth_args(root: Path) -> list[str]:
    return ["--train", str(root / "train.txt"), "--valid", str(root / "valid.txt"),
            "--epochs", "1", "--batch-size", "512", "--pass-rows", "8192", "--threads", "1",
            "--no-progress"]


DGC = ["--dense-comm", "dgc", "--dgc-ratio", "0.001", "--dgc-warmup-steps", "20"]


@pytest.fixture(scope="module")
def synth_runs(tmp_path_factory):
    from terarec.data.synth import generate

    root = tmp_path_factory.mktemp("synth")
    generate(root / "train.txt", 32_768, sample_seed=1)
    generate(root / "valid.txt", 8192, sample_seed=2)
    torchrun([*_synth_args(root), "--out", str(root / "none")])
    torchrun([*_synth_args(root), "--out", str(root / "dgc"), *DGC])
    # per-rank tiered stores under a budget smaller than each rank's table
    torchrun([*_synth_args(root), "--out", str(root / "tiered"), "--memory-budget", "4MB",
              "--store-dir", str(root / "rank-stores")])
    return root


def test_ranks_with_tiered_stores_train_the_same_model_as_in_memory(synth_runs):
    memory = Trainer.from_checkpoint(synth_runs / "none").store.to_arrays()
    tiered = Trainer.from_checkpoint(synth_runs / "tiered").store.to_arrays()
    np.testing.assert_array_equal(tiered["keys"], memory["keys"])
    np.testing.assert_allclose(tiered["values"], memory["values"], atol=1e-6)
    np.testing.assert_allclose(tiered["state"], memory["state"], atol=1e-6)
    # each rank's table outgrew its budget: rows were spilled to its disk tier
    meta = json.loads((list_checkpoints(synth_runs / "tiered")[0] / "meta.json").read_text())
    assert len(meta["stores"]) == 2
    for rank_store in meta["stores"]:
        tiers = rank_store["tiers"]
        assert tiers["memory_keys"] < 0.7 * rank_store["keys"] and tiers["spilled"] > 1000
    assert sorted(p.name for p in (synth_runs / "rank-stores").iterdir()) == [
        "rank-00000", "rank-00001"]
    m_none = json.loads((synth_runs / "none" / "metrics.json").read_text())
    m_tiered = json.loads((synth_runs / "tiered" / "metrics.json").read_text())
    assert m_tiered["auc"] == pytest.approx(m_none["auc"], abs=1e-6)


def test_dgc_sends_100x_fewer_dense_bytes_and_keeps_auc(synth_runs):
    none = json.loads((synth_runs / "none" / "metrics.json").read_text())
    dgc = json.loads((synth_runs / "dgc" / "metrics.json").read_text())
    last_none = json.loads((synth_runs / "none" / "history.json").read_text())[-1]
    last_dgc = json.loads((synth_runs / "dgc" / "history.json").read_text())[-1]
    # After warm-up: 8 bytes per sent entry, 0.1 % of the large parameters' entries,
    # and 4 bytes an entry of the small ones, vs 4 bytes each (DeepFM: 176x).
    assert last_none["dense_bytes_per_step"] / last_dgc["dense_bytes_per_step"] > 150
    truth = json.loads((synth_runs / "valid.txt.truth.json").read_text())
    assert (none["auc"] - 0.5) / (truth["ceiling_auc"] - 0.5) > 0.6  # it did learn
    assert dgc["auc"] - none["auc"] > -0.005


def test_killed_rank_resumes_from_last_commit_and_matches_uninterrupted_run(synth_runs):
    out = synth_runs / "killed"
    done = torchrun([*_synth_args(synth_runs), "--out", str(out), *DGC],
                    script=HERE / "kill_and_resume.py", launcher=("--max-restarts", "1"),
                    env={"KILL_RANK": "1", "KILL_AFTER_PASS": "2"})
    assert "resuming" in done.stdout and "after pass 2" in done.stdout
    resumed, reference = Trainer.from_checkpoint(out), Trainer.from_checkpoint(synth_runs / "dgc")
    assert resumed.pass_id == reference.pass_id == 4
    a, b = reference.store.to_arrays(), resumed.store.to_arrays()
    assert np.array_equal(a["keys"], b["keys"])
    np.testing.assert_allclose(b["values"], a["values"], atol=1e-6)
    for name, weight in reference.model.state_dict().items():
        torch.testing.assert_close(resumed.model.state_dict()[name], weight, atol=1e-6,
                                   rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (NCCL)")
def test_nccl_rank_on_gpu_trains_the_same_model_as_one_cpu_process(csv_runs, tmp_path):
    data = csv_runs / "train.csv"
    common = ["--train", str(data), *CSV_ARGS]
    torchrun([*common, "--out", str(tmp_path / "gpu"), "--device", "cuda"],
             nproc=min(2, torch.cuda.device_count()))
    cpu = Trainer.from_checkpoint(csv_runs / "single")
    gpu = Trainer.from_checkpoint(tmp_path / "gpu")
    a, b = cpu.store.to_arrays(), gpu.store.to_arrays()
    assert np.array_equal(a["keys"], b["keys"])
    np.testing.assert_allclose(b["values"], a["values"], atol=1e-4)
