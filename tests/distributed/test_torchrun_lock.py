"""The ``train --out`` lock under torchrun: while every rank of a run lives, a second
torchrun job or a single process on the same ``--out`` is refused on every rank with one
message, promptly (no rank left waiting in a collective); a rank of an earlier run still
alive after its rank 0 is gone blocks a new run too."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_torchrun import HERE, _env, _run, port_taken, torchrun

from terarec.data.synth import generate
from terarec.loopback import free_port

pytestmark = pytest.mark.dist

def single(args: list[str]) -> subprocess.CompletedProcess:
    return _run([sys.executable, "-m", "terarec", "train", *args], check=False)


ARGS = ["--pass-rows", "1000", "--batch-size", "250", "--embedding-dim", "4",
        "--threads", "1", "--no-progress", "--model", "lr"]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("lock") / "train.tsv"
    generate(path, 2000, model_seed=0, sample_seed=1, vocab_scale=0.01)
    return path


def _only_the_launchers_traceback(err: str) -> None:
    """torchrun itself reports failed workers with a traceback; the ranks print none."""
    assert err.count("Traceback") <= 1 and "ChildFailedError" in err, err[-4000:]


def _hold(cmd: list[str], env: dict[str, str], paths: list[Path],
          timeout_s: float = 180) -> subprocess.Popen:
    """Start ``cmd`` (a torchrun launch that holds the lock) and wait for ``paths``; a
    launch whose ``--master_port`` was taken before the agent bound it (it exits with
    EADDRINUSE having run nothing) is started again on a new port."""
    cmd = list(cmd)
    for _ in range(3):
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while not all(p.exists() for p in paths):
            if proc.poll() is not None:
                out, err = proc.communicate()
                if port_taken(cmd, subprocess.CompletedProcess(cmd, proc.returncode, out, err)):
                    break
                pytest.fail(f"the holding run exited early: {err[-4000:]}")
            if time.monotonic() > deadline:
                os.killpg(proc.pid, signal.SIGKILL)
                pytest.fail("the holding run never committed its first pass")
            time.sleep(0.1)
        else:
            return proc
    pytest.fail("the holding run's port was taken three times")


def test_a_second_job_or_process_is_refused_on_every_rank(data, tmp_path):
    out, hold = tmp_path / "model", tmp_path / "hold"
    hold.mkdir()
    first = _hold(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
         "--master_port", str(free_port()), str(HERE / "hold_after_commit.py"), "train",
         "--train", str(data), "--out", str(out), *ARGS],
        {**_env(), "HOLD_DIR": str(hold)}, [hold / "rank-0", hold / "rank-1"])
    try:
        refused = f"model directory {out} is in use by another process (lock file " \
                  f"{out / '.lock'}, held by pid"
        started = time.monotonic()
        second = torchrun(["--train", str(data), "--out", str(out), *ARGS], check=False)
        assert second.returncode != 0
        assert second.stderr.count(f"terarec train: error: {refused}") == 2, second.stderr
        _only_the_launchers_traceback(second.stderr)
        alone = single(["--train", str(data), "--out", str(out), *ARGS])
        assert alone.returncode == 2 and refused in alone.stderr
        assert time.monotonic() - started < 200
    finally:
        (hold / "release").touch()
        try:
            _, err = first.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            os.killpg(first.pid, signal.SIGKILL)
            raise
    assert first.returncode == 0, err[-4000:]
    assert (out / "metrics.json").exists()


def test_a_surviving_rank_of_an_earlier_run_blocks_a_new_one(data, tmp_path):
    out = tmp_path / "model"
    # What a rank whose rank 0 died holds while it still writes its shard.
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from terarec.io import shared_lock\n"
         f"with shared_lock({str(out / '.lock-ranks')!r}, 'x'):\n"
         "    print('held', flush=True); time.sleep(120)"],
        env=_env(), stdout=subprocess.PIPE)
    try:
        assert holder.stdout.readline().strip() == b"held"
        refused = f"model directory {out} is still written by a rank of an earlier run " \
                  f"(lock file {out / '.lock-ranks'})"
        alone = single(["--train", str(data), "--out", str(out), *ARGS])
        assert alone.returncode == 2 and refused in alone.stderr
        job = torchrun(["--train", str(data), "--out", str(out), *ARGS], check=False)
        assert job.returncode != 0
        assert job.stderr.count(f"terarec train: error: {refused}") == 2, job.stderr
        _only_the_launchers_traceback(job.stderr)
        assert not (out / "checkpoints").exists()
    finally:
        holder.kill()
        holder.wait()
    # Once it is gone, the directory is free again.
    assert torchrun(["--train", str(data), "--out", str(out), *ARGS]).returncode == 0
