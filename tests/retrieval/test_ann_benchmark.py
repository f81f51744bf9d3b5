"""The retrieval benchmark's ANN mode: both index kinds' recall / speed curves against
exact search over the same vectors, on a small planted catalog."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("faiss")

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "retrieval.py"
_spec = importlib.util.spec_from_file_location("retrieval_benchmark", _PATH)
assert _spec is not None and _spec.loader is not None
bench = importlib.util.module_from_spec(_spec)
sys.modules["retrieval_benchmark"] = bench
_spec.loader.exec_module(bench)


@pytest.fixture(scope="module")
def planted():
    vectors, queries = bench.planted_vectors(4000, 100, 16, seed=0)
    exact = bench.exact_baseline(vectors, queries, batch=50, single_queries=20, threads=1)
    return vectors, queries, exact


def test_planted_vectors_are_unit_and_clustered(planted):
    vectors, queries, exact = planted
    assert vectors.shape == (4000, 16) and queries.shape == (100, 16)
    assert np.allclose(np.linalg.norm(vectors, axis=1), 1, atol=1e-5)
    # each query's exact top-100 scores far above a random item's: there are clusters
    assert exact["scores"][:, -1].mean() > (vectors[:100] @ queries.T).mean() + 0.3
    assert exact["ids"].shape == (100, 100) and exact["qps_batched"] > 0


@pytest.mark.parametrize(("kind", "settings", "key"), [
    ("hnsw", ["100", "400"], "ef_search"),
    ("ivfpq", ["1x1", "4x4", "64x16"], "nprobe"),
])
def test_curve_recall_rises_with_the_search_setting(planted, kind, settings, key):
    vectors, queries, exact = planted
    out = bench.ann_curve(vectors, queries, kind, settings, exact, batch=50,
                          single_queries=20, threads=1)
    for name in (f"{kind}_build_s", f"{kind}_bytes", f"{kind}_curve", f"{kind}_at_095",
                 f"{kind}_speedup_at_095"):
        assert name in out
    assert out[f"{kind}_bytes"] > 0
    curve = out[f"{kind}_curve"]
    assert [p[key] for p in curve] == [int(s.split("x")[0]) for s in settings]
    recall = [p["recall_at_100"] for p in curve]
    assert all(0 <= r <= 1 for r in recall)
    assert recall[-1] >= recall[0] - 0.01 and recall[-1] >= 0.95
    assert all(p["qps_batched"] > 0 and p["qps_single"] > 0 for p in curve)
    met = out[f"{kind}_at_095"]
    assert met == next(p for p in curve if p["recall_at_100"] >= 0.95)
    assert set(out[f"{kind}_speedup_at_095"]) == {"batched", "single"}


def test_ivfpq_one_probe_without_refine_misses_neighbours(planted):
    """The curve measures something: the cheapest IVF-PQ setting loses recall."""
    vectors, queries, exact = planted
    out = bench.ann_curve(vectors, queries, "ivfpq", ["1x1"], exact, batch=50,
                          single_queries=5, threads=1)
    assert out["ivfpq_curve"][0]["recall_at_100"] < 0.9
    assert out["ivfpq_at_095"] is None and out["ivfpq_speedup_at_095"] is None
