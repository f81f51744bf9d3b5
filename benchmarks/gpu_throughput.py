"""Device-tier throughput: terarec with a device row cache smaller than the table, against
the dense-only bound and TorchRec, on the same synthetic Zipf data and DLRM shapes as
``train_throughput.py`` (batch 16384), in one run.

terarec's figure is wall time over whole passes (planning in the read-ahead thread,
staging from cache hits plus read-ahead misses, training, write-back), with
``--device-budget`` below the table's size (default: a quarter of the rows the data
touches). Device figures are over the timed passes: ``device_hit_rate`` (pass keys found
on the device), ``h2d_bytes_per_pass`` (rows and state copied to the device),
``h2d_hidden_share`` (of those, copied while the previous pass trained),
``peak_device_bytes`` (CUDA: the allocator's peak; CPU: cache plus working set).

The same code runs with ``--device cpu`` (host memory stands in for the device) and prints
the same keys. Prints one JSON line. Usage:
``python benchmarks/gpu_throughput.py [--device cuda] [--rows N] [--device-budget 2GB]``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _baselines as baselines  # noqa: E402
from train_throughput import benchmark_schema, pass_groups, synthetic_inputs  # noqa: E402

from terarec.config import ModelConfig, SparseOptimizerConfig, TrainConfig  # noqa: E402
from terarec.embedding.device import codec_bytes  # noqa: E402
from terarec.train.passes import prefetch  # noqa: E402
from terarec.train.trainer import Trainer  # noqa: E402


def terarec_run(dense, ids, labels, *, device: str, budget: int, batch_size: int,
                pass_batches: int, passes: int) -> dict:
    """Samples/s and device figures over ``passes`` timed passes after one warm-up pass."""
    config = TrainConfig(
        batch_size=batch_size, seed=0, device=device, device_budget=budget,
        model=ModelConfig(name="dlrm", embedding_dim=baselines.EMB_DIM,
                          bottom_mlp=(baselines.BOTTOM_HIDDEN, baselines.EMB_DIM),
                          top_mlp=baselines.TOP_MLP),
        sparse_optimizer=SparseOptimizerConfig(name="adagrad", lr=baselines.EMBEDDING_LR))
    trainer = Trainer(benchmark_schema(), config)
    cache = trainer.device_cache
    assert cache is not None
    groups = pass_groups(dense, ids, labels, benchmark_schema().sparse_names,
                         batch_size=batch_size, pass_batches=pass_batches, passes=passes)
    plans = list(prefetch(trainer.plan(g) for g in groups))
    trainer.train_pass(plans[0], upcoming=plans[1])  # warm-up: compilation, allocator
    if trainer.device.type == "cuda":
        torch.cuda.synchronize(trainer.device)
        torch.cuda.reset_peak_memory_stats(trainer.device)
    before = dict(vars(cache.stats))
    rows = 0
    start = time.perf_counter()
    for i, plan in enumerate(plans[1:], 1):
        upcoming = plans[i + 1] if i + 1 < len(plans) else None
        rows += trainer.train_pass(plan, upcoming=upcoming).rows
    if trainer.device.type == "cuda":
        torch.cuda.synchronize(trainer.device)
    wall = time.perf_counter() - start
    after = vars(cache.stats)
    delta = {k: after[k] - before[k] for k in ("hits", "misses", "h2d_bytes", "hidden_bytes")}
    looked_up = delta["hits"] + delta["misses"]
    return {
        "sps": rows / wall,
        "device_hit_rate": delta["hits"] / looked_up if looked_up else 0.0,
        "h2d_bytes_per_pass": delta["h2d_bytes"] / passes,
        "h2d_hidden_share": (delta["hidden_bytes"] / delta["h2d_bytes"]
                             if delta["h2d_bytes"] else 0.0),
        "peak_device_bytes": cache.peak_bytes,
        "cached_rows": len(cache),
        "cache_capacity": cache.capacity,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--rows", type=int, default=16384 * 12)
    parser.add_argument("--batch-size", type=int, default=16384)
    parser.add_argument("--pass-batches", type=int, default=4)
    parser.add_argument("--passes", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--device-budget", default=None,
                        help="default: a quarter of the table the data touches")
    parser.add_argument("--threads", type=int, default=None, help="default: all cores")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dense, ids, labels = synthetic_inputs(args.rows, seed=0)
    table_rows = len(np.unique(ids.numpy()))
    row_bytes = codec_bytes("fp32", baselines.EMB_DIM) + 4  # fp32 row + Adagrad accumulator
    budget = args.device_budget or max(1, table_rows * row_bytes // 4)
    run = terarec_run(dense, ids, labels, device=args.device, budget=budget,
                      batch_size=args.batch_size, pass_batches=args.pass_batches,
                      passes=args.passes)
    common = dict(steps=args.steps, warmup=3, batch_size=args.batch_size, device=args.device)
    dense_only = baselines.dense_only_sps(dense, ids, labels, **common)
    torchrec = baselines.torchrec_sps(dense, ids, labels, **common)

    def ratio(other: float | None) -> float | None:
        return round(run["sps"] / other, 3) if other else None

    print(json.dumps({
        "benchmark": "gpu_throughput",
        "device": args.device,
        "device_name": (torch.cuda.get_device_name(torch.device(args.device))
                        if args.device.startswith("cuda") else "cpu"),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "rows": args.rows,
        "batch_size": args.batch_size,
        "table_rows": table_rows,
        "table_bytes": table_rows * row_bytes,
        "device_budget": budget,
        "terarec_sps": round(run["sps"]),
        "dense_only_sps": round(dense_only),
        "torchrec_sps": round(torchrec) if torchrec else None,
        "ratio_vs_dense_only": ratio(dense_only),
        "ratio_vs_torchrec": ratio(torchrec),
        "device_hit_rate": round(run["device_hit_rate"], 4),
        "h2d_bytes_per_pass": round(run["h2d_bytes_per_pass"]),
        "h2d_hidden_share": round(run["h2d_hidden_share"], 4),
        "peak_device_bytes": int(run["peak_device_bytes"]),
        "cached_rows": run["cached_rows"],
        "cache_capacity": run["cache_capacity"],
        "loadavg": [round(x, 2) for x in os.getloadavg()],
    }))


if __name__ == "__main__":
    main()
