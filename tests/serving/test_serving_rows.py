"""Row sources of a served version against a plain dict model, and the bounded cache."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from terarec.export.format import mappings_of, memmap_tensors, rows_bytes
from terarec.export.reader import check_rows
from terarec.serving.rows import RowCache, ShardedRows, VersionRows

DIM = 3


def _rows(keys) -> np.ndarray:
    keys = np.asarray(keys, np.int64)
    return np.stack([keys * 1.0, -keys * 1.0, keys % 7 * 1.0], 1).astype(np.float32)


def _sharded(keys, per_shard: int) -> ShardedRows:
    keys = np.unique(np.asarray(keys, np.int64))
    shards = [(keys[i:i + per_shard], _rows(keys[i:i + per_shard]))
              for i in range(0, len(keys), per_shard)]
    return ShardedRows(shards, DIM)


keys_st = st.lists(st.integers(-2**62, 2**62), max_size=60)


@settings(max_examples=60, deadline=None)
@given(base=keys_st, deltas=st.lists(st.tuples(keys_st, keys_st), max_size=4),
       probe=keys_st, per_shard=st.integers(1, 7))
def test_version_rows_match_a_dict_model(base, deltas, probe, per_shard):
    model = {k: _rows([k])[0] for k in base}
    rows = VersionRows(_sharded(base, per_shard))
    for step, (upserts, deleted) in enumerate(deltas):
        up = np.unique(np.asarray(upserts, np.int64))
        values = _rows(up) + step + 1
        gone = np.unique(np.asarray(deleted, np.int64))
        rows = rows.with_delta(up, values, gone)
        for k in gone.tolist():  # deletions first, then upserts
            model.pop(k, None)
        model.update(zip(up.tolist(), values, strict=True))
    probe = np.asarray(probe + base, np.int64)
    got, found = rows.lookup(probe)
    for k, row, f in zip(probe.tolist(), got, found, strict=True):
        assert f == (k in model)
        np.testing.assert_array_equal(row, model.get(k, np.zeros(DIM, np.float32)))


def test_shards_read_through_memory_maps(tmp_path):
    keys = np.array([-5, 3, 9, 10, 42], np.int64)
    path = tmp_path / "shard.safetensors"
    path.write_bytes(rows_bytes(keys, _rows(keys)))
    t = memmap_tensors(path)
    assert not t["values"].flags.owndata and not t["values"].flags.writeable
    assert len(mappings_of(t["keys"], t["values"])) == 1  # one map of the whole file
    rows = ShardedRows([(t["keys"], t["values"])], DIM)
    got, found = rows.lookup(np.array([42, 4, -5], np.int64))
    np.testing.assert_array_equal(found, [True, False, True])
    np.testing.assert_array_equal(got, np.stack([_rows([42])[0], np.zeros(DIM), _rows([-5])[0]]))


def test_cache_stays_bounded_and_keeps_what_it_holds_correct():
    cache = RowCache(capacity=50, row_dim=DIM)
    rng = np.random.default_rng(0)
    for _ in range(40):
        keys = np.unique(rng.integers(0, 400, 120))
        slots, hit = cache.get(keys)
        np.testing.assert_array_equal(cache.values[slots[hit]], _rows(keys[hit]))
        cache.put(keys[~hit], _rows(keys[~hit]))
        assert len(cache) <= 50
    assert len(cache) == 50


def test_cache_keeps_hot_keys_over_one_off_keys():
    cache = RowCache(capacity=20, row_dim=DIM)
    hot = np.arange(10, dtype=np.int64)
    cache.put(hot, _rows(hot))
    for start in range(100, 1000, 10):
        cache.get(hot)  # hot keys are used between every burst of one-off keys
        cold = np.arange(start, start + 10, dtype=np.int64)
        _, hit = cache.get(cold)
        cache.put(cold[~hit], _rows(cold[~hit]))
    _, hit = cache.get(hot)
    assert hit.all()


def test_cache_refresh_rewrites_only_cached_keys():
    cache = RowCache(capacity=10, row_dim=DIM)
    cache.put(np.array([1, 2, 3]), _rows([1, 2, 3]))
    n = cache.refresh(np.array([2, 99]), np.full((2, DIM), 7.0, np.float32))
    assert n == 1
    slots, hit = cache.get(np.array([1, 2, 99]))
    np.testing.assert_array_equal(hit, [True, True, False])
    np.testing.assert_array_equal(cache.values[slots[1]], np.full(DIM, 7.0))
    np.testing.assert_array_equal(cache.values[slots[0]], _rows([1])[0])


def _mapped_file_bytes() -> int:
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) * 1024 for line in fh if line.startswith("RssFile:"))


def test_load_check_leaves_no_shard_pages_resident(tmp_path):
    """Checking a version reads every row once; the pages it mapped must not stay in the
    server's resident set (a 10 GB export would otherwise count 10 GB there)."""
    keys = np.arange(200_000, dtype=np.int64)
    values = np.ones((len(keys), 64), np.float32)  # 51 MB
    path = tmp_path / "shard.safetensors"
    path.write_bytes(rows_bytes(keys, values))
    t = memmap_tensors(path)
    before = _mapped_file_bytes()
    check_rows(str(path), t["keys"], t["values"])
    assert _mapped_file_bytes() - before < 16 << 20
    assert t["values"][123_456].sum() == 64  # still readable: the pages come back
