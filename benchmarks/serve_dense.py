"""The served network's forward pass on CPU: eager PyTorch against TorchScript
(traced and frozen), ``torch.compile`` and ONNX Runtime (when installed), on
pre-pooled rows at the batch sizes the server runs (one request of 100 candidates, and
16 such requests merged by the dynamic batcher).

The network is the one ``benchmarks/serve_latency.py`` serves: DeepFM on the Criteo
schema, embedding dim 16, deep MLP 256-128, random weights (speed does not depend on
them). Each variant's scores are checked against eager to 1e-5. Timings are CPU time of
this process (``time.process_time``), which a loaded machine disturbs less than wall
time; the median of ``--repeats`` runs is reported.

Prints one JSON line: rows per second per variant and batch size, the best variant, and
the machine's load. Usage: ``python benchmarks/serve_dense.py [--threads 1]``.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

from terarec.config import ModelConfig
from terarec.models import build_model
from terarec.types import FeatureSchema

ROW_DIM = 17  # embedding_dim + the first-order weight


def rows_per_s(fn: Callable[[], object], rows: int, seconds: float, repeats: int) -> float:
    for _ in range(20):
        fn()
    runs = []
    for _ in range(repeats):
        calls, start = 0, time.process_time()
        while time.process_time() - start < seconds / repeats:
            fn()
            calls += 1
        runs.append(calls * rows / (time.process_time() - start))
    return statistics.median(runs)


def onnx_session(model: torch.nn.Module, dense: torch.Tensor, emb: torch.Tensor,
                 threads: int) -> Callable[[np.ndarray, np.ndarray], np.ndarray] | None:
    try:
        import onnxruntime as ort
    except ImportError:
        return None
    buf = io.BytesIO()
    try:
        torch.onnx.export(model, (dense, emb), buf, input_names=["dense", "emb"],
                          output_names=["logit"], dynamic_axes={"dense": {0: "b"},
                                                                "emb": {0: "b"}},
                          dynamo=False)
    except Exception as exc:  # an exporter that cannot take the model: not measured
        print(f"ONNX export failed: {exc}")
        return None
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    session = ort.InferenceSession(buf.getvalue(), options,
                                   providers=["CPUExecutionProvider"])
    return lambda d, e: session.run(None, {"dense": d, "emb": e})[0]


def measure(model: torch.nn.Module, schema: FeatureSchema, batch: int,
            args: argparse.Namespace) -> dict[str, float]:
    """Rows per second of each variant at ``batch`` rows; each variant's click
    probabilities (what the server answers) must match eager's to 1e-5."""
    gen = torch.Generator().manual_seed(batch)
    dense = torch.randn(batch, schema.dense_dim, generator=gen)
    emb = 0.1 * torch.randn(batch, len(schema.categorical), ROW_DIM, generator=gen)
    want = torch.sigmoid(model(dense, emb))
    traced = torch.jit.freeze(torch.jit.trace(model, (dense, emb)))
    compiled = torch.compile(model, dynamic=False)
    variants: dict[str, Callable[[], object]] = {
        "eager": lambda: model(dense, emb), "torchscript": lambda: traced(dense, emb),
        "torch_compile": lambda: compiled(dense, emb)}
    run_onnx = onnx_session(model, dense, emb, args.threads)
    if run_onnx is not None:
        d, e = dense.numpy(), emb.numpy()
        variants["onnxruntime"] = lambda: run_onnx(d, e)
    rates = {}
    for name, fn in variants.items():
        got = torch.sigmoid(torch.as_tensor(np.asarray(fn())).reshape(want.shape))
        if not torch.allclose(got, want, atol=1e-5, rtol=0):
            raise AssertionError(f"{name} disagrees with eager at batch {batch}: "
                                 f"{(got - want).abs().max().item():.2e}")
        rates[name] = rows_per_s(fn, batch, args.seconds, args.repeats)
    return rates


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seconds", type=float, default=3.0, help="per variant and size")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    schema = FeatureSchema.criteo()
    model = build_model(schema, ModelConfig(name="deepfm", embedding_dim=16)).eval()
    results: dict[str, dict[str, float]] = {}
    for batch in (100, 1600):
        for name, rate in measure(model, schema, batch, args).items():
            results.setdefault(name, {})[f"batch_{batch}"] = round(rate, 1)
    best = max(results, key=lambda k: results[k]["batch_100"])
    print(json.dumps({
        "rows_per_s": results,
        "best_at_batch_100": best,
        "speedup_vs_eager_batch_100": round(results[best]["batch_100"]
                                            / results["eager"]["batch_100"], 3),
        "threads": args.threads,
        "timer": "process_time",
        "load_avg": [round(x, 2) for x in os.getloadavg()],
        "cpus": os.cpu_count(),
    }))


if __name__ == "__main__":
    main()
