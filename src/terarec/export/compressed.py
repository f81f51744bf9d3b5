"""Compressed sparse shards for serving: sorted keys plus rows at 1-32 bits per value.

Training keeps rows at fp32..int4 (``embedding/compression.py``); a served model only
reads them, so it can go further. ``compress_rows`` turns sorted keys and fp32 rows into
one ``CompressedRows``; ``decompress_rows`` gives back the float32 rows a server scores
with (the same rows an offline evaluation of the compressed model uses, so the two agree
exactly). Codecs::

    bits 32 / 16      fp32 / fp16 copies
    bits 8, 4, 2, 1   row-wise scale and bias (FBGEMM style; 1 bit: per-row 2-means levels)
    codebook=True     2**bits shared k-means levels times an fp16 row scale
                      (quant.fit_codebook / encode_codebook with row_scaled=True)

On disk a shard is one safetensors file: ``keys`` int64[n], ``codes`` uint8[n, B] and,
for codebooks, ``codebook`` float32[2**bits]; the metadata says how to decode
(``codec``, ``dim``, ``bits``). A reader memory-maps it and decodes only the rows it
needs (``decode_selected``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from safetensors import safe_open
from safetensors.numpy import load_file, save

from terarec.embedding.quant import (
    RowRangeError,
    codebook_row_bytes,
    decode_codebook,
    decode_rows,
    encode_codebook,
    encode_rows,
    fit_codebook,
    row_bytes,
)
from terarec.io import atomic_write_bytes

FORMAT = "terarec-compressed-rows-v1"
_PRECISION_BY_BITS = {32: "fp32", 16: "fp16", 8: "int8", 4: "int4", 2: "int2", 1: "int1"}
CODEBOOK_BITS = (1, 2, 4, 8)


@dataclass(frozen=True)
class RowCodec:
    """How rows are encoded: ``bits`` per value, with shared levels if ``codebook``."""

    bits: int = 8
    codebook: bool = False

    def __post_init__(self) -> None:
        if self.bits not in _PRECISION_BY_BITS:
            raise ValueError(f"bits must be one of {sorted(_PRECISION_BY_BITS)}, got "
                             f"{self.bits!r}")
        if self.codebook and self.bits not in CODEBOOK_BITS:
            raise ValueError(f"codebook rows take {CODEBOOK_BITS} bits, got {self.bits}")

    @property
    def name(self) -> str:
        return f"cb{self.bits}" if self.codebook else _PRECISION_BY_BITS[self.bits]

    @classmethod
    def parse(cls, name: str) -> RowCodec:
        """``fp32``, ``fp16``, ``int8`` .. ``int1`` or ``cb8`` .. ``cb1``."""
        for bits, precision in _PRECISION_BY_BITS.items():
            if name == precision:
                return cls(bits)
        if name.startswith("cb") and name[2:].isdigit():
            return cls(int(name[2:]), codebook=True)
        raise ValueError(f"unknown row codec {name!r}; expected fp32, fp16, int8, int4, int2, "
                         "int1 or cb8, cb4, cb2, cb1")

    def row_bytes(self, dim: int) -> int:
        if self.codebook:
            return codebook_row_bytes(self.bits, dim, row_scaled=True)
        return row_bytes(_PRECISION_BY_BITS[self.bits], dim)  # type: ignore[arg-type]


@dataclass
class CompressedRows:
    """Sorted keys and their encoded rows."""

    keys: np.ndarray
    codes: np.ndarray
    dim: int
    codec: RowCodec
    codebook: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.keys)

    @property
    def nbytes(self) -> int:
        """Bytes of the encoded values (codes + row scale/bias + shared levels), no keys."""
        extra = 0 if self.codebook is None else self.codebook.nbytes
        return int(self.codes.nbytes) + extra

    @property
    def bytes_per_key(self) -> float:
        return self.codec.row_bytes(self.dim)


def compress_rows(keys: np.ndarray, values: np.ndarray, codec: RowCodec,
                  *, seed: int = 0) -> CompressedRows:
    """Encode ``values[i]`` (fp32 ``[n, dim]``) of sorted unique ``keys[i]``."""
    keys = np.ascontiguousarray(keys, np.int64)
    values = np.ascontiguousarray(values, np.float32)
    if values.ndim != 2 or len(values) != len(keys):
        raise ValueError(f"compress_rows: values must be [len(keys)={len(keys)}, dim], got "
                         f"shape {values.shape}")
    if len(keys) > 1 and not (np.diff(keys) > 0).all():
        raise ValueError("compress_rows: keys must be sorted and unique")
    dim = values.shape[1]
    if codec.codebook:
        if len(keys) == 0 or not values.any():
            levels = np.linspace(-1.0, 1.0, 1 << codec.bits).astype(np.float32)
        else:
            levels = fit_codebook(values, codec.bits, seed=seed, row_scaled=True)
        codes = encode_codebook(values, levels, row_scaled=True)
        return CompressedRows(keys, codes, dim, codec, levels)
    precision = _PRECISION_BY_BITS[codec.bits]
    try:
        codes = encode_rows(values, precision)  # type: ignore[arg-type]
    except RowRangeError as exc:  # the row's key, not its index in this chunk
        raise ValueError(f"export: key {int(keys[exc.row])}: its row {exc.what}") from None
    return CompressedRows(keys, codes, dim, codec)


def decode_selected(rows: CompressedRows, index: np.ndarray) -> np.ndarray:
    """float32 rows at positions ``index`` (into ``rows.keys``)."""
    codes = rows.codes[np.asarray(index, np.int64)]
    if rows.codec.codebook:
        assert rows.codebook is not None
        return decode_codebook(codes, rows.codebook, rows.dim, row_scaled=True)
    return decode_rows(codes, _PRECISION_BY_BITS[rows.codec.bits], rows.dim)  # type: ignore


class EncodedRows:
    """A shard's encoded rows (often a memory map) indexed like a float32 ``[n, dim]``
    array: ``rows[positions]`` decodes just those rows, so a server holds codes in memory
    and pays the decoding only for the keys a request touches."""

    def __init__(self, codes: np.ndarray, dim: int, codec: RowCodec,
                 codebook: np.ndarray | None = None) -> None:
        if codes.ndim != 2 or codes.shape[1] != codec.row_bytes(dim):
            raise ValueError(f"codes of shape {codes.shape} are not {codec.name} rows of "
                             f"dim {dim} ({codec.row_bytes(dim)} bytes each)")
        if codec.codebook and (codebook is None or len(codebook) != 1 << codec.bits):
            raise ValueError(f"{codec.name} rows need a codebook of {1 << codec.bits} levels")
        self._rows = CompressedRows(np.empty(0, np.int64), codes, dim, codec,
                                    None if codebook is None else np.asarray(codebook))

    @property
    def shape(self) -> tuple[int, int]:
        return (len(self._rows.codes), self._rows.dim)

    @property
    def encoded(self) -> CompressedRows:
        """The codes (and codebook) themselves, for copying rows without decoding them."""
        return self._rows

    def __len__(self) -> int:
        return len(self._rows.codes)

    def __getitem__(self, index) -> np.ndarray:
        if isinstance(index, slice):
            index = np.arange(*index.indices(len(self)))
        return decode_selected(self._rows, np.atleast_1d(np.asarray(index, np.int64)))

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        out = decode_selected(self._rows, np.arange(len(self)))
        return out if dtype is None else out.astype(dtype)


def decompress_rows(rows: CompressedRows) -> np.ndarray:
    """All rows back as float32 ``[n, dim]``."""
    return decode_selected(rows, np.arange(len(rows)))


def lookup_rows(rows: CompressedRows, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Decoded rows of ``keys`` (zero rows where absent) and the found mask."""
    keys = np.asarray(keys, np.int64)
    pos = np.searchsorted(rows.keys, keys)
    pos_clipped = np.minimum(pos, max(len(rows) - 1, 0))
    found = (pos < len(rows)) & (rows.keys[pos_clipped] == keys) if len(rows) else (
        np.zeros(len(keys), bool))
    out = np.zeros((len(keys), rows.dim), np.float32)
    if found.any():
        out[found] = decode_selected(rows, pos_clipped[found])
    return out, found


def shard_bytes(rows: CompressedRows) -> bytes:
    """One shard as safetensors bytes (for any storage that writes bytes)."""
    tensors = {"keys": rows.keys, "codes": rows.codes}
    if rows.codebook is not None:
        tensors["codebook"] = rows.codebook
    meta = {"format": FORMAT, "codec": rows.codec.name, "dim": str(rows.dim)}
    return save(tensors, metadata=meta)


def save_compressed(rows: CompressedRows, path: str | Path) -> None:
    """Write one shard (safetensors, atomically: a reader never sees half a file)."""
    atomic_write_bytes(path, shard_bytes(rows))


def load_compressed(path: str | Path) -> CompressedRows:
    """Read a shard written by :func:`save_compressed`, checking its layout."""
    with safe_open(str(path), framework="numpy") as fh:
        meta = fh.metadata() or {}
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path}: not a compressed row shard (format "
                         f"{meta.get('format')!r}, expected {FORMAT!r})")
    codec = RowCodec.parse(meta["codec"])
    dim = int(meta["dim"])
    tensors = load_file(str(path))
    keys, codes = tensors["keys"], tensors["codes"]
    if codes.shape != (len(keys), codec.row_bytes(dim)):
        raise ValueError(f"{path}: codes have shape {codes.shape}, expected "
                         f"({len(keys)}, {codec.row_bytes(dim)}) for {codec.name} rows of "
                         f"dim {dim}")
    return CompressedRows(keys, codes, dim, codec, tensors.get("codebook"))
