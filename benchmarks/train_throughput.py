"""Training throughput: terarec's pass-staged store against plain PyTorch, TorchRec and the
dense-only bound, on the same synthetic data and the same DLRM network, in one run.

terarec's figure is wall time over whole passes: finding each pass's unique keys (in the
read-ahead thread, as in ``terarec train``), pulling their rows from an unbounded
collisionless store (new keys created on the way), remapping samples to local rows,
training, and writing rows back. The baselines use
fixed tables of 1M rows per field (``key % 1M``: collisions allowed). The dense-only
bound is measured eager fp32 (``dense_only_sps``), with the dense settings terarec's run
used (``dense_only_same_sps``), and with those settings plus the gradient that reaches
the embeddings, which any embedding path computes (``dense_only_same_grad_sps``).

Prints one JSON line. Usage: ``python benchmarks/train_throughput.py [--rows N]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _baselines as baselines  # noqa: E402

from terarec.config import ModelConfig, SparseOptimizerConfig, TrainConfig  # noqa: E402
from terarec.data.synth import generate_arrays  # noqa: E402
from terarec.kernels import splitmix64_array  # noqa: E402
from terarec.train.dense_step import AUTOCAST_MODES, COMPILE_MODES, DenseStep  # noqa: E402
from terarec.train.passes import prefetch  # noqa: E402
from terarec.train.trainer import Trainer  # noqa: E402
from terarec.types import Batch, FeatureSchema, FieldSpec, KeyedIds  # noqa: E402


def synthetic_inputs(rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Zipf keys with planted signal (data/synth), hashed per field into int64 keys."""
    arrays = generate_arrays(rows, model_seed=seed, sample_seed=seed + 1)
    dense = np.log1p(np.nan_to_num(arrays.dense, nan=0.0).clip(min=0)).astype(np.float32)
    field = np.arange(arrays.categorical.shape[1], dtype=np.uint64)
    z = arrays.categorical.astype(np.uint64) + (field << np.uint64(40))
    keys = splitmix64_array(z).view(np.int64)
    return (torch.from_numpy(dense), torch.from_numpy(np.ascontiguousarray(keys)),
            torch.from_numpy(arrays.labels.astype(np.float32)))


def benchmark_schema() -> FeatureSchema:
    numeric = tuple(FieldSpec(f"I{i}", "numeric") for i in range(1, 14))
    cats = tuple(FieldSpec(f"C{i}", "categorical") for i in range(1, 27))
    return FeatureSchema(label="label", fields=numeric + cats, missing_flags=False)


def pass_groups(dense: torch.Tensor, ids: torch.Tensor, labels: torch.Tensor,
                names: Sequence[str], *, batch_size: int, pass_batches: int,
                passes: int) -> list[list[Batch]]:
    """The rows cut into whole batches and grouped into a warm-up pass plus ``passes``."""
    batches = [Batch(dense[s:s + batch_size], KeyedIds.from_dense(names, ids[s:s + batch_size]),
                     labels[s:s + batch_size])
               for s in range(0, len(labels) - batch_size + 1, batch_size)]
    need = pass_batches * (passes + 1)
    if len(batches) < need:
        raise SystemExit(f"need {need * batch_size} rows for {passes + 1} passes")
    return [batches[p * pass_batches:(p + 1) * pass_batches] for p in range(passes + 1)]


def terarec_run(dense, ids, labels, *, batch_size: int, pass_batches: int,
                passes: int, compile: str = "auto",
                autocast: str = "auto") -> tuple[float, float, DenseStep]:
    """(samples/s, staging share) over ``passes`` timed passes after one warm-up pass.

    Passes are planned (unique keys, counts) in the read-ahead thread as ``Trainer.fit``
    does; the clock is wall time over the timed passes, so that planning counts unless
    it is really hidden behind training. Also returns the trainer's dense step, which
    says what the switches resolved to."""
    schema = benchmark_schema()
    config = TrainConfig(
        batch_size=batch_size, seed=0, compile=compile, autocast=autocast,  # type: ignore[arg-type]
        model=ModelConfig(name="dlrm", embedding_dim=baselines.EMB_DIM,
                          bottom_mlp=(baselines.BOTTOM_HIDDEN, baselines.EMB_DIM),
                          top_mlp=baselines.TOP_MLP),
        sparse_optimizer=SparseOptimizerConfig(name="adagrad", lr=baselines.EMBEDDING_LR))
    trainer = Trainer(schema, config)
    groups = pass_groups(dense, ids, labels, schema.sparse_names, batch_size=batch_size,
                         pass_batches=pass_batches, passes=passes)
    trainer.train_pass(trainer.plan(groups[0]))  # warm-up: compilation, allocator
    rows = staging = 0.0
    start = time.perf_counter()
    for plan in prefetch(trainer.plan(g) for g in groups[1:]):
        r = trainer.train_pass(plan)
        rows += r.rows
        staging += r.staging_s + r.write_back_s
    wall = time.perf_counter() - start
    return rows / wall, staging / wall, trainer.dense_step

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=700_000)
    parser.add_argument("--batch-size", type=int, default=baselines.BATCH_SIZE)
    parser.add_argument("--pass-batches", type=int, default=50)
    parser.add_argument("--passes", type=int, default=2)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="default: all cores")
    parser.add_argument("--compile", choices=COMPILE_MODES, default="auto",
                        help="terarec's dense-step switch (train.dense_step)")
    parser.add_argument("--autocast", choices=AUTOCAST_MODES, default="auto",
                        help="terarec's dense-step switch (train.dense_step)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dense, ids, labels = synthetic_inputs(args.rows, seed=0)
    common = dict(steps=args.steps, warmup=5, batch_size=args.batch_size)
    runs: dict[str, list[float]] = {"terarec": [], "pytorch": [], "dense_only": [],
                                    "dense_only_same": [], "dense_only_same_grad": [],
                                    "torchrec": []}
    shares = []
    load_start = os.getloadavg()
    for _ in range(args.repeats):  # interleaved so machine noise hits all alike
        sps, share, step = terarec_run(dense, ids, labels, batch_size=args.batch_size,
                                       pass_batches=args.pass_batches, passes=args.passes,
                                       compile=args.compile, autocast=args.autocast)
        runs["terarec"].append(sps)
        shares.append(share)
        runs["pytorch"].append(baselines.pytorch_sps(dense, ids, labels, **common))
        runs["dense_only"].append(baselines.dense_only_sps(dense, ids, labels, **common))
        # the bound with the dense settings terarec's run ended with
        settings = {"compile": "on" if step.compiled else "off",
                    "autocast": "bf16" if step.dtype is not None else "off"}
        if settings != {"compile": "off", "autocast": "off"}:
            runs["dense_only_same"].append(
                baselines.dense_only_sps(dense, ids, labels, **common, **settings))
        else:  # the same settings as the eager fp32 bound: the same figure
            runs["dense_only_same"].append(runs["dense_only"][-1])
        # ... and with the gradient that every embedding path hands to its rows
        runs["dense_only_same_grad"].append(
            baselines.dense_only_sps(dense, ids, labels, **common, **settings,
                                     embedding_grad=True))
        tr = baselines.torchrec_sps(dense, ids, labels, **common)
        if tr is not None:
            runs["torchrec"].append(tr)
    med = {k: statistics.median(v) if v else None for k, v in runs.items()}

    def ratio(other: float | None) -> float | None:
        return round(med["terarec"] / other, 3) if other else None

    print(json.dumps({
        "benchmark": "train_throughput",
        "threads": torch.get_num_threads(),
        "rows": args.rows,
        "batch_size": args.batch_size,
        "terarec_sps": round(med["terarec"]),
        "pytorch_sps": round(med["pytorch"]),
        "dense_only_sps": round(med["dense_only"]),
        "dense_only_same_sps": round(med["dense_only_same"]),
        "dense_only_same_grad_sps": round(med["dense_only_same_grad"]),
        "torchrec_sps": round(med["torchrec"]) if med["torchrec"] else None,
        "ratio_vs_pytorch": ratio(med["pytorch"]),
        "ratio_vs_dense_only": ratio(med["dense_only"]),
        "ratio_vs_dense_only_same": ratio(med["dense_only_same"]),
        "ratio_vs_dense_only_same_grad": ratio(med["dense_only_same_grad"]),
        "ratio_vs_torchrec": ratio(med["torchrec"]),
        "dense_settings": {"compile_switch": args.compile, "autocast_switch": args.autocast,
                           **settings, "cpu_capability": torch.backends.cpu.get_cpu_capability()},
        "staging_share": round(statistics.median(shares), 3),
        "repeats": args.repeats,
        "load_avg": {"start": [round(x, 2) for x in load_start],
                     "end": [round(x, 2) for x in os.getloadavg()]},
    }))


if __name__ == "__main__":
    main()
