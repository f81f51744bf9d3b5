"""Stable 64-bit feature hashing: ``(field, value) -> int64`` key.

Keys must be identical across runs, processes and machines (training writes them to the
store, serving recomputes them from raw request values months later), so Python's
``hash()`` (salted per process) is out. Each value's UTF-8 bytes go through 64-bit
FNV-1a, seeded per field, then a splitmix64 finalizer to spread FNV's weak low bits::

    seed(field) = splitmix64(fnv1a(salt + "\\x1f" + field))
    key(field, value) = splitmix64(fnv1a_from(seed, bytes(value)) ^ len) & (2^63 - 1)

Conventions:

* Keys are non-negative (top bit cleared) so negative int64 values stay free as sentinels
  (empty index slots, padding) for the stages downstream.
* Integers hash through their decimal string: ``12`` and ``"12"`` give the same key.
* Null and the empty string both mean "missing" and hash to a per-field reserved key,
  which is an ordinary key otherwise (it gets its own embedding row).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

import numba
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from terarec.kernels import splitmix64, splitmix64_int

_FNV_OFFSET = np.uint64(0xCBF29CE484222325)
_FNV_PRIME = np.uint64(0x100000001B3)
_KEY_MASK = np.uint64(0x7FFFFFFFFFFFFFFF)
_MISSING_TAG = np.uint64(0x6D697373696E6721)  # "missing!" in ASCII


@numba.njit(cache=True, nogil=True)
def _hash_strings(data: np.ndarray, offsets: np.ndarray, seeds: np.ndarray,
                  missing: np.ndarray, bounds: np.ndarray, valid: np.ndarray,
                  valid_offset: int) -> np.ndarray:
    """Hash each ``data[offsets[i]:offsets[i+1]]``; values ``bounds[f]:bounds[f+1]``
    belong to field ``f`` (seed ``seeds[f]``; empty ranges, and nulls in the Arrow
    validity bitmap ``valid`` read from bit ``valid_offset``, give ``missing[f]``), so
    the columns of several fields hash in one call."""
    n = offsets.shape[0] - 1
    out = np.empty(n, dtype=np.int64)
    check = valid.shape[0] > 0
    for f in range(bounds.shape[0] - 1):
        seed = seeds[f]
        miss = missing[f]
        for i in range(bounds[f], bounds[f + 1]):
            lo = offsets[i]
            hi = offsets[i + 1]
            if check:
                bit = valid_offset + i
                if (valid[bit >> 3] >> (bit & 7)) & 1 == 0:
                    out[i] = miss
                    continue
            if hi == lo:
                out[i] = miss
                continue
            h = seed
            for j in range(lo, hi):
                h = (h ^ np.uint64(data[j])) * _FNV_PRIME
            h = splitmix64(h ^ np.uint64(hi - lo))
            out[i] = np.int64(h & _KEY_MASK)
    return out


def _fnv1a_py(data: bytes, h: int = int(_FNV_OFFSET)) -> int:
    for byte in data:
        h = ((h ^ byte) * int(_FNV_PRIME)) & 0xFFFFFFFFFFFFFFFF
    return h


@lru_cache(maxsize=4096)
def field_seed(field: str, salt: str) -> int:
    """The FNV starting state for ``field``: different fields never share a key space."""
    return splitmix64_int(_fnv1a_py((salt + "\x1f" + field).encode()))


@lru_cache(maxsize=4096)
def missing_key(field: str, salt: str) -> int:
    """The key a null or empty value of ``field`` hashes to."""
    return splitmix64_int(field_seed(field, salt) ^ int(_MISSING_TAG)) & int(_KEY_MASK)


@lru_cache(maxsize=1024)
def _field_keys(fields: tuple[str, ...], salt: str) -> tuple[np.ndarray, np.ndarray]:
    """Seeds (uint64) and missing keys (int64) of ``fields``, for the kernel."""
    return (np.array([field_seed(f, salt) for f in fields], np.uint64),
            np.array([missing_key(f, salt) for f in fields], np.int64))


def _as_bytes_array(values: pa.Array, field: str) -> pa.Array:
    """Bring ``values`` to (large_)string/binary, the layout the kernel reads."""
    t = values.type
    if pa.types.is_integer(t):
        return pc.cast(values, pa.string())
    if pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_binary(t) \
            or pa.types.is_large_binary(t):
        return values
    if pa.types.is_string_view(t):
        return pc.cast(values, pa.large_string())
    if pa.types.is_binary_view(t):
        return pc.cast(values, pa.large_binary())
    if pa.types.is_null(t):
        return pa.array([None] * len(values), pa.string())
    raise TypeError(
        f"field {field!r}: cannot hash values of type {t}; categorical values must be "
        "strings, binary or integers"
    )


def _hash_array(field: str, values: pa.Array, salt: str) -> np.ndarray:
    if pa.types.is_dictionary(values.type):
        # Hash each distinct value once, then gather: Parquet often hands these out.
        dict_keys = _hash_array(field, values.dictionary, salt)
        indices = values.indices.fill_null(0).to_numpy(zero_copy_only=False)
        keys = dict_keys[indices.astype(np.int64, copy=False)]
        if values.null_count:
            keys[values.is_null().to_numpy(zero_copy_only=False)] = missing_key(field, salt)
        return keys
    arr = _as_bytes_array(values, field)
    if len(arr) == 0:
        return np.empty(0, dtype=np.int64)
    return _hash_bytes(arr, [field], np.array([0, len(arr)], np.int64), salt)


_NO_BITMAP = np.empty(0, dtype=np.uint8)  # the kernel's "no nulls" bitmap


def _hash_bytes(arr: pa.Array, fields: Sequence[str], bounds: np.ndarray,
                salt: str) -> np.ndarray:
    """Keys of a (large_)string/binary array whose values ``bounds[f]:bounds[f+1]``
    belong to ``fields[f]`` (nulls -> that field's missing key)."""
    n = len(arr)
    seeds, missing = _field_keys(tuple(fields), salt)
    buffers = arr.buffers()
    large = pa.types.is_large_string(arr.type) or pa.types.is_large_binary(arr.type)
    offsets = np.frombuffer(buffers[1], dtype=np.int64 if large else np.int32)
    offsets = offsets[arr.offset:arr.offset + n + 1]
    data = (np.frombuffer(buffers[2], dtype=np.uint8) if buffers[2] is not None
            else np.empty(0, dtype=np.uint8))
    # Nulls are read from the validity bitmap inside the kernel (no mask array).
    valid = (np.frombuffer(buffers[0], dtype=np.uint8) if arr.null_count
             and buffers[0] is not None else _NO_BITMAP)
    return _hash_strings(data, offsets, seeds, missing, bounds, valid, arr.offset)



def hash_columns(fields: Sequence[str], columns: Sequence[pa.Array], salt: str) -> np.ndarray:
    """``np.concatenate([hash_column(f, c, salt) for f, c in zip(fields, columns)])`` in
    one kernel call: the field-major key layout of a batch (columns of strings, binary
    or integers; serving hashes a request's fields together this way)."""
    if not columns:
        return np.empty(0, dtype=np.int64)
    arrays = [_as_bytes_array(c, f) for f, c in zip(fields, columns, strict=True)]
    if any(a.type != pa.string() for a in arrays):
        arrays = [a.cast(pa.large_binary()) for a in arrays]
    bounds = np.zeros(len(arrays) + 1, np.int64)
    np.cumsum([len(a) for a in arrays], out=bounds[1:])
    arr = arrays[0] if len(arrays) == 1 else pa.concat_arrays(arrays)
    if len(arr) == 0:
        return np.empty(0, dtype=np.int64)
    return _hash_bytes(arr, fields, bounds, salt)


def hash_segments(fields: Sequence[str], values: pa.Array, bounds: np.ndarray,
                  salt: str) -> np.ndarray:
    """Keys of one string array whose values ``bounds[f]:bounds[f+1]`` belong to
    ``fields[f]`` (nulls -> that field's missing key): several fields' values laid end to
    end, hashed in one kernel call without building a column per field."""
    if len(values) == 0:
        return np.empty(0, dtype=np.int64)
    return _hash_bytes(values, fields, bounds, salt)


def hash_column(field: str, values: pa.Array | pa.ChunkedArray, salt: str) -> np.ndarray:
    """int64 keys for every value of one column, in order (nulls -> the missing key)."""
    if isinstance(values, pa.ChunkedArray):
        if values.num_chunks == 0:
            return np.empty(0, dtype=np.int64)
        if values.num_chunks == 1:
            return _hash_array(field, values.chunk(0), salt)
        return np.concatenate([_hash_array(field, c, salt) for c in values.chunks])
    return _hash_array(field, values, salt)


def hash_values(field: str, values: Sequence[str | int | None], salt: str) -> np.ndarray:
    """Keys for raw Python values (e.g. a JSON request), identical to ``hash_column``."""
    texts: list[str | None] = []
    for v in values:
        if v is None or isinstance(v, str):
            texts.append(v)
        elif isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_)):
            texts.append(str(int(v)))
        else:
            raise TypeError(
                f"field {field!r}: cannot hash {v!r} ({type(v).__name__}); categorical "
                "values must be strings, integers or null"
            )
    return hash_column(field, pa.array(texts, type=pa.string()), salt)
