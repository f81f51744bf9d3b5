"""The served forward pass (serving/dense.py): ONNX Runtime's probabilities equal
PyTorch's, also when a graph exported for one version runs the next version's weights."""

from __future__ import annotations

import pytest
import torch

from terarec.config import MULTI_TASK_MODELS, SEQUENCE_MODELS, ModelConfig
from terarec.models import MODELS, build_model
from terarec.serving.dense import TOLERANCE, OnnxForwards, torch_forward
from terarec.types import FeatureSchema

pytest.importorskip("onnxruntime")
SCHEMA = FeatureSchema.criteo()


def _inputs(row_dim: int, rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, SCHEMA.dense_dim, generator=gen),
            0.3 * torch.randn(rows, len(SCHEMA.sparse_fields), row_dim, generator=gen))


# dssm, the sequence and the multi-task models have ONNX tests of their own.
@pytest.mark.parametrize(
    "name", sorted(set(MODELS) - {"dssm", *SEQUENCE_MODELS, *MULTI_TASK_MODELS}))
def test_onnx_forward_scores_like_pytorch(name):
    torch.manual_seed(0)
    model = build_model(SCHEMA, ModelConfig(name=name, embedding_dim=16)).eval()
    forward = OnnxForwards(threads=1).build(model, SCHEMA, model.row_dim)
    assert forward is not None, f"{name} is not served by ONNX Runtime"
    for rows in (1, 100, 777):
        dense, emb = _inputs(model.row_dim, rows, rows)
        want = torch.sigmoid(torch_forward(model)(dense, emb))
        got = torch.sigmoid(forward(dense, emb))
        assert got.shape == (rows,)
        assert float((got - want).abs().max()) <= TOLERANCE


def test_a_reused_graph_runs_the_new_versions_weights():
    """The next version (same architecture, new weights) reuses the exported graph; its
    scores are its own network's, not the first version's."""
    builder = OnnxForwards(threads=1)
    torch.manual_seed(0)
    first = build_model(SCHEMA, ModelConfig(name="deepfm", embedding_dim=8)).eval()
    second = build_model(SCHEMA, ModelConfig(name="deepfm", embedding_dim=8)).eval()
    with torch.no_grad():
        for p in second.parameters():
            p.add_(0.05 * torch.randn_like(p))
    run_first = builder.build(first, SCHEMA, 9)
    graph = builder._graph
    run_second = builder.build(second, SCHEMA, 9)
    assert run_first is not None and run_second is not None
    assert builder._graph is graph  # not exported again
    dense, emb = _inputs(9, 50, 3)
    for model, run in ((first, run_first), (second, run_second)):
        want = torch.sigmoid(torch_forward(model)(dense, emb))
        assert float((torch.sigmoid(run(dense, emb)) - want).abs().max()) <= TOLERANCE
    assert float((run_first(dense, emb) - run_second(dense, emb)).abs().max()) > 1e-3


def test_another_architecture_is_exported_afresh():
    builder = OnnxForwards(threads=1)
    small = build_model(SCHEMA, ModelConfig(name="deepfm", embedding_dim=8)).eval()
    builder.build(small, SCHEMA, 9)
    graph = builder._graph
    other = build_model(SCHEMA, ModelConfig(name="fm", embedding_dim=8)).eval()
    run = builder.build(other, SCHEMA, 9)
    assert run is not None and builder._graph is not graph
    dense, emb = _inputs(9, 20, 4)
    want = torch.sigmoid(torch_forward(other)(dense, emb))
    assert float((torch.sigmoid(run(dense, emb)) - want).abs().max()) <= TOLERANCE


def test_the_engine_serves_on_onnx_runtime_and_scores_like_pytorch(live_run):
    """A served version runs its network on ONNX Runtime (so the live tests, which
    compare the server with `terarec predict`, exercise it), with PyTorch's scores."""
    from terarec.serving.engine import ServingEngine

    engines = [ServingEngine(live_run.export, onnx=onnx) for onnx in (True, False)]
    try:
        for engine in engines:
            engine.refresh()
        fast, plain = (e.served() for e in engines)
        runtime = [v.logits.__qualname__.split(".")[0] for v in (fast, plain)]
        assert runtime == ["_Graph", "torch_forward"]
        context, candidates = {}, live_run.records[:200]
        got, _ = engines[0].score_records(candidates, context)
        want, _ = engines[1].score_records(candidates, context)
        assert abs(got - want).max() <= 1e-5
    finally:
        for engine in engines:
            engine.close()


def test_dssm_runs_on_onnx_runtime_without_a_warning(caplog):
    """DSSM's forward has a keyword-only option (``towers``): its export failed with a
    TypeError logged for every version, which then ran on PyTorch."""
    config = ModelConfig(name="dssm", embedding_dim=8, deep_mlp=(16,),
                         user_fields=("C1", "C2"))
    torch.manual_seed(0)
    first, second = (build_model(SCHEMA, config).eval() for _ in range(2))
    builder = OnnxForwards(threads=1)
    with caplog.at_level("DEBUG", logger="terarec.serving.dense"):
        runs = [builder.build(m, SCHEMA, m.row_dim) for m in (first, second)]
    assert not [r for r in caplog.records if r.levelname == "WARNING"], caplog.text
    assert runs[0] is not None and runs[1] is not None
    dense, emb = _inputs(first.row_dim, 64, 5)
    for model, run in zip((first, second), runs, strict=True):
        want = torch.sigmoid(torch_forward(model)(dense, emb))
        assert float((torch.sigmoid(run(dense, emb)) - want).abs().max()) <= TOLERANCE
    assert float((runs[0](dense, emb) - runs[1](dense, emb)).abs().max()) > 1e-4
