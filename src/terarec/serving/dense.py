"""The served network's forward pass: ONNX Runtime where it agrees with PyTorch, else
PyTorch.

A request's network call is small (100 rows of a 256-128 MLP), so per-operator overhead
dominates it; ONNX Runtime's CPU provider has less of it than eager PyTorch (1.5x the
rows per second at batch 100 in ``benchmarks/serve_dense.py``; TorchScript and
``torch.compile`` gained nothing there). Each version's network is exported to ONNX when
the version is loaded and kept only if its click probabilities match PyTorch's to
``TOLERANCE`` on a probe batch; any failure (no onnxruntime, an operator the exporter
cannot take, a mismatch) leaves that version on PyTorch, logged once.
"""

from __future__ import annotations

import io
import logging
import warnings
from collections.abc import Callable

import numpy as np
import torch

from terarec.models.base import CTRModel
from terarec.types import FeatureSchema

log = logging.getLogger(__name__)
# Largest |probability difference| against PyTorch a converted network may show.
TOLERANCE = 1e-6
Forward = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def torch_forward(model: CTRModel) -> Forward:
    """Logits ``[B]`` of ``model`` (eval mode, no autograd)."""
    model.eval()

    def forward(dense: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            return model(dense, emb)

    return forward


def onnx_forward(model: CTRModel, schema: FeatureSchema, row_dim: int,
                 threads: int | None = None) -> Forward | None:
    """``model``'s forward pass run by ONNX Runtime, or None where that is not possible
    or its probabilities differ from PyTorch's by more than ``TOLERANCE``."""
    try:
        import onnxruntime as ort
    except ImportError:
        return None
    model.eval()
    fields = len(schema.sparse_fields)
    gen = torch.Generator().manual_seed(0)
    dense = torch.randn(64, schema.dense_dim, generator=gen)
    emb = 0.1 * torch.randn(64, fields, row_dim, generator=gen)
    buf = io.BytesIO()
    try:
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")
            torch.onnx.export(model, (dense, emb), buf,  # type: ignore[arg-type]
                              input_names=["dense", "emb"],
                              output_names=["logit"],
                              dynamic_axes={"dense": {0: "b"}, "emb": {0: "b"},
                                            "logit": {0: "b"}}, dynamo=False)
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads or torch.get_num_threads()
        options.inter_op_num_threads = 1
        options.log_severity_level = 3
        session = ort.InferenceSession(buf.getvalue(), options,
                                       providers=["CPUExecutionProvider"])
    except Exception as exc:  # an exporter or runtime that cannot take this network
        log.warning("serving %s with PyTorch: ONNX export failed (%s: %s)",
                    type(model).__name__, type(exc).__name__, exc)
        return None

    def forward(d: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        out = session.run(None, {"dense": d.numpy(), "emb": e.numpy()})[0]
        return torch.from_numpy(np.asarray(out)).reshape(d.shape[0])

    with torch.inference_mode():
        want = torch.sigmoid(model(dense, emb))
    try:
        got = torch.sigmoid(forward(dense, emb))
    except Exception as exc:
        log.warning("serving %s with PyTorch: ONNX Runtime failed (%s)",
                    type(model).__name__, exc)
        return None
    diff = float((got - want).abs().max())
    if not diff <= TOLERANCE:
        log.warning("serving %s with PyTorch: ONNX Runtime's scores differ by %.2e",
                    type(model).__name__, diff)
        return None
    return forward


def best_forward(model: CTRModel, schema: FeatureSchema, row_dim: int) -> Forward:
    """ONNX Runtime when it agrees with PyTorch, else PyTorch."""
    return onnx_forward(model, schema, row_dim) or torch_forward(model)
