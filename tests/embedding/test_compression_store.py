"""Compressed store rows: precision round trips, variable-length rows, promotion."""

import numpy as np
import pytest
import torch

from terarec.config import ModelConfig, SparseOptimizerConfig, StoreConfig, TrainConfig
from terarec.embedding.compression import CodedRows, FrequencyClasses, class_precision
from terarec.embedding.optimizers import SparseOptimizer
from terarec.embedding.quant import row_bytes
from terarec.embedding.store import MemoryStore
from terarec.embedding.types import RowBlock
from terarec.embedding.working_set import WorkingSet
from terarec.train.trainer import Trainer
from terarec.types import Batch, FeatureSchema, FieldSpec, KeyedIds

DIM = 16


def make_store(dim=DIM, optimizer="adagrad", **cfg) -> MemoryStore:
    return MemoryStore(dim, SparseOptimizer(SparseOptimizerConfig(name=optimizer)),
                       StoreConfig(**cfg), seed=1)


def counts(n, value=1.0):
    return np.full(n, value, np.float32)


def spread_rows(n, dim, seed=0):
    """Rows of very different scales and offsets, as a trained table has."""
    rng = np.random.default_rng(seed)
    scale = np.exp(rng.uniform(np.log(1e-3), np.log(2.0), (n, 1)))
    return (rng.normal(size=(n, dim)) * scale + rng.normal(size=(n, 1)) * scale).astype(
        np.float32)


# -- precision ------------------------------------------------------------------------------
@pytest.mark.parametrize("precision", ["fp32", "fp16", "int8", "int4"])
def test_store_round_trip_error_is_within_the_precision_bound(precision):
    s = make_store(precision=precision)
    keys = np.arange(1, 401, dtype=np.int64)
    s.pull(keys, counts(400), counts(400, 0), pass_id=0)
    values = spread_rows(400, DIM)
    s.push(keys, RowBlock(values, np.ones((400, 1), np.float32)))
    back, found = s.lookup(keys)
    assert found.all()
    err = np.abs(back - values)
    if precision == "fp32":
        np.testing.assert_array_equal(back, values)
    elif precision == "fp16":
        assert (err <= np.abs(values) * 2.0**-11 + 2.0**-25).all()
    else:
        levels = {"int8": 255, "int4": 15}[precision]
        step = (values.max(1, keepdims=True) - values.min(1, keepdims=True)) / levels
        assert (err <= step * 0.5 * (1 + 2.0**-9) + 1e-7).all()
        assert err.max() > 0  # really quantized
    # the rows the working set trains on are the decoded rows, and state stays fp32
    block, _ = s.pull(keys, counts(400), counts(400, 0), pass_id=1)
    np.testing.assert_array_equal(block.values, back)
    assert block.state.dtype == np.float32 and (block.state == 1).all()
    assert s.stats().value_bytes == 400 * row_bytes(precision, DIM)


def test_stored_bytes_per_key_shrink_with_precision():
    per_key = {}
    for precision in ("fp32", "fp16", "int8", "int4"):
        s = make_store(dim=64, precision=precision)
        s.pull(np.arange(100, dtype=np.int64), counts(100), counts(100, 0), 0)
        per_key[precision] = s.stats().value_bytes / len(s)
    assert per_key == {"fp32": 256, "fp16": 128, "int8": 72, "int4": 38}
    big = make_store(dim=64)
    small = make_store(dim=64, precision="int4")
    for st in (big, small):
        st.pull(np.arange(100, dtype=np.int64), counts(100), counts(100, 0), 0)
    assert big.nbytes - small.nbytes == 100 * (256 - 38)


def test_stochastic_rounding_is_unbiased_on_write_back():
    s = make_store(dim=8, precision="int4", stochastic_rounding=True)
    keys = np.arange(2000, dtype=np.int64)
    s.pull(keys, counts(2000), counts(2000, 0), 0)
    row = np.array([0.0, 0.31, 0.5, 1.5, 0, 0, 0, 0], np.float32)  # int4 step 0.1
    s.push(keys, RowBlock(np.tile(row, (2000, 1)), np.zeros((2000, 1), np.float32)))
    back, _ = s.lookup(keys)
    assert set(np.round(back[:, 1].astype(float), 3).tolist()) == {0.3, 0.4}
    assert abs(back[:, 1].mean() - 0.31) < 0.005
    nearest = make_store(dim=8, precision="int4")
    nearest.pull(keys[:1], counts(1), counts(1, 0), 0)
    nearest.push(keys[:1], RowBlock(row[None], np.zeros((1, 1), np.float32)))
    assert abs(nearest.lookup(keys[:1])[0][0, 1] - 0.3) < 1e-3


def test_store_rejects_export_only_precisions():
    with pytest.raises(ValueError, match="export only"):
        make_store(precision="int2")


# -- variable-length rows -------------------------------------------------------------------
def test_frequency_classes_follow_show_counts():
    classes = FrequencyClasses((1, 4, 16), (10, 100))
    assert classes.classify(np.array([0, 9.5, 10, 99, 100, 1e6])).tolist() == [0, 0, 1, 1, 2, 2]
    with pytest.raises(ValueError, match="thresholds"):
        FrequencyClasses((1, 4, 16), (10,))
    with pytest.raises(ValueError, match="ascending"):
        FrequencyClasses((4, 1, 16), (10, 100))
    with pytest.raises(ValueError, match="below the row width"):
        FrequencyClasses.from_config(8, (1, 8), (3, 5))


def test_narrow_classes_fall_back_to_fp16_where_it_is_no_larger():
    assert class_precision("int8", 1) == "fp16" and class_precision("int8", 8) == "fp16"
    assert class_precision("int8", 9) == "int8" and class_precision("int4", 4) == "fp16"
    assert class_precision("int4", 5) == "int4" and class_precision("fp32", 1) == "fp32"


def test_rare_keys_store_short_rows_and_are_charged_their_short_width():
    s = make_store(precision="int8", variable_dims=(1, 4), promote_at=(3, 10))
    keys = np.array([1, 2, 3], np.int64)
    block, _ = s.pull(keys, np.array([1, 5, 20], np.float32), counts(3, 0), 0)
    assert block.widths.tolist() == [1, 4, 16]
    # new rows are the initial rows cut to their width
    assert (block.values[0, 1:] == 0).all() and block.values[0, 0] != 0
    assert (block.values[1, 4:] == 0).all() and (block.values[2] != 0).all()
    s.push(keys, RowBlock(np.ones((3, DIM), np.float32), block.state))
    back, _ = s.lookup(keys)
    assert back.sum(axis=1).tolist() == [1, 4, 16]  # columns past the width are dropped
    expected = row_bytes("fp16", 1) + row_bytes("fp16", 4) + row_bytes("int8", DIM)
    assert s.stats().value_bytes == expected
    assert s.values.class_counts(s.index.items()[1]).tolist() == [1, 1, 1]


def test_promotion_keeps_the_row_and_opens_zero_columns():
    s = make_store(variable_dims=(2,), promote_at=(5,))
    key = np.array([7], np.int64)
    block, _ = s.pull(key, counts(1, 2), counts(1, 0), 0)
    assert block.widths.tolist() == [2]
    trained = np.zeros((1, DIM), np.float32)
    trained[0, :2] = [0.25, -0.5]
    s.push(key, RowBlock(trained, block.state))
    block, _ = s.pull(key, counts(1, 3), counts(1, 0), 1)  # 5 shows: promoted
    assert block.widths.tolist() == [DIM]
    np.testing.assert_array_equal(block.values, trained)
    np.testing.assert_array_equal(s.lookup(key)[0], trained)
    assert s.stats().value_bytes == 4 * DIM


def test_evicted_rows_free_their_pool_positions():
    s = make_store(precision="int8", variable_dims=(1,), promote_at=(2,), evict_after_passes=1)
    for p in range(5):
        keys = np.arange(p * 100, p * 100 + 100, dtype=np.int64)
        s.pull(keys, counts(100), counts(100, 0), p)
        s.end_pass(p)
    assert len(s) == 100 and s.values.pools[0].used == 100
    assert len(s.values.pools[0].codes) <= 256  # positions were reused, not appended


def test_arrays_round_trip_keeps_classes_and_values():
    s = make_store(precision="int4", variable_dims=(1, 4), promote_at=(3, 10))
    keys = np.arange(1, 61, dtype=np.int64)
    s.pull(keys, np.repeat(np.array([1, 5, 20], np.float32), 20), counts(60, 0), 0)
    arrays = s.to_arrays()
    restored = make_store(precision="int4", variable_dims=(1, 4), promote_at=(3, 10))
    restored.load_arrays(arrays)
    # checkpoints hold decoded rows; re-encoding them moves a value by at most one step
    saved, back = s.lookup(keys)[0], restored.lookup(keys)[0]
    step = (saved.max(1, keepdims=True) - saved.min(1, keepdims=True)) / 15
    assert (np.abs(back - saved) <= step * 1.01 + 1e-7).all()
    assert np.mean(back == saved) > 0.9
    assert restored.stats().value_bytes == s.stats().value_bytes
    np.testing.assert_array_equal(restored.values.widths_of(restored.index.lookup(keys)),
                                  s.values.widths_of(s.index.lookup(keys)))


def test_coded_rows_assign_unplaced_rows_to_the_narrowest_class_that_holds_them():
    rows = CodedRows(8, "fp32", classes=FrequencyClasses((1, 4, 8), (2, 3)), capacity=4)
    values = np.zeros((3, 8), np.float32)
    values[0, 0], values[1, 3], values[2, 7] = 1, 2, 3
    rows[np.arange(3)] = values
    assert rows.widths_of(np.arange(3)).tolist() == [1, 4, 8]
    np.testing.assert_array_equal(rows[np.arange(3)], values)


# -- training with variable-length rows -----------------------------------------------------
SCHEMA = FeatureSchema(label="y", fields=(FieldSpec("a", "categorical"),
                                          FieldSpec("b", "categorical")), missing_flags=False)


def batch(ids, labels):
    ids = torch.tensor(ids, dtype=torch.int64)
    return Batch(torch.zeros(len(ids), 0), KeyedIds.from_dense(("a", "b"), ids),
                 torch.tensor(labels, dtype=torch.float32))


def test_training_leaves_the_columns_past_a_short_row_at_zero():
    s = make_store(dim=4, variable_dims=(1,), promote_at=(4,), optimizer="adam")
    batches = [batch([[1, 2], [1, 3], [1, 4]], [1, 0, 1])]  # key 1 seen 3 times: still rare
    ws = WorkingSet.stage(s, batches, pass_id=0)
    anchor = torch.zeros((), requires_grad=True)
    emb = ws.lookup(ws.batches[0].sparse, anchor=anchor)
    (emb * torch.arange(1.0, 5.0)).sum().backward()
    assert (ws.weights[1:, 1:] == 0).all() and (ws.weights[1:, 0] != 0).all()


def test_promotion_leaves_predictions_unchanged_at_that_moment():
    config = TrainConfig(batch_size=4, pass_rows=8, seed=0,
                         model=ModelConfig(name="deepfm", embedding_dim=4, deep_mlp=(8,)),
                         sparse_optimizer=SparseOptimizerConfig(lr=0.1),
                         store=StoreConfig(precision="int8", variable_dims=(1, 2),
                                           promote_at=(5, 9)))
    trainer = Trainer(SCHEMA, config)
    rng = np.random.default_rng(0)
    for _ in range(4):  # keys 0..3 collect 2 shows per pass; 4.. are new each pass
        ids = np.stack([rng.integers(0, 4, 8), rng.integers(100, 10**6, 8)], axis=1)
        trainer.train_pass(trainer.plan([batch(ids, rng.integers(0, 2, 8).astype(float))]))
    probe = [batch([[k, k] for k in range(4)], [0, 0, 0, 1])]  # known keys only
    before = trainer.predict_batches(probe)
    widths_before = trainer.store.values.widths_of(trainer.store.index.lookup(np.arange(4)))
    # one more pass promotes keys: stage it, score before any update
    ws = WorkingSet.stage(trainer.store, probe, trainer.pass_id, train=True)
    widths_after = trainer.store.values.widths_of(trainer.store.index.lookup(np.arange(4)))
    assert (widths_after > widths_before).any()
    trainer.model.eval()
    with torch.no_grad():
        staged = ws.batches[0]
        emb = ws.lookup(staged.sparse, trainer.mean_fields, None)
        at_promotion = torch.sigmoid(trainer.model(staged.dense, emb)).numpy()
    np.testing.assert_allclose(at_promotion, before, rtol=0, atol=1e-7)


def test_tiered_store_keeps_compressed_rows_and_refuses_export_only_codes(tmp_path):
    from terarec.embedding.tiered import TieredStore

    opt = SparseOptimizer(SparseOptimizerConfig())
    store = TieredStore(DIM, opt, StoreConfig(precision="int8", disk_path=str(tmp_path / "s")))
    assert store.layout.precisions == ("int8",)
    with pytest.raises(ValueError, match="export only"):
        TieredStore(DIM, opt, StoreConfig(precision="int2", disk_path=str(tmp_path / "t")))
