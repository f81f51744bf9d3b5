"""What a published model looks like in the cluster: row keys, row values in the version's
codec, and the control keys that announce versions and track which servers use them.

::

    NS/VERSION/<8 key bytes>    one row, encoded as the version's shards are (fp32 bytes,
                                fp16, int8..int1 with scale/bias; codebook codecs prefix
                                the 2-byte shard whose codebook decodes it); in a delta,
                                an empty value is a deleted key
    {NS}:announced              ZSET version name -> number: versions whose rows are all in
    {NS}:meta:VERSION           HASH: manifest, codec, parts published, announce time
    {NS}:keys:VERSION           a delta's touched keys (int64, sorted): upserts and deletions
    {NS}:shows:BASE             a full version's most-shown keys (int64), most shown first
    {NS}:codebooks:VERSION      HASH shard -> float32 levels (codebook codecs)
    {NS}:servers                ZSET "server-id version" -> expiry (servers re-register)

Row keys have no hash tag, so rows spread over every slot; control keys share the tag
``{NS}``, so they live on one shard and can change together.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from terarec.export.compressed import CompressedRows, RowCodec, decode_selected
from terarec.export.format import Manifest

_NAMESPACE_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


def check_namespace(ns: str) -> str:
    if not _NAMESPACE_RE.match(ns):
        raise ValueError(f"sparse tier namespace {ns!r}: use 1-64 letters, digits, '_', "
                         "'.' or '-'")
    return ns


@dataclass(frozen=True)
class Layout:
    """Key names of one namespace (one model) in the cluster."""

    ns: str

    def __post_init__(self) -> None:
        check_namespace(self.ns)

    def rows(self, version: str) -> bytes:
        return f"{self.ns}/{version}/".encode()

    def control(self, what: str, version: str | None = None) -> str:
        return f"{{{self.ns}}}:{what}" + (f":{version}" if version else "")

    @property
    def announced(self) -> str:
        return self.control("announced")

    @property
    def servers(self) -> str:
        return self.control("servers")


@dataclass(frozen=True)
class RowFormat:
    """How one version's rows are stored as Redis values."""

    dim: int
    codec: RowCodec | None  # None: fp32 rows

    @classmethod
    def of(cls, manifest: Manifest) -> RowFormat:
        name = manifest.data["sparse"].get("codec")
        return cls(manifest.row_dim, None if name is None else RowCodec.parse(name))

    @property
    def name(self) -> str:
        return "fp32" if self.codec is None else self.codec.name

    @property
    def prefix_bytes(self) -> int:
        """A codebook codec's value starts with its shard number (uint16)."""
        return 2 if self.codec is not None and self.codec.codebook else 0

    @property
    def width(self) -> int:
        body = 4 * self.dim if self.codec is None else self.codec.row_bytes(self.dim)
        return self.prefix_bytes + body

    def encode(self, values: object, shard: int) -> np.ndarray:
        """``uint8[n, width]`` of one shard's rows (fp32 rows, or EncodedRows kept as
        their codes)."""
        if self.codec is None:
            rows = np.ascontiguousarray(values, "<f4")
            return rows.view(np.uint8).reshape(len(rows), self.width)
        codes = np.ascontiguousarray(values.encoded.codes, np.uint8)  # type: ignore[attr-defined]
        if not self.prefix_bytes:
            return codes
        out = np.empty((len(codes), self.width), np.uint8)
        out[:, :2] = np.frombuffer(np.uint16(shard).astype("<u2").tobytes(), np.uint8)
        out[:, 2:] = codes
        return out

    def decode(self, values: np.ndarray, codebooks: dict[int, np.ndarray] | None = None
               ) -> np.ndarray:
        """float32 ``[n, dim]`` rows of ``uint8[n, width]`` values."""
        n = len(values)
        if self.codec is None:
            return np.ascontiguousarray(values).view("<f4").reshape(n, self.dim).astype(
                np.float32)
        out = np.zeros((n, self.dim), np.float32)
        if not n:
            return out
        if not self.prefix_bytes:
            return decode_selected(CompressedRows(np.empty(0, np.int64), values, self.dim,
                                                  self.codec), np.arange(n))
        shard = np.ascontiguousarray(values[:, :2]).view("<u2").ravel()
        for s in np.unique(shard):
            sel = np.flatnonzero(shard == s)
            book = (codebooks or {}).get(int(s))
            if book is None:
                raise ValueError(f"no codebook for shard {int(s)}")
            out[sel] = decode_selected(
                CompressedRows(np.empty(0, np.int64), np.ascontiguousarray(values[sel, 2:]),
                               self.dim, self.codec, book), np.arange(len(sel)))
        return out
