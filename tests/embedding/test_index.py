import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from terarec.embedding.index import KeyIndex, unique_inverse

int64s = st.integers(min_value=-(2**63), max_value=2**63 - 1)
ops = st.lists(st.tuples(st.sampled_from(["insert", "remove", "lookup"]),
                         st.lists(st.one_of(st.integers(-5, 40), int64s), max_size=30)),
               max_size=30)


@settings(max_examples=200, deadline=None)
@given(ops)
def test_index_matches_dict_reference(operations):
    index, ref = KeyIndex(capacity=4), {}
    for op, keys in operations:
        arr = np.array(keys, dtype=np.int64)
        if op == "insert":
            slots, inserted = index.lookup_or_insert(arr)
            for k, s, new in zip(keys, slots, inserted, strict=True):
                if k in ref:
                    assert s == ref[k]
                else:
                    assert new
                    ref[k] = int(s)
        elif op == "remove":
            removed = index.remove(arr)
            for k, s in zip(keys, removed, strict=True):
                assert s == ref.pop(k, -1)
        else:
            np.testing.assert_array_equal(index.lookup(arr), [ref.get(k, -1) for k in keys])
        # collisionless: live keys own distinct slots
        assert len(set(ref.values())) == len(ref) == len(index)
    keys, slots = index.items()
    assert dict(zip(keys.tolist(), slots.tolist(), strict=True)) == ref


def test_slots_are_recycled_and_dense():
    index = KeyIndex()
    slots, _ = index.lookup_or_insert(np.arange(100, dtype=np.int64))
    assert sorted(slots.tolist()) == list(range(100))
    index.remove(np.arange(0, 100, 2, dtype=np.int64))
    new_slots, inserted = index.lookup_or_insert(np.arange(1000, 1050, dtype=np.int64))
    assert inserted.all()
    assert index.slot_bound == 100  # every freed slot reused before a new one
    assert sorted(new_slots.tolist()) == list(range(0, 100, 2))


def test_growth_keeps_every_key():
    index = KeyIndex(capacity=16)
    keys = np.random.default_rng(0).integers(-(2**63), 2**63 - 1, 50_000, dtype=np.int64)
    slots, _ = index.lookup_or_insert(keys)
    assert index.capacity >= 2 * len(np.unique(keys))
    np.testing.assert_array_equal(index.lookup(keys), slots)


def test_from_items_restores_lookups_and_free_slots():
    index = KeyIndex()
    index.lookup_or_insert(np.arange(10, dtype=np.int64))
    index.remove(np.array([3, 7], dtype=np.int64))
    keys, slots = index.items()
    rebuilt = KeyIndex.from_items(keys, slots)
    np.testing.assert_array_equal(rebuilt.lookup(keys), slots)
    new, _ = rebuilt.lookup_or_insert(np.array([100, 101], dtype=np.int64))
    assert sorted(new.tolist()) == [3, 7]


@settings(max_examples=100, deadline=None)
@given(st.lists(st.one_of(st.integers(-3, 3), int64s), max_size=200))
def test_unique_inverse_matches_first_seen_order(keys):
    arr = np.array(keys, dtype=np.int64)
    uniq, inverse = unique_inverse(arr)
    assert uniq.tolist() == list(dict.fromkeys(keys))
    np.testing.assert_array_equal(uniq[inverse], arr)


def test_count_marked_counts_live_keys_by_their_slot_mark():
    index = KeyIndex()
    slots, _ = index.lookup_or_insert(np.arange(100, 200, dtype=np.int64))
    index.remove(np.arange(100, 110, dtype=np.int64))  # their slots no longer count
    mark = np.zeros(index.slot_bound, np.bool_)
    mark[slots[::2]] = True
    _, live = index.items()
    assert index.count_marked(mark) == int(mark[live].sum()) == 45
    assert index.count_marked(np.zeros(index.slot_bound, np.bool_)) == 0


def _longest_cluster(index: KeyIndex) -> int:
    """Longest run of occupied buckets: what a lookup of an absent key may scan."""
    occupied = np.concatenate([[0], (index._table[:, 1] != -1).astype(np.int8), [0]])
    edges = np.flatnonzero(np.diff(occupied))
    return int((edges[1::2] - edges[::2]).max()) if len(edges) else 0


def test_items_are_listed_in_slot_order():
    index = KeyIndex()
    keys = np.random.default_rng(1).integers(-2**62, 2**62, 5000)
    index.lookup_or_insert(keys)
    index.remove(keys[::3])
    listed, slots = index.items()
    assert (np.diff(slots) > 0).all()
    assert (index.lookup(listed) == slots).all()
    assert set(listed.tolist()) == set(np.delete(keys, np.s_[::3]).tolist())


def test_dropping_the_first_listed_keeps_clusters_short():
    """A cache that evicts the first listed among equal priorities (a pass's new rows
    all tie) must not pack its survivors into one part of the table: in bucket order
    the longest cluster grew past 10^5 buckets and lookups stalled."""
    rng = np.random.default_rng(0)
    index = KeyIndex()
    cap, batch = 200_000, 40_000
    for _ in range(30):
        listed, _ = index.items()
        n_out = len(listed) + batch - cap
        if n_out > 0:
            ties = np.ones(len(listed))
            index.remove(listed[np.argpartition(ties, n_out - 1)[:n_out]])
        index.lookup_or_insert(rng.integers(-2**62, 2**62, batch))
    assert len(index) == cap
    assert _longest_cluster(index) < 200
