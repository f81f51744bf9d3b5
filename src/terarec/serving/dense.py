"""The served network's forward pass: ONNX Runtime where it agrees with PyTorch, else
PyTorch.

A request's network call is small (100 rows of a 256-128 MLP), so per-operator overhead
dominates it; ONNX Runtime's CPU provider has less of it than eager PyTorch (1.5x the
rows per second at batch 100 in ``benchmarks/serve_dense.py``; TorchScript and
``torch.compile`` gained nothing there). A network is exported to ONNX once; the next
versions of the chain (same architecture, new weights) reuse that graph with their own
weights written into it, so a delta swap costs a session, not an export
(which traces the network in Python and would hold the GIL for a second while requests
wait). Every version's runtime is kept only if its click probabilities match PyTorch's
to ``TOLERANCE`` on a probe batch; any failure (no onnxruntime, an operator the
exporter cannot take, a mismatch) leaves that version on PyTorch, logged.
"""

from __future__ import annotations

import copy
import io
import logging
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from terarec.models.base import CTRModel
from terarec.types import FeatureSchema

log = logging.getLogger(__name__)
# Largest |probability difference| against PyTorch a converted network may show (the
# served scores must equal `terarec predict` to 1e-5).
TOLERANCE = 5e-6
Forward = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def torch_forward(model: CTRModel) -> Forward:
    """Logits ``[B]`` of ``model`` (eval mode, no autograd)."""
    model.eval()

    def forward(dense: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            return model(dense, emb)

    return forward


class OnnxForwards:
    """Builds ONNX Runtime forward passes, exporting a network's graph once per
    architecture (``_Graph``) and giving later networks of it their own weights."""

    def __init__(self, threads: int | None = None) -> None:
        self.threads = threads
        self._graph: _Graph | None = None

    def build(self, model: CTRModel, schema: FeatureSchema, row_dim: int) -> Forward | None:
        """``model``'s forward pass on ONNX Runtime, or None where that is not possible
        or its probabilities differ from PyTorch's by more than ``TOLERANCE``."""
        try:
            import onnxruntime as ort
        except ImportError:
            return None
        model.eval()
        gen = torch.Generator().manual_seed(0)
        dense = torch.randn(64, schema.dense_dim, generator=gen)
        emb = 0.1 * torch.randn(64, len(schema.sparse_fields), row_dim, generator=gen)
        with torch.inference_mode():
            want = torch.sigmoid(model(dense, emb))
        name = type(model).__name__
        reused = self._graph is not None and self._graph.fits(model)
        for fresh in ((False, True) if reused else (True,)):
            try:
                if fresh:
                    self._graph = _Graph(model, dense, emb)
                assert self._graph is not None
                forward = self._graph.forward(ort, model,
                                              self.threads or torch.get_num_threads())
                diff = float((torch.sigmoid(forward(dense, emb)) - want).abs().max())
            except Exception as exc:  # an exporter or runtime that cannot take it
                log.warning("serving %s with PyTorch: ONNX export failed (%s: %s)", name,
                            type(exc).__name__, exc)
                return None
            if diff <= TOLERANCE:
                return forward
        log.warning("serving %s with PyTorch: ONNX Runtime's scores differ by %.2e", name,
                    diff)
        return None


class _Graph:
    """One architecture's ONNX graph, its weights named as in the network's
    ``state_dict``, so that any network of the architecture runs on it with its own
    weights. It is exported from a copy of the network with random weights, without
    constant folding: the exporter folds nothing into the graph and merges no two
    weights that happen to be equal (two zero biases, say)."""

    def __init__(self, model: CTRModel, dense: torch.Tensor, emb: torch.Tensor) -> None:
        import onnx

        probe = copy.deepcopy(model).eval()
        gen = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for value in probe.state_dict().values():
                if value.is_floating_point():
                    value.copy_(torch.randn(value.shape, generator=gen, dtype=value.dtype))
        buf = io.BytesIO()
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")
            torch.onnx.export(_Positional(probe), (dense, emb), buf,  # type: ignore[arg-type]
                              input_names=["dense", "emb"], output_names=["logit"],
                              dynamic_axes={"dense": {0: "b"}, "emb": {0: "b"},
                                            "logit": {0: "b"}},
                              do_constant_folding=False, dynamo=False)
        self.proto = onnx.load_from_string(buf.getvalue())
        self.kind = type(model)
        self.shapes = _shapes(model)

    def fits(self, model: CTRModel) -> bool:
        """Whether ``model`` has this graph's architecture (class and weight shapes)."""
        return type(model) is self.kind and _shapes(model) == self.shapes

    def forward(self, ort: Any, model: CTRModel, threads: int) -> Forward:
        """The forward pass of this graph with ``model``'s weights."""
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        # Idle pool threads sleep instead of spinning: on cores shared with the event
        # loop and the other workers, a spinning thread takes the time requests need.
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        options.add_session_config_entry("session.inter_op.allow_spinning", "0")
        options.log_severity_level = 3
        from onnx import numpy_helper

        state = {_PREFIX + k: v for k, v in model.state_dict().items()}
        # The weights are written into the graph (not passed as overriding initializers:
        # the session's optimizer folds the graph's own values before those apply).
        for tensor in self.proto.graph.initializer:
            if tensor.name in state:
                value = state[tensor.name].detach().cpu().contiguous().numpy()
                tensor.CopyFrom(numpy_helper.from_array(value, tensor.name))
        session = ort.InferenceSession(self.proto.SerializeToString(), options,
                                       providers=["CPUExecutionProvider"])

        run = session.run
        outputs = ["logit"]
        tasks = (model.num_tasks,) if model.multi_task else ()  # [B] or [B, T] logits

        def forward(d: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
            out = run(outputs, {"dense": np.ascontiguousarray(d.numpy()),
                                "emb": np.ascontiguousarray(e.numpy())})[0]
            return torch.from_numpy(out.reshape(d.shape[0], *tasks))

        return forward


_PREFIX = "net."  # the wrapped network's weights in the graph: net.<state_dict key>


class _Positional(torch.nn.Module):
    """The network called with exactly its two inputs: the exporter passes keyword
    defaults on as an extra positional argument, which a forward with keyword-only
    options (DSSM's ``towers``) refused, so its versions were served by PyTorch."""

    def __init__(self, net: CTRModel) -> None:
        super().__init__()
        self.net = net

    def forward(self, dense: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        return self.net(dense, emb)


def _shapes(model: CTRModel) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    return {k: (tuple(v.shape), v.dtype) for k, v in model.state_dict().items()}
