import numpy as np
import torch

from terarec.config import SparseOptimizerConfig, StoreConfig
from terarec.embedding.optimizers import SparseOptimizer
from terarec.embedding.store import MemoryStore
from terarec.embedding.working_set import WorkingSet
from terarec.types import Batch, FeatureSchema, FieldSpec, KeyedIds


def make_store(min_count=1, lr=0.1):
    return MemoryStore(3, SparseOptimizer(SparseOptimizerConfig(name="sgd", lr=lr)),
                       StoreConfig(admit_min_count=min_count), seed=0)


def dense_batch(ids, labels):
    ids = torch.tensor(ids)
    return Batch(torch.zeros(len(ids), 1), KeyedIds.from_dense(("a", "b"), ids),
                 torch.tensor(labels, dtype=torch.float32))


def test_stage_remaps_to_local_rows_and_counts_clicks():
    store = make_store()
    batches = [dense_batch([[7, 9], [3, 9]], [1, 0]), dense_batch([[7, 5]], [1])]
    ws = WorkingSet.stage(store, batches, pass_id=0)
    assert ws.stats.unique_keys == 4 and ws.weights.shape == (5, 3)
    assert not ws.weights[0].any()
    for orig, staged in zip(batches, ws.batches, strict=True):
        local = staged.sparse.values
        torch.testing.assert_close(ws.weights[local],
                                   torch.from_numpy(store.lookup(orig.sparse.values.numpy())[0]))
    arrays = store.to_arrays()
    counts = dict(zip(arrays["keys"].tolist(), zip(arrays["show"], arrays["click"], strict=True),
                      strict=True))
    assert counts[7] == (2, 2) and counts[9] == (2, 1) and counts[3] == (1, 0)


def test_unadmitted_keys_use_the_frozen_zero_row():
    store = make_store(min_count=2)
    batches = [dense_batch([[1, 2], [1, 3]], [1, 0])]
    ws = WorkingSet.stage(store, batches, pass_id=0)
    sample_major = ws.batches[0].sparse.sample_major
    assert sample_major[0, 1] == 0 and sample_major[1, 1] == 0  # keys 2, 3 seen once
    assert sample_major[0, 0] == sample_major[1, 0] != 0  # key 1 seen twice: admitted
    anchor = torch.zeros((), requires_grad=True)
    emb = ws.lookup(ws.batches[0].sparse, anchor=anchor)
    emb.sum().backward()
    assert not ws.weights[0].any()


def test_fused_backward_applies_summed_gradients_then_writes_back():
    store = make_store(lr=0.5)
    batch = dense_batch([[1, 2], [1, 3]], [1, 0])
    ws = WorkingSet.stage(store, [batch], pass_id=0)
    before = {k: store.lookup(np.array([k]))[0][0].copy() for k in (1, 2, 3)}
    anchor = torch.zeros((), requires_grad=True)
    emb = ws.lookup(ws.batches[0].sparse, anchor=anchor)
    weights = torch.tensor([1.0, 2.0, 3.0])
    (emb * weights).sum().backward()  # d/d row = weights, key 1 appears twice
    ws.write_back(store)
    after = {k: store.lookup(np.array([k]))[0][0] for k in (1, 2, 3)}
    np.testing.assert_allclose(after[1], before[1] - 0.5 * 2 * weights.numpy(), rtol=1e-6)
    np.testing.assert_allclose(after[2], before[2] - 0.5 * weights.numpy(), rtol=1e-6)


def test_multi_valued_mean_pooling_and_its_gradient():
    store = make_store(lr=1.0)
    # field a: sample0 -> [4, 5], sample1 -> []; field b: sample0 -> [6], sample1 -> [6]
    sparse = KeyedIds.from_lengths(("a", "b"), torch.tensor([4, 5, 6, 6]),
                                   torch.tensor([2, 0, 1, 1]))
    batch = Batch(torch.zeros(2, 1), sparse, torch.tensor([0.0, 1.0]))
    ws = WorkingSet.stage(store, [batch], pass_id=0)
    rows = {k: torch.from_numpy(store.lookup(np.array([k]))[0][0]) for k in (4, 5, 6)}
    mean_fields = torch.tensor([True, False])
    anchor = torch.zeros((), requires_grad=True)
    emb = ws.lookup(ws.batches[0].sparse, mean_fields, anchor=anchor)
    torch.testing.assert_close(emb[0, 0], (rows[4] + rows[5]) / 2)
    assert not emb[1, 0].any()
    torch.testing.assert_close(emb[1, 1], rows[6])
    emb.sum().backward()
    ws.write_back(store)
    new4 = store.lookup(np.array([4]))[0][0]
    new6 = store.lookup(np.array([6]))[0][0]
    np.testing.assert_allclose(new4, rows[4].numpy() - 0.5, rtol=1e-6)
    np.testing.assert_allclose(new6, rows[6].numpy() - 2.0, rtol=1e-6)


def test_eval_staging_leaves_the_store_untouched():
    store = make_store()
    WorkingSet.stage(store, [dense_batch([[1, 2]], [1])], pass_id=0)
    before = store.to_arrays()
    ws = WorkingSet.stage(store, [dense_batch([[1, 99]], [1])], pass_id=1, train=False)
    assert ws.stats.admitted_keys == 1 and not ws.trainable
    after = store.to_arrays()
    for name in before:
        np.testing.assert_array_equal(before[name], after[name])
    assert FeatureSchema(label="y", fields=(FieldSpec("a", "categorical"),)).dense_dim == 0
