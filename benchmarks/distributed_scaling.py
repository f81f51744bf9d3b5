"""Distributed scaling on one machine: 1 rank x 1 thread against 2 ranks x 1 thread.

Same synthetic Criteo-format data, same global batch and passes. Runs ``terarec train``
once as a plain process and three times under torchrun with 2 gloo ranks (dense
gradients exchanged with none / fp16 / dgc), then prints one JSON line:

    sps_1rank, sps_2ranks, scaling       training samples/s (staging + steps + write-back;
                                         the reading thread runs alongside) and their ratio
    bytes_per_step {none, fp16, dgc}     dense-gradient bytes one rank sends per step (dgc:
                                         after its warm-up)
    sparse_bytes_per_step                embedding rows + gradients (+ staging) per step
    dgc_compression                      bytes none / bytes dgc
    auc_none, auc_dgc, delta_auc_dgc     validation AUC of the 2-rank runs

Usage: ``python benchmarks/distributed_scaling.py [--rows 250000] [--workdir DIR]``.
The default run takes about 3 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from terarec.data.synth import generate


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train(args: argparse.Namespace, out: Path, ranks: int, dense_comm: str = "none") -> dict:
    """One ``terarec train`` run; returns its metrics plus the last pass's record."""
    cmd = [sys.executable]
    if ranks > 1:
        cmd += ["-m", "torch.distributed.run", "--nproc_per_node", str(ranks),
                "--master_port", str(free_port())]
    cmd += ["-m", "terarec", "train", "--train", str(args.workdir / "train.txt"),
            "--valid", str(args.workdir / "valid.txt"), "--out", str(out),
            "--batch-size", str(args.batch_size), "--pass-rows", str(args.pass_rows),
            "--model", args.model, "--threads", "1", "--no-progress", "--seed", "0"]
    if ranks > 1:
        cmd += ["--dense-comm", dense_comm, "--dgc-ratio", str(args.dgc_ratio),
                "--dgc-warmup-steps", str(args.dgc_warmup_steps)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    start = time.perf_counter()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-4000:]}")
    metrics = json.loads((out / "metrics.json").read_text())
    history = json.loads((out / "history.json").read_text())
    metrics["last_pass"] = history[-1]
    metrics["run_seconds"] = time.perf_counter() - start
    return metrics


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=250_000)
    p.add_argument("--valid-rows", type=int, default=30_000)
    p.add_argument("--batch-size", type=int, default=1024)
    p.add_argument("--pass-rows", type=int, default=100_000)
    p.add_argument("--model", default="deepfm")
    p.add_argument("--dgc-ratio", type=float, default=0.001)
    p.add_argument("--dgc-warmup-steps", type=int, default=50)
    p.add_argument("--workdir", type=Path, default=None)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="terarec-dist-bench-") as tmp:
        args.workdir = args.workdir or Path(tmp)
        args.workdir.mkdir(parents=True, exist_ok=True)
        if not (args.workdir / "train.txt").exists():
            generate(args.workdir / "train.txt", args.rows, sample_seed=1)
            generate(args.workdir / "valid.txt", args.valid_rows, sample_seed=2)
        one = train(args, args.workdir / "model-1rank", 1)
        runs = {c: train(args, args.workdir / f"model-2ranks-{c}", 2, c)
                for c in ("none", "fp16", "dgc")}
    steady = {c: runs[c]["last_pass"]["dense_bytes_per_step"] for c in runs}
    result = {
        "rows": args.rows, "batch_size": args.batch_size, "model": args.model,
        "sps_1rank": round(one["samples_per_s"], 1),
        "sps_2ranks": round(runs["none"]["samples_per_s"], 1),
        "scaling": round(runs["none"]["samples_per_s"] / one["samples_per_s"], 3),
        "bytes_per_step": {c: round(b, 1) for c, b in steady.items()},
        "sparse_bytes_per_step": round(runs["none"]["sparse_bytes_per_step"], 1),
        "dgc_ratio": args.dgc_ratio,
        "dgc_compression": round(steady["none"] / steady["dgc"], 1),
        "auc_1rank": round(one["auc"], 5),
        "auc_none": round(runs["none"]["auc"], 5),
        "auc_fp16": round(runs["fp16"]["auc"], 5),
        "auc_dgc": round(runs["dgc"]["auc"], 5),
        "delta_auc_dgc": round(runs["dgc"]["auc"] - runs["none"]["auc"], 5),
        "wall_s": {"1rank": round(one["run_seconds"], 1),
                   **{f"2ranks_{c}": round(r["run_seconds"], 1) for c, r in runs.items()}},
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
