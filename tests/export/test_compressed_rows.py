"""Compressed export shards: codecs, error bounds, files, lookups."""

import numpy as np
import pytest

from terarec.export.compressed import (
    CompressedRows,
    RowCodec,
    compress_rows,
    decompress_rows,
    load_compressed,
    lookup_rows,
    save_compressed,
)


def table(n=500, dim=16, seed=0):
    rng = np.random.default_rng(seed)
    scale = np.exp(rng.uniform(np.log(5e-3), np.log(0.5), (n, 1)))
    keys = np.sort(rng.choice(2**40, n, replace=False)).astype(np.int64) - 2**39
    return keys, (rng.normal(size=(n, dim)) * scale).astype(np.float32)


@pytest.mark.parametrize("bits", [32, 16, 8, 4, 2, 1])
def test_row_wise_codecs_round_trip_within_their_bound(bits):
    keys, values = table()
    rows = compress_rows(keys, values, RowCodec(bits))
    back = decompress_rows(rows)
    err = np.abs(back - values)
    span = values.max(1, keepdims=True) - values.min(1, keepdims=True)
    if bits == 32:
        np.testing.assert_array_equal(back, values)
    elif bits == 16:
        assert (err <= np.abs(values) * 2.0**-11 + 2.0**-25).all()
    elif bits == 1:
        # two levels per row, both inside the row's range: no value moves by more than it
        assert (err <= span + 1e-6).all()
        assert ((back == back.min(1, keepdims=True)) | (back == back.max(1, keepdims=True))).all()
    else:
        assert (err <= span / (2**bits - 1) * 0.5 * (1 + 2.0**-9) + 1e-7).all()
    assert rows.codes.shape == (500, rows.codec.row_bytes(16))
    assert rows.bytes_per_key == {32: 64, 16: 32, 8: 24, 4: 14, 2: 10, 1: 8}[bits]


def test_error_shrinks_with_bits_and_codebooks_beat_min_max_levels_at_2_bits():
    keys, values = table(2000)
    mse = {c: float(((decompress_rows(compress_rows(keys, values, RowCodec.parse(c)))
                      - values) ** 2).mean()) for c in ("int8", "int4", "int2", "int1", "cb2")}
    assert mse["int8"] < mse["int4"] < mse["int2"] < mse["int1"]
    assert mse["cb2"] < mse["int2"]


@pytest.mark.parametrize("codec", ["int2", "int1", "cb2", "cb1", "fp16"])
def test_shard_file_round_trip_and_lookup(tmp_path, codec):
    keys, values = table(300, dim=9)
    rows = compress_rows(keys, values, RowCodec.parse(codec))
    path = tmp_path / "shard.safetensors"
    save_compressed(rows, path)
    loaded = load_compressed(path)
    assert loaded.codec == rows.codec and loaded.dim == 9
    np.testing.assert_array_equal(decompress_rows(loaded), decompress_rows(rows))
    probe = np.array([keys[5], 12345, keys[0], keys[-1]], np.int64)
    assert 12345 not in set(keys.tolist())
    got, found = lookup_rows(loaded, probe)
    assert found.tolist() == [True, False, True, True]
    full = decompress_rows(rows)
    np.testing.assert_array_equal(got[[0, 2, 3]], full[[5, 0, -1]])
    assert not got[1].any()


def test_bad_inputs_are_named():
    keys, values = table(10)
    with pytest.raises(ValueError, match="sorted"):
        compress_rows(keys[::-1], values, RowCodec(8))
    with pytest.raises(ValueError, match="bits"):
        RowCodec(3)
    with pytest.raises(ValueError, match="codebook"):
        RowCodec(16, codebook=True)
    with pytest.raises(ValueError, match="unknown row codec"):
        RowCodec.parse("int3")


def test_loading_a_file_of_another_kind_fails_clearly(tmp_path):
    from safetensors.numpy import save_file

    path = tmp_path / "other.safetensors"
    save_file({"x": np.zeros(3, np.float32)}, str(path))
    with pytest.raises(ValueError, match="not a compressed row shard"):
        load_compressed(path)
    rows = CompressedRows(np.arange(3), np.zeros((3, 5), np.uint8), 4, RowCodec(8))
    save_compressed(rows, path)
    with pytest.raises(ValueError, match="expected"):
        load_compressed(path)


def test_empty_table():
    rows = compress_rows(np.empty(0, np.int64), np.empty((0, 4), np.float32), RowCodec(2))
    got, found = lookup_rows(rows, np.array([1, 2], np.int64))
    assert not found.any() and got.shape == (2, 4)


@pytest.mark.parametrize("bits", [8, 4, 16])
def test_a_row_out_of_the_precisions_range_is_named_by_its_key(bits):
    """The error named the row's index in the chunk being encoded (``row 1``), which no
    user can look up; the key is what inspect, predict and the server know."""
    keys = np.array([11, 4_000_000_007, 4_000_000_009], np.int64)
    values = np.zeros((3, 4), np.float32)
    values[1, 2] = 3e38
    with pytest.raises(ValueError, match=r"export: key 4000000007: its row holds a value "
                                         r"beyond \+-"):
        compress_rows(keys, values, RowCodec(bits))
