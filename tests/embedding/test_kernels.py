"""The shared kernels: one splitmix64 in three forms, and array growth."""

from __future__ import annotations

import numba
import numpy as np

from terarec.kernels import GOLDEN_GAMMA, grown, splitmix64, splitmix64_array, splitmix64_int


@numba.njit
def _compiled(x):
    out = np.empty_like(x)
    for i in range(x.shape[0]):
        out[i] = splitmix64(x[i])
    return out


def test_splitmix64_forms_agree_and_match_the_reference_generator():
    # splitmix64 seeded with 0 first returns mix(0 + gamma) (Vigna's reference code).
    assert splitmix64_int(GOLDEN_GAMMA) == 0xE220A8397B1DCDAF
    x = np.random.default_rng(0).integers(0, 1 << 63, 1000, dtype=np.uint64) * np.uint64(2)
    want = np.array([splitmix64_int(int(v)) for v in x], np.uint64)
    np.testing.assert_array_equal(splitmix64_array(x), want)
    np.testing.assert_array_equal(_compiled(x), want)


def test_grown_keeps_rows_fills_the_rest_and_doubles():
    a = np.arange(6, dtype=np.int32).reshape(3, 2)
    assert grown(a, 3) is a
    g = grown(a, 4, fill=-1)
    assert g.shape == (6, 2) and g.dtype == a.dtype
    np.testing.assert_array_equal(g[:3], a)
    assert (g[3:] == -1).all()
    assert grown(a, 4, double=False).shape == (4, 2)
    assert grown(a, 10).shape == (10, 2)
