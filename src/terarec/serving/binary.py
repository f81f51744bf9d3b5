"""KServe v2 binary tensor data: input tensors sent as raw bytes after a JSON header.

A request carries the ``Inference-Header-Content-Length: H`` header; its body is H bytes
of JSON (the usual inference request, each input with ``"parameters":
{"binary_data_size": S}`` and no ``data``) followed by every input's S bytes, in the
order of ``inputs``. Fixed-size datatypes are little-endian arrays; a ``BYTES`` tensor is
its elements one after the other, each a 4-byte little-endian length and that many
bytes. Tensors become Arrow columns without a Python object per value: numbers through
``np.frombuffer``, ``BYTES`` through one compiled pass that strips the length prefixes.
"""

from __future__ import annotations

import numba
import numpy as np
import pyarrow as pa

HEADER = "inference-header-content-length"

FIXED_DTYPES = {"BOOL": np.dtype(np.bool_), "UINT8": np.dtype("<u1"),
                "UINT16": np.dtype("<u2"), "UINT32": np.dtype("<u4"),
                "UINT64": np.dtype("<u8"), "INT8": np.dtype("<i1"), "INT16": np.dtype("<i2"),
                "INT32": np.dtype("<i4"), "INT64": np.dtype("<i8"), "FP16": np.dtype("<f2"),
                "FP32": np.dtype("<f4"), "FP64": np.dtype("<f8")}


class BinaryTensorError(ValueError):
    """A binary tensor whose bytes do not hold what its header says."""


@numba.njit(cache=True, nogil=True)
def _split_bytes(buf: np.ndarray, out: np.ndarray, offsets: np.ndarray) -> int:
    """Copy the length-prefixed elements of ``buf`` into ``out`` back to back, writing
    ``offsets`` (one more than the elements); returns the element count, or -1 when
    ``buf`` does not hold exactly ``len(offsets) - 1`` whole elements."""
    pos = 0
    used = 0
    count = offsets.shape[0] - 1
    offsets[0] = 0
    for i in range(count):
        if pos + 4 > buf.shape[0]:
            return -1
        size = (np.int64(buf[pos]) | (np.int64(buf[pos + 1]) << 8)
                | (np.int64(buf[pos + 2]) << 16) | (np.int64(buf[pos + 3]) << 24))
        pos += 4
        if pos + size > buf.shape[0]:
            return -1
        for j in range(size):
            out[used + j] = buf[pos + j]
        pos += size
        used += size
        offsets[i + 1] = used
    if pos != buf.shape[0]:
        return -1
    return count


def bytes_tensor(raw: memoryview | bytes, count: int) -> pa.Array:
    """A ``BYTES`` tensor of ``count`` elements as an Arrow ``binary`` column."""
    buf = np.frombuffer(raw, np.uint8)
    out = np.empty(max(0, len(buf) - 4 * count), np.uint8)
    offsets = np.empty(count + 1, np.int32)  # bodies are capped far below 2 GiB
    if len(buf) < 4 * count or _split_bytes(buf, out, offsets) != count:
        raise BinaryTensorError(f"{len(buf)} bytes do not hold {count} length-prefixed "
                                "elements")
    return pa.Array.from_buffers(pa.binary(), count,
                                 [None, pa.py_buffer(offsets), pa.py_buffer(out)])


def fixed_tensor(raw: memoryview | bytes, datatype: str, count: int) -> pa.Array:
    """A fixed-size tensor of ``count`` elements as an Arrow column (FP16 widened)."""
    dtype = FIXED_DTYPES[datatype]
    if len(raw) != count * dtype.itemsize:
        raise BinaryTensorError(f"{len(raw)} bytes, {count} {datatype} values take "
                                f"{count * dtype.itemsize}")
    values = np.frombuffer(raw, dtype)
    if datatype == "FP16":
        values = values.astype(np.float32)
    return pa.array(values)


def encode_bytes(values: list[bytes | str]) -> bytes:
    """The ``BYTES`` tensor encoding of ``values`` (for clients and tests)."""
    parts = []
    for v in values:
        b = v.encode() if isinstance(v, str) else v
        parts.append(len(b).to_bytes(4, "little"))
        parts.append(b)
    return b"".join(parts)
