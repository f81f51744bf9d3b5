"""An HNSW graph over item vectors with exact twins (a trained item tower gives every
item it never saw the same vector, hundreds alike): the graph holds each distinct vector
once and a search answers all items of each vector found, as exact search ranks them."""

from __future__ import annotations

import numpy as np
import pytest

faiss = pytest.importorskip("faiss")

from terarec.retrieval.index import (  # noqa: E402
    IndexOptions,
    ItemIndex,
    _updated_reps,
    index_vectors,
    item_index,
)

K = 100


def _unit(x: np.ndarray) -> np.ndarray:
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def _catalog(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """100 vectors shared by 150 items each (more twins than a graph node has
    neighbours), then 3,000 items of their own; 50 queries."""
    rng = np.random.default_rng(seed)
    topics = _unit(rng.standard_normal((100, 16)))
    twins = np.repeat(topics, 150, axis=0)
    own = _unit(topics[rng.integers(0, 100, 3000)] + 0.3 * rng.standard_normal((3000, 16)))
    vectors = np.concatenate([twins, own])[rng.permutation(18_000)]
    queries = _unit(topics[rng.integers(0, 100, 50)] + 0.5 * rng.standard_normal((50, 16)))
    return np.ascontiguousarray(vectors), queries


def _recall(found: np.ndarray, vectors: np.ndarray, queries: np.ndarray) -> float:
    """Share of the found items scoring at least the exact k-th score (ties are right)."""
    kth = np.sort(queries @ vectors.T, axis=1)[:, -K][:, None] - 1e-5
    scores = np.einsum("qkd,qd->qk", vectors[np.maximum(found, 0)], queries)
    return float(((scores >= kth) & (found >= 0)).mean())


def test_a_graph_holds_each_vector_once_and_answers_every_twin():
    vectors, queries = _catalog()
    options = IndexOptions(kind="hnsw")
    index, reps = index_vectors(vectors, options)
    distinct = len(np.unique(vectors, axis=0))
    assert index.ntotal == distinct == 100 + 3000
    assert np.array_equal(vectors[reps], vectors)  # each item's graph id has its vector
    searcher = item_index(index, vectors, options, reps)
    assert searcher._params is None  # twins never added are not vectors to filter out
    found, scores = searcher.search(queries, K)
    assert found.shape == (50, K) and (found >= 0).all()
    assert all(len(set(row)) == K for row in found)  # every item once
    assert np.allclose(scores, np.einsum("qkd,qd->qk", vectors[found], queries), atol=1e-5)
    assert (np.diff(scores, axis=1) <= 1e-6).all()  # best first
    assert _recall(found, vectors, queries) >= 0.95


def test_every_vector_in_a_graph_loses_the_twins():
    """What the graph did with every vector added: cliques of exact twins, which the
    search does not leave (the reason each vector is added once)."""
    vectors, queries = _catalog()
    graph = faiss.IndexHNSWFlat(16, 32, faiss.METRIC_INNER_PRODUCT)
    graph.hnsw.efConstruction, graph.hnsw.efSearch = 80, 256
    graph.add(vectors)
    _, found = graph.search(queries, K)
    assert _recall(found, vectors, queries) < 0.9


def test_an_update_joins_a_changed_item_to_its_twins_or_adds_its_vector():
    vectors, queries = _catalog(seed=1)
    options = IndexOptions(kind="hnsw")
    index, reps = index_vectors(vectors, options)
    old = item_index(index, vectors, options, reps)
    rng = np.random.default_rng(2)
    stale = np.sort(rng.choice(len(vectors), 60, replace=False))
    changed = vectors.copy()
    fresh = _unit(rng.standard_normal((10, 16)))
    changed[stale[:20]] = vectors[rng.integers(0, len(vectors), 20)]  # another's vector
    changed[stale[20:40]] = np.repeat(fresh, 2, axis=0)  # new vectors, two items each
    changed[stale[40:]] = _unit(rng.standard_normal((20, 16)))  # new, one item each
    first = len(vectors)
    new_slots = np.arange(first, first + len(stale), dtype=np.int64)
    new_reps = _updated_reps(old, changed, stale, new_slots)
    slots = np.arange(len(vectors), dtype=np.int64)
    slots[stale] = new_slots
    added = new_reps[stale] == new_slots
    assert added.sum() == 10 + 20 + (new_reps[stale[:20]] == new_slots[:20]).sum()
    index.add_with_ids(changed[stale[added]], new_slots[added])
    after = ItemIndex(old.folder, index, old.ids, old.keys, slots, changed,
                      {**old.meta, "next_slot": first + len(stale)}, new_reps)
    slot_vectors = np.zeros((first + len(stale), 16), np.float32)
    slot_vectors[slots] = changed
    assert np.array_equal(slot_vectors[new_reps], changed)  # ids hold the items' vectors
    found, _ = after.search(np.concatenate([queries, changed[stale]]), K)
    assert all(len(set(row)) == K for row in found)
    assert _recall(found, changed, np.concatenate([queries, changed[stale]])) >= 0.95


def test_a_large_k_on_a_small_catalog_probes_enough_lists() -> None:
    """IVF-PQ probes ``nprobe`` of its lists; asked for more than those lists hold on
    average, it probes more, so the answer is not short of what the catalog holds."""
    vectors = _unit(np.random.default_rng(3).standard_normal((2_000, 16)))
    options = IndexOptions(kind="ivfpq", nlist=40, nprobe=2, refine=2)
    index, reps = index_vectors(vectors, options)
    searcher = item_index(index, vectors, options, reps)
    items, _ = searcher.search(vectors[:3], 1_500)
    assert (items >= 0).sum(axis=1).min() == 1_500  # 2 of 40 lists hold about 100
    assert all(len(set(row)) == 1_500 for row in items.tolist())
    few, _ = searcher.search(vectors[:3], 10)  # a small k keeps the configured probes
    assert (few >= 0).all()
