"""Key ownership and the round-robin deal of input rows (no process group needed)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from terarec.data.readers import ReadStats, iter_batches
from terarec.distributed.lookup import plan_rank_pass
from terarec.distributed.sharding import (
    deal_batches,
    iter_rank_passes,
    local_batch_size,
)
from terarec.embedding.working_set import plan_pass
from terarec.kernels import shard_of
from terarec.train.passes import group_passes, iter_file_batches
from terarec.types import Batch, FeatureSchema


def test_shard_of_is_deterministic_and_in_range():
    keys = np.random.default_rng(0).integers(-(2**63), 2**63 - 1, 10_000, dtype=np.int64)
    owners = shard_of(keys, 3)
    assert owners.dtype == np.int64
    assert set(np.unique(owners)) == {0, 1, 2}
    assert np.array_equal(owners, shard_of(keys.copy(), 3))
    assert np.all(shard_of(keys, 1) == 0)


def test_shard_of_balances_sequential_and_strided_keys():
    # key % world would put every key with stride 4 on one of 4 ranks.
    for keys in (np.arange(100_000, dtype=np.int64), np.arange(0, 400_000, 4, dtype=np.int64)):
        counts = np.bincount(shard_of(keys, 4), minlength=4)
        assert counts.min() > 0.95 * len(keys) / 4


def test_shard_of_is_independent_of_the_store_index_bucket_bits():
    # The key index buckets by the low bits of splitmix64(key); a rank's keys must still
    # use every bucket parity, or that rank's index would probe twice as far.
    from terarec.embedding.index import _mix

    keys = np.arange(50_000, dtype=np.int64)
    low_bit = np.array([int(_mix(k)) & 1 for k in keys[:5000]])
    mine = shard_of(keys[:5000], 2) == 0
    assert 0.45 < low_bit[mine].mean() < 0.55


def test_shard_of_rejects_bad_world():
    with pytest.raises(ValueError, match="world size"):
        shard_of(np.arange(3, dtype=np.int64), 0)


def test_local_batch_size_needs_a_multiple_of_world():
    assert local_batch_size(512, 2) == 256
    with pytest.raises(ValueError, match="not a multiple of the 3 ranks"):
        local_batch_size(512, 3)


@pytest.fixture(scope="module")
def csv_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "rows.csv"
    rng = np.random.default_rng(1)
    lines = ["label,x,a,b"]
    for i in range(1000):
        lines.append(f"{int(rng.random() < 0.3)},{rng.random():.4f},a{rng.integers(50)},"
                     f"b{i % 7}")
    path.write_text("\n".join(lines) + "\n")
    return path


def _schema() -> FeatureSchema:
    from terarec.data.readers import csv_schema

    return csv_schema("label", ["x"], ["a", "b"])


def _assert_same_rows(a: Batch, b: Batch) -> None:
    assert torch.equal(a.labels, b.labels)
    assert torch.equal(a.dense, b.dense)
    assert torch.equal(a.sparse.values, b.sparse.values)
    assert torch.equal(a.sparse.offsets, b.sparse.offsets)


@pytest.mark.parametrize("world", [2, 3])
def test_rank_passes_union_is_the_single_process_run(csv_file, world):
    schema = _schema()
    batch_size, pass_rows = 48 * world, 200
    files = [csv_file, csv_file]  # a pass may span files; a batch never does
    single = list(group_passes(iter_file_batches(files, schema, batch_size), pass_rows))
    per_rank = [list(iter_rank_passes(files, schema, batch_size, pass_rows, r, world))
                for r in range(world)]
    for rank_passes in per_rank:
        assert [len(p) for p in rank_passes] == [len(p) for p in single]
    for i, single_pass in enumerate(single):
        for s, global_batch in enumerate(single_pass):
            parts = [per_rank[r][i][s] for r in range(world) if len(per_rank[r][i][s])]
            _assert_same_rows(Batch.concat(parts), global_batch)
    # 1000 rows = 21 local batches of 48 (the last of 40): at world 2 the file's last step
    # has one local batch, so rank 1 trains an empty batch there; at world 3 none does.
    has_empty = any(len(b) == 0 for r in range(world) for p in per_rank[r] for b in p)
    assert has_empty == (21 % world != 0)


def test_deal_batches_pads_every_rank_to_the_same_number_of_steps(csv_file):
    batches = list(iter_batches(csv_file, _schema(), 300))  # 300, 300, 300, 100 rows
    dealt = [deal_batches(batches, r, 3) for r in range(3)]
    assert [len(d) for d in dealt] == [2, 2, 2]
    assert [len(b) for b in dealt[0]] == [300, 100]
    assert [len(b) for b in dealt[2]] == [300, 0]
    assert deal_batches([], 0, 2) == []


@pytest.mark.parametrize("world", [2, 3])
def test_rank_plan_remaps_every_step_to_its_owner_grouped_table(csv_file, world):
    """``plan_rank_pass``: each step's table holds its distinct keys once, grouped by
    owner; the remapped ids read the original keys back; the requests name, per owner,
    positions among the keys sent to that owner; shows and clicks count the pass."""
    batches = next(iter_rank_passes([csv_file], _schema(), 120, 10_000, 1, world))
    plan = plan_rank_pass(plan_pass(batches), world)
    key_starts = np.concatenate([[0], np.cumsum(plan.key_counts)])
    assert (shard_of(plan.keys, world) == np.repeat(np.arange(world), plan.key_counts)).all()
    sent = [iter(np.split(plan.request_ids, np.cumsum(plan.request_splits.sum(axis=0))[:-1])[o]
                 .astype(np.int64)) for o in range(world)]
    cursor = np.zeros(world, np.int64)
    for step, (batch, remapped) in enumerate(zip(batches, plan.remapped, strict=True)):
        keys = batch.sparse.values.numpy()
        splits = plan.request_splits[step]
        table = []
        for o in range(world):
            ids = np.array([next(sent[o]) for _ in range(splits[o])], np.int64)
            cursor[o] += splits[o]
            table.append(plan.keys[key_starts[o] + ids])
        table = np.concatenate(table)
        assert len(np.unique(table)) == len(table) == len(np.unique(keys))
        assert np.array_equal(table[remapped.sparse.values.numpy()], keys)
        assert torch.equal(remapped.sparse.offsets, batch.sparse.offsets)
    assert (cursor == plan.request_splits.sum(axis=0)).all()
    all_keys = np.concatenate([b.sparse.values.numpy() for b in batches])
    shows = {k: c for k, c in zip(*np.unique(all_keys, return_counts=True), strict=True)}
    assert [shows[k] for k in plan.keys] == plan.counts[:, 0].tolist()


def test_rank_passes_count_every_pass_of_skipped_rows(tmp_path):
    lines = ["label,x,a,b"] + [f"{i % 2},0.5,a{i % 9},b{i % 4}" for i in range(400)]
    for i in (5, 130, 390):  # passes 0, 1 and 3 (100 rows each at batch 50 on 2 ranks)
        lines[i + 1] = "1,bad,a1,b1"
    path = tmp_path / "bad.csv"
    path.write_text("\n".join(lines) + "\n")
    stats = [ReadStats() for _ in range(2)]
    passes = [list(iter_rank_passes([path], _schema(), 50, 100, r, 2, on_bad_row="skip",
                                    stats=stats[r])) for r in range(2)]
    assert [[len(g) for g in p] for p in passes] == [[2] * 4, [2] * 4]
    assert sum(s.skipped for s in stats) == 3
    assert sum(s.rows for s in stats) == 397
    assert sum(len(b) for p in passes for g in p for b in g) == 397
