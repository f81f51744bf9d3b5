"""Request rows -> Batch: the context-once path equals hashing every merged row."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from terarec.data.hashing import hash_segments, hash_values, missing_key
from terarec.data.readers import DataError, batch_from_records, csv_schema
from terarec.serving.features import request_batch

SCHEMA = csv_schema("y", ["n1", "n2", "n3"], ["user", "item", "tags", "ctx"],
                    multi_valued=["tags"], separator="|", transform={"n2": "log1p"})
SINGLE_SCHEMA = csv_schema("y", ["n1", "n2", "n3"], ["user", "item", "tags", "ctx"],
                           transform={"n3": "log1p"})
MEAN_SCHEMA = csv_schema("y", ["n1"], ["user", "tags"], multi_valued=["tags"],
                         separator="|", pooling="mean", missing_flags=False)

cat_value = st.one_of(st.none(), st.integers(-5, 5), st.sampled_from(["a", "b", "", "zz"]))
num_value = st.one_of(st.none(), st.integers(-3, 100), st.floats(-10, 10), st.just("7"))
tag_value = st.one_of(st.none(), st.just("a|b"), st.lists(st.sampled_from(["x", "y"]),
                                                           max_size=3))
VALUE = {"n1": num_value, "n2": num_value, "n3": num_value, "user": cat_value,
         "item": cat_value, "ctx": cat_value, "tags": tag_value}


def features(names):
    return st.fixed_dictionaries({}, optional={k: VALUE[k] for k in names})


def _assert_same(a, b):
    torch.testing.assert_close(a.dense, b.dense, rtol=0, atol=0)
    assert a.sparse.fields == b.sparse.fields
    assert torch.equal(a.sparse.values, b.sparse.values)
    assert torch.equal(a.sparse.offsets, b.sparse.offsets)
    assert len(a) == len(b)


@pytest.mark.parametrize("schema", [SCHEMA, SINGLE_SCHEMA], ids=["multi-valued", "single"])
@settings(max_examples=60, deadline=None)
@given(data=st.data(), n=st.integers(1, 6))
def test_context_once_equals_every_merged_row(schema, data, n):
    context_names = data.draw(st.sets(st.sampled_from(sorted(VALUE))))
    context = data.draw(features(sorted(context_names)))
    others = sorted(set(VALUE) - set(context))
    candidates = [data.draw(features(others)) for _ in range(n)]
    if schema is SINGLE_SCHEMA:
        context = {k: "|".join(v) if isinstance(v, list) else v for k, v in context.items()}
        candidates = [{k: "|".join(v) if isinstance(v, list) else v for k, v in c.items()}
                      for c in candidates]
    merged = [{**context, **c} for c in candidates]
    _assert_same(request_batch(context, candidates, schema), batch_from_records(merged, schema))


def test_candidates_of_any_mapping_type_score_like_dicts():
    """Candidates that are Mappings but not dicts (and a mix) take the same values."""
    from types import MappingProxyType
    context = {"ctx": "c1", "n3": 2.5}
    candidates = [{"user": "u1", "item": "i1", "n1": 3}, {"user": "u2", "n2": 1.5},
                  {"item": "i3", "tags": "t1|t2", "n1": 7}]
    merged = [{**context, **c} for c in candidates]
    want = batch_from_records(merged, SINGLE_SCHEMA)
    _assert_same(request_batch(context, [MappingProxyType(c) for c in candidates],
                               SINGLE_SCHEMA), want)
    mixed = [candidates[0], MappingProxyType(candidates[1]), candidates[2]]
    _assert_same(request_batch(context, mixed, SINGLE_SCHEMA), want)


def test_candidates_may_override_the_context_where_they_carry_a_field():
    context = {"user": "u1", "item": "i0", "n1": 3}
    candidates = [{"item": "i1"}, {}, {"item": "i2", "n1": 4}]
    merged = [{**context, **c} for c in candidates]
    _assert_same(request_batch(context, candidates, SCHEMA), batch_from_records(merged, SCHEMA))


def test_all_numeric_sides_and_mean_pooling_fields():
    context = {"n1": 2.5}
    candidates = [{"user": "a", "tags": ["x", "y", "x"]}, {"user": "b"}]
    merged = [{**context, **c} for c in candidates]
    _assert_same(request_batch(context, candidates, MEAN_SCHEMA),
                 batch_from_records(merged, MEAN_SCHEMA))
    context = {"user": "a", "tags": "x|y"}
    candidates = [{"n1": 1}, {"n1": None}]
    merged = [{**context, **c} for c in candidates]
    _assert_same(request_batch(context, candidates, MEAN_SCHEMA),
                 batch_from_records(merged, MEAN_SCHEMA))


def test_errors_name_the_context_or_the_candidate():
    with pytest.raises(DataError, match=r"^context: field 'n1'"):
        request_batch({"n1": "many"}, [{"user": "a"}], SCHEMA)
    with pytest.raises(DataError, match=r"^candidates\[1\]: field 'item'"):
        request_batch({}, [{"item": "a"}, {"item": 1.5}], SCHEMA)


def test_a_null_hashes_to_the_missing_key_whatever_bytes_its_slot_holds():
    """Arrow leaves a null slot's bytes to the writer: the hashing kernel goes by the
    validity bitmap (sliced arrays too), not by the slot being empty."""
    values = pa.array(["ab", "cd", "ef"])
    validity = pa.array([True, False, True]).buffers()[1]  # bits 1, 0, 1
    masked = pa.Array.from_buffers(pa.string(), 3, [validity, *values.buffers()[1:]],
                                   null_count=1)
    keys = hash_segments(("f", "g"), masked, np.array([0, 2, 3]), "salt")
    assert keys.tolist() == [hash_values("f", ["ab"], "salt")[0], missing_key("f", "salt"),
                             hash_values("g", ["ef"], "salt")[0]]
    tail = masked.slice(1, 2)
    keys = hash_segments(("g",), tail, np.array([0, 2]), "salt")
    assert keys.tolist() == [missing_key("g", "salt"), hash_values("g", ["ef"], "salt")[0]]
