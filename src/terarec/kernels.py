"""Small kernels every package shares: the splitmix64 mixer and growing arrays.

splitmix64's finalizer (Steele, Lea, Flood 2014) spreads sequential or clustered 64-bit
inputs over all 64 bits; terarec uses it wherever a key must look random: hashing raw
values into keys, bucketing keys in the index, picking a key's owner rank, initialising
a key's row, synthetic data. Every site computes the same bits, whichever form it calls:
compiled (numba, inside kernels), numpy arrays, or Python ints. Stored keys depend on
it, so it never changes.
"""

from __future__ import annotations

import numba
import numpy as np

MIX1 = 0xBF58476D1CE4E5B9
MIX2 = 0x94D049BB133111EB
# splitmix64's increment (2^64 / golden ratio): combines a seed or a counter into a key.
GOLDEN_GAMMA = 0x9E3779B97F4A7C15
_M64 = 0xFFFFFFFFFFFFFFFF
_U_MIX1, _U_MIX2 = np.uint64(MIX1), np.uint64(MIX2)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)
_SHARD_SALT = np.uint64(0x5BD1E9955BD1E995)


@numba.njit(nogil=True, cache=True, inline="always")
def splitmix64(z: np.uint64) -> np.uint64:
    """The finalizer on one uint64, for compiled kernels (wrapping arithmetic)."""
    z = (z ^ (z >> _S30)) * _U_MIX1
    z = (z ^ (z >> _S27)) * _U_MIX2
    return z ^ (z >> _S31)


def splitmix64_array(x: np.ndarray) -> np.ndarray:
    """The finalizer on a uint64 array (numpy wraps uint64 arithmetic for arrays)."""
    x = (x ^ (x >> _S30)) * _U_MIX1
    x = (x ^ (x >> _S27)) * _U_MIX2
    return x ^ (x >> _S31)


def splitmix64_int(x: int) -> int:
    """The finalizer on a Python int in [0, 2^64)."""
    x = ((x ^ (x >> 30)) * MIX1) & _M64
    x = ((x ^ (x >> 27)) * MIX2) & _M64
    return x ^ (x >> 31)


def shard_of(keys: np.ndarray, world: int) -> np.ndarray:
    """The owning rank (int64) of each int64 key among ``world`` ranks: the high bits of a
    salted splitmix64 (``distributed/sharding.py`` says why), so raw sequential ids spread
    evenly. Training routes rows by it and checkpoint shards are cut by it."""
    if world < 1:
        raise ValueError(f"world size must be >= 1, got {world}")
    z = splitmix64_array(np.asarray(keys, dtype=np.int64).view(np.uint64) ^ _SHARD_SALT)
    return ((z >> np.uint64(32)) % np.uint64(world)).astype(np.int64)


def grown(arr: np.ndarray, n: int, fill: int | float = 0, double: bool = True) -> np.ndarray:
    """``arr`` with room for ``n`` rows: itself when it has them, else a new array of
    ``max(n, 2 * len(arr))`` rows (exactly ``n`` when not ``double``) holding ``arr``'s
    rows first and ``fill`` after. Doubling keeps repeated growth O(n) overall."""
    if n <= len(arr):
        return arr
    size = max(n, 2 * len(arr)) if double else n
    out = np.full((size,) + arr.shape[1:], fill, arr.dtype)
    out[:len(arr)] = arr
    return out
