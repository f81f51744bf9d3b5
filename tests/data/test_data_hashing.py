"""Feature hashing: stable keys (golden values), str/int equivalence, field separation."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from terarec.data.hashing import hash_column, hash_values, missing_key

SALT = "terarec-v1"
M64 = (1 << 64) - 1


def reference_key(field: str, value: str, salt: str) -> int:
    """The documented algorithm, spelled out in plain Python."""

    def fnv(data: bytes, h: int) -> int:
        for b in data:
            h = ((h ^ b) * 0x100000001B3) & M64
        return h

    def mix(x: int) -> int:
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & M64
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & M64
        return x ^ (x >> 31)

    seed = mix(fnv((salt + "\x1f" + field).encode(), 0xCBF29CE484222325))
    data = value.encode()
    return mix(fnv(data, seed) ^ len(data)) & (M64 >> 1)


def test_golden_values_never_change():
    # Computed once; a change here silently orphans every trained embedding row.
    keys = hash_values("C1", ["68fd1e64", "12", "", "héllo"], SALT)
    assert keys.tolist() == [9213523150315443775, 8259959054195502977,
                             3942235523726886322, 6638739387598750046]
    assert hash_values("site_id", ["1fbe01fe"], SALT).tolist() == [2507993651712911698]
    assert missing_key("C1", SALT) == 3942235523726886322
    assert missing_key("C2", SALT) == 8763963076353244634


@settings(max_examples=60, deadline=None)
@given(st.lists(st.text(min_size=1, max_size=20), min_size=1, max_size=30),
       st.text(max_size=8))
def test_kernel_matches_reference_and_all_string_layouts(values, field):
    expected = [reference_key(field, v, SALT) for v in values]
    assert hash_values(field, values, SALT).tolist() == expected
    for typ in (pa.string(), pa.large_string()):
        assert hash_column(field, pa.array(values, typ), SALT).tolist() == expected
    binary = pa.array([v.encode() for v in values], pa.binary())
    assert hash_column(field, binary, SALT).tolist() == expected


def test_integers_hash_like_their_decimal_strings():
    ints = [12, -3, 0, 2**30, 7]
    as_text = hash_column("f", pa.array([str(i) for i in ints]), SALT)
    for typ in (pa.int64(), pa.int32()):
        assert np.array_equal(hash_column("f", pa.array(ints, typ), SALT), as_text)
    assert np.array_equal(hash_column("f", pa.array([12, 7], pa.uint16()), SALT),
                          as_text[[0, 4]])
    assert np.array_equal(hash_values("f", ints, SALT), as_text)
    assert np.array_equal(hash_values("f", [np.int32(12), "-3"], SALT), as_text[:2])


def test_null_and_empty_are_the_fields_missing_key():
    keys = hash_values("f", [None, "", "x"], SALT)
    assert keys[0] == keys[1] == missing_key("f", SALT)
    assert keys[2] != keys[0]
    assert missing_key("f", SALT) != missing_key("g", SALT)
    ints = hash_column("f", pa.array([None, 5], pa.int64()), SALT)
    assert ints[0] == missing_key("f", SALT)


def test_fields_and_salts_separate_key_spaces():
    values = [f"v{i}" for i in range(1000)]
    a = hash_values("a", values, SALT)
    b = hash_values("b", values, SALT)
    c = hash_values("a", values, "other-salt")
    assert len(set(a.tolist()) | set(b.tolist()) | set(c.tolist())) == 3000
    # "ab" + "c" and "a" + "bc" must not collide through the seed string.
    assert hash_values("ab", ["c"], SALT)[0] != hash_values("a", ["bc"], SALT)[0]


def test_keys_are_non_negative_int64_and_spread():
    keys = hash_values("f", [str(i) for i in range(20000)], SALT)
    assert keys.dtype == np.int64
    assert (keys >= 0).all()
    assert len(np.unique(keys)) == 20000
    # Low bits must be usable for sharding: each of 16 shards gets its share.
    counts = np.bincount(keys % 16, minlength=16)
    assert counts.min() > 20000 / 16 * 0.85


def test_slices_chunks_and_dictionaries_hash_like_plain_arrays():
    values = ["a", None, "bb", "", "ccc", "a", "dddd"]
    plain = hash_column("f", pa.array(values), SALT)
    arr = pa.array(["zz"] + values + ["yy"])
    assert np.array_equal(hash_column("f", arr.slice(1, len(values)), SALT), plain)
    chunked = pa.chunked_array([pa.array(values[:3]), pa.array(values[3:])])
    assert np.array_equal(hash_column("f", chunked, SALT), plain)
    encoded = pa.array(values).dictionary_encode()
    assert np.array_equal(hash_column("f", encoded, SALT), plain)
    assert hash_column("f", pa.chunked_array([], pa.string()), SALT).shape == (0,)


def test_unhashable_types_are_rejected_with_the_field_name():
    with pytest.raises(TypeError, match="'price'"):
        hash_column("price", pa.array([1.5, 2.0]), SALT)
    with pytest.raises(TypeError, match="'flag'"):
        hash_values("flag", [True], SALT)
    with pytest.raises(TypeError, match="'x'"):
        hash_values("x", [1.0], SALT)


def test_keys_are_the_same_in_a_fresh_process():
    # Python's hash() of str changes per process; ours must not.
    code = ("from terarec.data.hashing import hash_values;"
            "print(hash_values('C7', ['abc', 'x' * 100, 42], 'terarec-v1').tolist())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env={"PYTHONHASHSEED": "12345", "PATH": ""})
    here = hash_values("C7", ["abc", "x" * 100, 42], SALT).tolist()
    assert out.stdout.strip() == str(here)


def test_hash_segments_equal_one_hash_column_per_field():
    """Several fields' values end to end, hashed in one call, give each field's keys."""
    from terarec.data.hashing import hash_segments

    parts = {"C1": ["a", None, "", "zz"], "C2": ["a"], "C3": [None, "é", "a"]}
    values = pa.array([v for vals in parts.values() for v in vals], pa.string())
    bounds = np.cumsum([0] + [len(v) for v in parts.values()])
    got = hash_segments(list(parts), values, bounds, "salt")
    want = np.concatenate([hash_column(f, pa.array(v, pa.string()), "salt")
                           for f, v in parts.items()])
    np.testing.assert_array_equal(got, want)
    assert len(set(got[[0, 4, 7]])) == 3  # "a" of three fields: three keys
