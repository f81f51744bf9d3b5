"""Row codecs: layouts, error bounds, unbiased stochastic rounding, special rows, codebooks."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from terarec.embedding.quant import (
    INT_BITS,
    PRECISIONS,
    bytes_ratio,
    codebook_row_bytes,
    decode_codebook,
    decode_rows,
    encode_codebook,
    encode_rows,
    fit_codebook,
    read_scale_bias,
    row_bytes,
)

GRID_PRECISIONS = ("int8", "int4", "int2")  # min/max grid with nearest rounding
EPS32 = float(np.finfo(np.float32).eps)
FP16_TINY = 2.0**-24  # smallest fp16 subnormal: the coarsest a scale can be rounded up by


def gaussian_rows(n: int = 512, dim: int = 16, std: float = 0.05, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(0.0, std, (n, dim)).astype(np.float32)


def round_trip(values: np.ndarray, precision: str, **kwargs) -> np.ndarray:
    return decode_rows(encode_rows(values, precision, **kwargs), precision, values.shape[1])


def grid_error_bound(values: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """Half a stored step per row, plus float32 arithmetic slack."""
    magnitude = np.abs(values).max(axis=1)
    return scale / 2 * (1 + 1e-5) + 4 * EPS32 * magnitude


# -- sizes and layout -------------------------------------------------------------------
@pytest.mark.parametrize(("precision", "dim", "expected"), [
    ("fp32", 16, 64), ("fp16", 16, 32), ("int8", 16, 24), ("int4", 16, 14),
    ("int2", 16, 10), ("int1", 16, 8), ("int4", 3, 8), ("int2", 5, 8), ("int1", 9, 8),
    ("int1", 17, 9), ("int8", 1, 9),
])
def test_row_bytes_counts_packed_codes_plus_scale_and_bias(precision, dim, expected):
    assert row_bytes(precision, dim) == expected
    assert bytes_ratio(precision, dim) == pytest.approx(expected / (4 * dim))
    codes = encode_rows(gaussian_rows(7, dim), precision)
    assert codes.dtype == np.uint8 and codes.shape == (7, expected)


@pytest.mark.parametrize(("precision", "row", "expected"), [
    # codes 0, 1, 15 -> nibbles low first; scale 1.0 = fp16 0x3C00; bias 0.0 fp32
    ("int4", [0.0, 1.0, 15.0], [0x10, 0x0F, 0x00, 0x3C, 0, 0, 0, 0]),
    # codes 0, 1, 2, 3 | 3 -> 0b11_10_01_00, 0b11
    ("int2", [0.0, 1.0, 2.0, 3.0, 3.0], [0xE4, 0x03, 0x00, 0x3C, 0, 0, 0, 0]),
    # codes 0 1 1 0 1 0 0 0 | 1 -> bit j of byte j // 8; bias -2.0 = fp32 0xC0000000
    ("int1", [-2, -1, -1, -2, -1, -2, -2, -2, -1], [0x16, 0x01, 0x00, 0x3C, 0, 0, 0, 0xC0]),
    # int8 keeps an fp32 scale: 1.0 = 0x3F800000
    ("int8", [2.0, 257.0], [0, 255, 0, 0, 0x80, 0x3F, 0, 0, 0, 0x40]),
])
def test_int_layout_is_little_end_first_codes_then_scale_then_fp32_bias(
        precision, row, expected):
    codes = encode_rows(np.array([row], dtype=np.float32), precision)
    assert codes[0].tolist() == expected


def test_row_bytes_rejects_unknown_precision_and_bad_dim():
    with pytest.raises(ValueError, match="unknown precision 'int3'"):
        row_bytes("int3", 16)
    with pytest.raises(ValueError, match="dim must be a positive integer"):
        row_bytes("int8", 0)


# -- fp32 / fp16 -------------------------------------------------------------------------
def test_fp32_round_trip_is_bit_exact_even_for_specials():
    values = gaussian_rows(64, 12)
    values[0, :5] = [np.nan, np.inf, -np.inf, -0.0, 1e-45]
    decoded = round_trip(values, "fp32")
    assert decoded.dtype == np.float32
    assert np.array_equal(decoded.view(np.uint32), values.view(np.uint32))


def test_fp32_codes_do_not_alias_the_input():
    values = gaussian_rows(4, 8)
    codes = encode_rows(values, "fp32")
    values[:] = 0.0
    assert decode_rows(codes, "fp32", 8).any()


def test_fp16_relative_error_is_half_an_fp16_ulp():
    values = np.concatenate([gaussian_rows(256, 16), gaussian_rows(4, 16, std=1e3),
                             gaussian_rows(4, 16, std=1e-6)])
    error = np.abs(round_trip(values, "fp16") - values)
    assert np.all(error <= 2.0**-11 * np.abs(values) + 2.0**-25)
    assert error.max() > 0  # fp16 really is lossy on these values


# -- intN nearest --------------------------------------------------------------------------
@pytest.mark.parametrize("precision", GRID_PRECISIONS)
def test_int_nearest_error_within_half_ideal_step(precision):
    values = gaussian_rows(2048, 16)
    codes = encode_rows(values, precision)
    decoded = decode_rows(codes, precision, 16)
    scale, bias = read_scale_bias(codes, precision, 16)
    span = values.max(axis=1).astype(np.float64) - values.min(axis=1)
    ideal = span / ((1 << INT_BITS[precision]) - 1)

    assert np.array_equal(bias, values.min(axis=1))  # fp32 bias is the row min exactly
    assert np.all(scale >= ideal) and np.all(scale <= ideal * (1 + 2.0**-10))
    error = np.abs(decoded - values).max(axis=1)
    assert np.all(error <= grid_error_bound(values, scale))
    assert np.all(error <= ideal / 2 * (1 + 2.0**-9) + 1e-7)
    # Nearest rounding uses the whole grid: the row max is reached, not clipped short.
    assert np.all(np.abs(decoded.max(axis=1) - values.max(axis=1)) <= scale / 2)


def test_int_error_does_not_grow_with_row_offset():
    """fp32 bias: a row far from zero keeps the precision of its range, not of its offset."""
    base = gaussian_rows(64, 16, std=1e-3)
    shifted = base + np.float32(100.0)
    for values in (base, shifted):
        codes = encode_rows(values, "int8")
        scale, _ = read_scale_bias(codes, "int8", 16)
        error = np.abs(decode_rows(codes, "int8", 16) - values).max(axis=1)
        assert np.all(error <= grid_error_bound(values, scale))
        span = values.max(axis=1).astype(np.float64) - values.min(axis=1)
        assert np.all(scale <= span / 255 * (1 + 2.0**-20))


def test_int1_levels_are_the_means_of_their_halves_and_beat_mean_plus_minus_mad():
    values = gaussian_rows(1024, 16)
    codes = encode_rows(values, "int1")
    decoded = decode_rows(codes, "int1", 16)
    scale, bias = read_scale_bias(codes, "int1", 16)
    upper = decoded > bias[:, None]
    assert np.all(upper.any(axis=1) & (~upper).any(axis=1))  # two levels per row
    # Each level is the mean of the values coded to it (up to the fp16 scale's rounding).
    upper_mean = (values * upper).sum(axis=1) / upper.sum(axis=1)
    lower_mean = (values * ~upper).sum(axis=1) / (~upper).sum(axis=1)
    assert np.allclose(bias, lower_mean, rtol=0, atol=1e-6)
    assert np.allclose(bias + scale, upper_mean, rtol=0, atol=2.0**-10 * np.abs(scale) + 1e-6)
    # ... and the split is where the levels meet, so every value sits at its nearer level.
    nearer = np.minimum(np.abs(values - bias[:, None]), np.abs(values - (bias + scale)[:, None]))
    assert np.allclose(np.abs(values - decoded), nearer, rtol=0,
                       atol=2.0**-10 * np.abs(scale).max() + 1e-7)

    mean = values.mean(axis=1, keepdims=True)
    mad = np.abs(values - mean).mean(axis=1, keepdims=True)
    sign_codes = np.where(values >= mean, mean + mad, mean - mad)
    assert np.mean((decoded - values) ** 2) < np.mean((sign_codes - values) ** 2)


# -- stochastic rounding -------------------------------------------------------------------
@pytest.mark.parametrize("precision", ["fp16", *GRID_PRECISIONS, "int1"])
def test_stochastic_rounding_is_unbiased(precision):
    repeats = 4000
    row = np.array([[-0.11, -0.05, -0.031, 0.0, 0.004, 0.017, 0.05, 0.093, 0.12, 0.07, -0.08]],
                   dtype=np.float32)
    if precision == "fp16":
        row = row * np.float32(1 + 1 / 3000)  # land between fp16 neighbours
    rows = np.repeat(row, repeats, axis=0)
    codes = encode_rows(rows, precision, stochastic=True, rng=np.random.default_rng(7))
    decoded = decode_rows(codes, precision, row.shape[1]).astype(np.float64)

    # One draw lands on one of the two neighbours of x, so its std is at most step / 2.
    if precision == "fp16":
        step = np.spacing(np.abs(row[0]).astype(np.float16)).astype(np.float64)
    else:
        step = read_scale_bias(codes, precision, row.shape[1])[0][0]
    tolerance = 5 * step / 2 / np.sqrt(repeats)
    assert np.all(np.abs(decoded.mean(axis=0) - row[0]) <= tolerance)
    assert np.all(np.abs(decoded - row) <= step * (1 + 1e-5))  # only the two neighbours
    nearest = round_trip(row, precision)[0]
    assert np.any(np.abs(nearest - row[0]) > tolerance)  # nearest rounding would have failed


def test_stochastic_rounding_is_reproducible_from_the_generator():
    values = gaussian_rows(32, 16)
    first = encode_rows(values, "int4", stochastic=True, rng=np.random.default_rng(3))
    again = encode_rows(values, "int4", stochastic=True, rng=np.random.default_rng(3))
    other = encode_rows(values, "int4", stochastic=True, rng=np.random.default_rng(4))
    assert np.array_equal(first, again) and not np.array_equal(first, other)


# -- special rows and bad input --------------------------------------------------------------
@pytest.mark.parametrize("precision", [p for p in PRECISIONS if p != "fp16"])
@pytest.mark.parametrize("stochastic", [False, True])
def test_constant_and_zero_rows_round_trip_exactly(precision, stochastic):
    constants = np.array([0.0, 0.1, -3.7, 1e-20, 12345.678, -0.0], dtype=np.float32)
    values = np.concatenate([np.repeat(constants[:, None], 13, axis=1), gaussian_rows(3, 13)])
    decoded = round_trip(values, precision, stochastic=stochastic, rng=np.random.default_rng(0))
    assert np.array_equal(decoded[:6], values[:6])


@pytest.mark.parametrize("precision", PRECISIONS)
def test_no_rows_encode_to_no_rows(precision):
    codes = encode_rows(np.empty((0, 5), dtype=np.float32), precision)
    assert codes.shape == (0, row_bytes(precision, 5))
    assert decode_rows(codes, precision, 5).shape == (0, 5)


@pytest.mark.parametrize("precision", ["fp16", "int8", "int1"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_values_are_rejected_with_their_position(precision, bad):
    values = gaussian_rows(6, 4)
    values[4, 2] = bad
    with pytest.raises(ValueError, match=r"values\[4, 2\] is .*only finite"):
        encode_rows(values, precision)


def test_out_of_range_and_malformed_input_is_rejected():
    big = np.full((2, 3), 1.0, dtype=np.float32)
    big[1, 1] = 7e4
    with pytest.raises(ValueError, match="row 1 holds a value beyond"):
        encode_rows(big, "fp16")
    wide = np.array([[1.0, 1.0], [-6e4, 6e4]], dtype=np.float32)
    for stochastic in (False, True):
        with pytest.raises(ValueError, match="row 1 needs a step of .* too wide for a float16"):
            encode_rows(wide, "int1", stochastic=stochastic)
    with pytest.raises(ValueError, match="2-D"):
        encode_rows(np.zeros(4, dtype=np.float32), "int8")
    with pytest.raises(TypeError, match="floating point"):
        encode_rows(np.zeros((2, 4), dtype=np.int64), "int8")
    with pytest.raises(ValueError, match=r"expected uint8\[n, 14\] for int4 rows of dim 16"):
        decode_rows(np.zeros((3, 13), dtype=np.uint8), "int4", 16)
    with pytest.raises(ValueError, match="no scale/bias"):
        read_scale_bias(np.zeros((1, 32), dtype=np.uint8), "fp16", 16)


# -- codebooks ------------------------------------------------------------------------------
def nearest_levels(values: np.ndarray, levels: np.ndarray) -> np.ndarray:
    return levels[np.abs(values[..., None] - levels).argmin(axis=-1)]


def codebook_mse(values: np.ndarray, levels: np.ndarray) -> float:
    return float(np.mean((nearest_levels(values, levels) - values) ** 2))


@pytest.mark.parametrize("precision", ["int8", "int4", "int2", "int1"])
def test_int_rows_beyond_their_float32_grid_are_refused(precision):
    """A row from -3e38 to 3e38 overflowed the float32 grid: its maximum decoded as its
    minimum, without an error. Up to 1e38 the grid works."""
    rows = np.array([[1.0, 0.5, 0.0, -1.0], [3e38, -3e38, 1.0, 0.0]], np.float32)
    with pytest.raises(ValueError, match=f"encode_rows: row 1 holds a value beyond "
                                         fr"\+-1e\+38, which {precision} rows cannot store"):
        encode_rows(rows, precision)
    if precision == "int8":
        edge = np.array([[1e38, -1e38, 1.0, 0.0]], np.float32)
        for stochastic in (False, True):
            decoded = decode_rows(encode_rows(edge, "int8", stochastic=stochastic), "int8", 4)
            assert np.isfinite(decoded).all()
            np.testing.assert_allclose(decoded[0, :2], edge[0, :2], rtol=1e-6)


def test_row_scaled_codebook_refuses_rows_beyond_its_fp16_scale():
    """Squaring 3e38 overflowed float32: the row's RMS was inf, the row encoded as zeros
    and decoded as zeros without an error."""
    rows = np.array([[3e38, -3e38, 1.0, 0.0], [0.1, 0.2, -0.1, 0.0]], np.float32)
    levels = fit_codebook(rows[1:], 2, row_scaled=True)
    with pytest.raises(ValueError, match=r"encode_codebook \(row scale\): row 0 holds a value "
                       r"beyond \+-65504"):
        encode_codebook(rows, levels, row_scaled=True)
    wide = fit_codebook(rows, 2, row_scaled=True)  # fitted on each row over its RMS
    assert np.isfinite(wide).all() and np.ptp(wide) > 0.5


@pytest.mark.parametrize("bits", [1, 2, 4])
def test_kmeans_codebook_beats_uniform_levels_on_gaussian_values(bits):
    values = gaussian_rows(2048, 16)
    codebook = fit_codebook(values, bits)
    assert codebook.dtype == np.float32 and codebook.shape == (1 << bits,)
    assert np.all(np.diff(codebook) > 0)
    fitted = codebook_mse(values, codebook)
    spread = np.linspace(values.min(), values.max(), 1 << bits)
    assert fitted < 0.5 * codebook_mse(values, spread)
    # Also better than the best symmetric uniform grid, not just the min/max one.
    best_uniform = min(codebook_mse(values, np.linspace(-c, c, 1 << bits))
                       for c in np.linspace(0.01, 0.2, 40))
    assert fitted <= best_uniform * (1.0 if bits < 4 else 0.9)


def test_kmeans_codebook_is_a_lloyd_fixed_point():
    """Each level is (close to) the mean of the values nearest to it."""
    values = np.random.default_rng(1).standard_t(4, (512, 16)).astype(np.float32)
    codebook = fit_codebook(values, 2, iters=200)
    assigned = nearest_levels(values, codebook)
    for level in codebook:
        assert values[assigned == level].mean() == pytest.approx(level, rel=1e-4)


def test_fit_codebook_subsamples_reproducibly():
    values = gaussian_rows(4096, 16)
    a = fit_codebook(values, 2, seed=1, max_samples=5000)
    b = fit_codebook(values, 2, seed=1, max_samples=5000)
    full = fit_codebook(values, 2)
    assert np.array_equal(a, b)
    assert np.allclose(a, full, atol=0.01) and not np.array_equal(a, full)


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_shared_codebook_round_trip_picks_the_nearest_level(bits):
    values = gaussian_rows(300, 13)
    codebook = fit_codebook(values, bits)
    codes = encode_codebook(values, codebook)
    assert codes.shape == (300, codebook_row_bytes(bits, 13)) == (300, -(-13 * bits // 8))
    decoded = decode_codebook(codes, codebook, 13)
    assert np.array_equal(decoded, nearest_levels(values, codebook))


def test_row_scaled_codebook_stores_least_squares_scale_and_helps_on_mixed_scales():
    rng = np.random.default_rng(2)
    std = np.exp(rng.uniform(np.log(0.005), np.log(0.5), 4096)).astype(np.float32)
    values = rng.normal(0.0, 1.0, (4096, 16)).astype(np.float32) * std[:, None]
    values[:3] = 0.0
    shared_book = fit_codebook(values, 2)
    scaled_book = fit_codebook(values, 2, row_scaled=True)
    codes = encode_codebook(values, scaled_book, row_scaled=True)
    assert codes.shape == (4096, codebook_row_bytes(2, 16, row_scaled=True)) == (4096, 6)
    decoded = decode_codebook(codes, scaled_book, 16, row_scaled=True)
    assert np.array_equal(decoded[:3], values[:3])  # zero rows stay exactly zero

    # Each row is scale * chosen levels, the scale least-squares optimal for them.
    scale = codes[:, -2:].copy().view("<f2")[:, 0].astype(np.float64)
    chosen = np.divide(decoded, scale[:, None], out=np.zeros_like(decoded),
                       where=scale[:, None] != 0)
    assert np.all(np.isin(chosen[3:].round(3), scaled_book.round(3)))
    optimal = (chosen * values).sum(axis=1)[3:] / (chosen * chosen).sum(axis=1)[3:]
    assert np.allclose(scale[3:], optimal, rtol=2.0**-10)

    shared_error = np.mean((decode_codebook(encode_codebook(values, shared_book), shared_book,
                                            16) - values) ** 2)
    assert np.mean((decoded - values) ** 2) < 0.7 * shared_error


def test_codebook_input_is_validated():
    values = gaussian_rows(4, 8)
    with pytest.raises(ValueError, match="bits must be one of"):
        fit_codebook(values, 3)
    with pytest.raises(ValueError, match="one of .* levels, got shape"):
        encode_codebook(values, np.zeros(3, dtype=np.float32))
    with pytest.raises(ValueError, match="finite and ascending"):
        encode_codebook(values, np.array([0.1, -0.1], dtype=np.float32))
    with pytest.raises(ValueError, match="no values to fit"):
        fit_codebook(np.zeros((3, 4), dtype=np.float32), 1, row_scaled=True)
    with pytest.raises(ValueError, match=r"uint8\[n, 4\] for 2-bit codebook rows with row"):
        decode_codebook(np.zeros((2, 2), dtype=np.uint8), np.arange(4.0), 8, row_scaled=True)


# -- properties over random shapes and values -----------------------------------------------
finite_rows = st.tuples(st.integers(0, 9), st.integers(1, 41)).flatmap(
    lambda shape: hnp.arrays(np.float32, shape, elements=st.floats(
        -1e3, 1e3, width=32, allow_subnormal=True)))


@settings(max_examples=60, deadline=None)
@given(values=finite_rows, precision=st.sampled_from(PRECISIONS), stochastic=st.booleans(),
       seed=st.integers(0, 2**32 - 1))
# A subnormal fp32 int8 scale: 1 / scale overflows float32.
@example(values=np.array([[1.1754944e-38, 0.0]], dtype=np.float32), precision="int8",
         stochastic=False, seed=0)
@example(values=np.array([[1e-45, 0.0, 3e-45]], dtype=np.float32), precision="int4",
         stochastic=True, seed=1)
def test_round_trip_properties(values, precision, stochastic, seed):
    n, dim = values.shape
    codes = encode_rows(values, precision, stochastic=stochastic,
                        rng=np.random.default_rng(seed))
    assert codes.shape == (n, row_bytes(precision, dim))
    decoded = decode_rows(codes, precision, dim)
    assert decoded.shape == (n, dim) and decoded.dtype == np.float32
    error = np.abs(decoded.astype(np.float64) - values)
    if precision == "fp32":
        assert np.array_equal(decoded, values)
    elif precision == "fp16":
        # Stochastic may pick the farther neighbour: a whole ulp instead of half.
        assert np.all(error <= 2.0 ** (-10 if stochastic else -11) * np.abs(values) + 2.0**-24)
    elif n:
        steps = (1 << INT_BITS[precision]) - 1
        scale, bias = read_scale_bias(codes, precision, dim)
        span = values.max(axis=1).astype(np.float64) - values.min(axis=1)
        if precision != "int1" or stochastic:
            assert np.array_equal(bias, values.min(axis=1))
            assert np.all(scale >= span / steps)
            assert np.all(scale <= span / steps * (1 + 2.0**-10) + FP16_TINY)
            reach = scale if stochastic else scale / 2
            bound = reach * (1 + 1e-5) + 4 * EPS32 * np.abs(values).max(axis=1)
            assert np.all(error.max(axis=1) <= bound)
        else:
            assert np.all(error.max(axis=1) <= span * (1 + 2.0**-10) + 1e-6)
        # Decoded rows stay inside the row's range, up to the fp16 rounding of the scale.
        slack = (span * 2.0**-9 + steps * FP16_TINY + 4 * EPS32 * np.abs(values).max(axis=1))
        assert np.all(decoded >= values.min(axis=1, keepdims=True) - slack[:, None])
        assert np.all(decoded <= values.max(axis=1, keepdims=True) + slack[:, None])


@settings(max_examples=40, deadline=None)
@given(values=finite_rows, bits=st.sampled_from([1, 2, 4, 8]), row_scaled=st.booleans())
def test_codebook_round_trip_properties(values, bits, row_scaled):
    n, dim = values.shape
    codebook = np.sort(np.random.default_rng(dim).normal(0, 100, 1 << bits)).astype(np.float32)
    codes = encode_codebook(values, codebook, row_scaled=row_scaled)
    assert codes.shape == (n, codebook_row_bytes(bits, dim, row_scaled=row_scaled))
    decoded = decode_codebook(codes, codebook, dim, row_scaled=row_scaled)
    assert decoded.shape == (n, dim) and np.isfinite(decoded).all()
    if not row_scaled:
        # Ties between two levels may go either way; the distance must be the nearest one.
        best = np.abs(values[..., None] - codebook).min(axis=-1)
        assert np.allclose(np.abs(decoded - values), best, rtol=1e-6, atol=1e-4)
