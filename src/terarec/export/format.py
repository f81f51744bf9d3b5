"""The export layout: versions of a model, each a folder with a manifest written last.

::

    URI/
      LATEST                          name of the newest version (a hint, written last)
      v000001/                        a full version
        dense.safetensors             the network's weights (state_dict)
        sparse/shard-00000.safetensors   keys int64 [n] (sorted) + values float32 [n, row_dim]
        sparse/shard-00001.safetensors   ... shards hold disjoint, increasing key ranges
        sparse/shows.safetensors      the most-shown keys and their show counts (optional)
        manifest.json                 written after every file it lists
      v000002/                        a delta on v000001
        dense.safetensors             the whole network again (a few MB)
        sparse/shard-00000.safetensors   rows changed since v000001 (upserts)
        sparse/deleted.safetensors    keys removed since v000001 (evicted)
        manifest.json

A version's rows are ``base`` with its ``deltas`` applied in order; within one delta,
deletions apply before upserts (a key evicted and re-admitted ends up present). Rows hold
values only: optimizer state stays in training checkpoints.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import mmap
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import Field, with_config
from safetensors.numpy import save as save_numpy_bytes
from typing_extensions import NotRequired, TypedDict

from terarec.export.storage import Storage, StorageError
from terarec.validation import STRICT, InvalidInput, validate_json

FORMAT = "terarec-export"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
DEFAULT_SHARD_ROWS = 1 << 20  # sparse rows per shard file of a version
LATEST = "LATEST"
CLAIM = ".claim"  # created exclusively by the writer that takes a version number
DENSE_FILE = "dense.safetensors"
DELETED_FILE = "sparse/deleted.safetensors"
# The most-shown keys of a full version (keys int64, shows float32, most shown first): what
# a server with a sparse tier keeps in local memory (serving/cluster.py).
SHOWS_FILE = "sparse/shows.safetensors"
SHOWS_LISTED = 1 << 22
_VERSION_RE = re.compile(r"^v(\d{6,})$")
_DTYPES = {"I64": np.int64, "F32": np.float32, "F16": np.float16, "I32": np.int32,
           "F64": np.float64, "U8": np.uint8}


class ExportError(ValueError):
    """A version that is missing, half-written, corrupted or inconsistent with its chain."""


def version_name(version: int) -> str:
    return f"v{version:06d}"


def parse_version_name(name: str) -> int | None:
    match = _VERSION_RE.match(name)
    return int(match.group(1)) if match else None


def shard_name(i: int) -> str:
    return f"sparse/shard-{i:05d}.safetensors"


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def rows_bytes(keys: np.ndarray, values: np.ndarray | None = None) -> bytes:
    """A safetensors blob of ``keys`` (and ``values``), the shape of every sparse file."""
    tensors = {"keys": np.ascontiguousarray(keys, np.int64)}
    if values is not None:
        tensors["values"] = np.ascontiguousarray(values, np.float32)
    return save_numpy_bytes(tensors)


_Count = Annotated[int, Field(ge=0)]


@with_config(STRICT)
class FileEntry(TypedDict):
    sha256: Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]
    bytes: _Count


@with_config(STRICT)
class ShardEntry(TypedDict):
    file: str
    rows: _Count
    first_key: int
    last_key: int


@with_config(STRICT)
class SparseSection(TypedDict):
    shards: list[ShardEntry]
    rows: _Count
    deleted: _Count
    deleted_file: NotRequired[str]
    codec: NotRequired[str]


@with_config(STRICT)
class ManifestBody(TypedDict):
    """What ``manifest.json`` holds; ``Manifest.parse`` validates against it."""

    format: Literal["terarec-export"]
    format_version: Literal[1]
    name: str
    version: Annotated[int, Field(ge=1)]
    kind: Literal["full", "delta"]
    base: str
    deltas: list[str]
    parent: NotRequired[str | None]
    schema: dict[str, Any]  # FeatureSchema.to_dict(), validated when a reader builds it
    model: dict[str, Any]  # ModelConfig, likewise
    features: NotRequired[str]
    # A model slice (retrieval/slices.py): which fields' keys and which layers it holds.
    slice: NotRequired[dict[str, Any]]
    pass_id: _Count
    created: float
    row_dim: Annotated[int, Field(ge=1)]
    dense: str
    sparse: SparseSection
    files: dict[str, FileEntry]


@dataclass(frozen=True)
class Manifest:
    """One version's manifest: what it is, what it builds on and what its files hold."""

    data: dict[str, Any]

    @property
    def name(self) -> str:
        return self.data["name"]

    @property
    def version(self) -> int:
        return int(self.data["version"])

    @property
    def kind(self) -> str:
        return self.data["kind"]

    @property
    def base(self) -> str:
        """The full version this one's chain starts from (itself for a full version)."""
        return self.data["base"]

    @property
    def deltas(self) -> list[str]:
        """Deltas applied on ``base``, oldest first, ending with this one for a delta."""
        return list(self.data["deltas"])

    @property
    def chain(self) -> list[str]:
        return [self.base, *self.deltas]

    @property
    def pass_id(self) -> int:
        return int(self.data["pass_id"])

    @property
    def created(self) -> float:
        return float(self.data["created"])

    @property
    def row_dim(self) -> int:
        return int(self.data["row_dim"])

    @property
    def files(self) -> dict[str, dict]:
        return self.data["files"]

    @property
    def shards(self) -> list[dict]:
        return self.data["sparse"]["shards"]

    @classmethod
    def parse(cls, raw: bytes, where: str) -> Manifest:
        """A manifest from its JSON bytes, validated against ``ManifestBody``; anything
        else is an ``ExportError`` naming the file and the JSON path of the problem."""
        try:
            data = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ExportError(f"{where}: manifest is not valid JSON ({exc})") from None
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ExportError(f"{where}: not a {FORMAT} manifest")
        if data.get("format_version") != FORMAT_VERSION:
            raise ExportError(f"{where}: format_version {data.get('format_version')!r} is not "
                              f"{FORMAT_VERSION}")
        try:
            body = validate_json(ManifestBody, raw, where, root="manifest")
        except InvalidInput as exc:
            raise ExportError(str(exc)) from None
        check_manifest_paths(dict(body), where)
        return cls(dict(body))

    def to_bytes(self) -> bytes:
        return json.dumps(self.data, indent=2).encode()


def check_member_path(rel: Any, where: str) -> str:
    """``rel`` when it names a file inside its version folder: relative, ``/``-separated,
    without ``..`` or empty parts, so no manifest (or writer) reaches another version's
    files or anything outside the export."""
    if (not isinstance(rel, str) or not rel or rel.startswith("/") or "\\" in rel
            or "\0" in rel or any(part in ("", ".", "..") for part in rel.split("/"))):
        raise ExportError(f"{where}: path {rel!r} is not a plain relative path inside the "
                          "version folder")
    return rel


def check_manifest_paths(data: dict[str, Any], where: str) -> None:
    """Every path a (schema-valid) manifest names stays inside its version, and every
    file it reads is listed with its size and sha256."""
    files, sparse = data["files"], data["sparse"]
    for rel in files:
        check_member_path(rel, f"{where}: files")
    named = [("dense", data["dense"])]
    named += [(f"sparse.shards[{i}].file", s["file"]) for i, s in enumerate(sparse["shards"])]
    if sparse.get("deleted_file") is not None:
        named.append(("sparse.deleted_file", sparse["deleted_file"]))
    for field_name, rel in named:
        check_member_path(rel, f"{where}: {field_name}")
        if rel not in files:
            raise ExportError(f"{where}: {field_name} {rel!r} is not listed in 'files'")
    if data.get("features") is not None:
        check_member_path(data["features"], f"{where}: features")


def read_manifest(storage: Storage, name: str) -> Manifest:
    """The manifest of version ``name``; a version without one is half-written."""
    try:
        raw = storage.read_bytes(f"{name}/{MANIFEST}")
    except StorageError:
        raise ExportError(f"{storage.uri}: version {name} has no manifest "
                          "(missing or half-written)") from None
    manifest = Manifest.parse(raw, f"{storage.uri}/{name}/{MANIFEST}")
    if manifest.name != name:
        raise ExportError(f"{storage.uri}/{name}: manifest names version {manifest.name!r}")
    return manifest


def list_versions(storage: Storage) -> list[str]:
    """Version folder names, oldest first (including half-written ones)."""
    names = [n for n in storage.list_names() if parse_version_name(n) is not None]
    return sorted(names, key=lambda n: parse_version_name(n) or 0)


def latest_version(storage: Storage) -> str | None:
    """The newest version with a manifest: ``LATEST`` when it is readable and points at
    one, else the newest folder holding a manifest. None for an empty export."""
    try:
        name = storage.read_bytes(LATEST).decode().strip()
        if parse_version_name(name) is not None and storage.exists(f"{name}/{MANIFEST}"):
            return name
    except (StorageError, UnicodeDecodeError):
        pass
    for name in reversed(list_versions(storage)):
        if storage.exists(f"{name}/{MANIFEST}"):
            return name
    return None


# -- reading safetensors files without copying them ---------------------------------------

def safetensors_header(path: Path) -> tuple[dict, int]:
    """(header, byte offset of the data section) of a safetensors file."""
    with open(path, "rb") as fh:
        head = fh.read(8)
        if len(head) != 8:
            raise ExportError(f"{path}: truncated safetensors file")
        (size,) = struct.unpack("<Q", head)
        if size > 100 << 20:
            raise ExportError(f"{path}: implausible safetensors header size {size}")
        raw = fh.read(size)
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ExportError(f"{path}: corrupted safetensors header ({exc})") from None
    header.pop("__metadata__", None)
    return header, 8 + size


def mappings_of(*arrays: Any) -> list[mmap.mmap]:
    """The memory maps behind ``arrays`` (``memmap_tensors`` views; encoded rows'
    ``codes``), found through each array's ``base`` chain."""
    found: list[mmap.mmap] = []
    for array in arrays:
        base = array.encoded.codes if hasattr(array, "encoded") else array
        while base is not None:
            if isinstance(base, mmap.mmap):
                if not any(m is base for m in found):
                    found.append(base)
                break
            base = base.obj if isinstance(base, memoryview) else getattr(base, "base", None)
    return found


def release_mapped(*arrays: Any) -> None:
    """Unmap the pages of the files behind ``arrays`` that this process touched: they
    stay in the page cache, but mapped they count in its resident set, so reading a
    whole shard once (the load-time check) would hold all of it there."""
    for m in mappings_of(*arrays):
        with contextlib.suppress(ValueError, OSError):
            m.madvise(mmap.MADV_DONTNEED)


def memmap_tensors(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of a safetensors file as a read-only view of one memory map of the
    whole file (no bytes read yet). The map is each array's ``base``: its ``size()``
    against its length tells a reader the file was truncated underneath
    (``serving/rows.py``)."""
    header, start = safetensors_header(path)
    size = path.stat().st_size
    out: dict[str, np.ndarray] = {}
    whole: mmap.mmap | None = None
    for name, info in header.items():
        dtype = _DTYPES.get(info.get("dtype"))
        if dtype is None:
            raise ExportError(f"{path}: tensor {name!r} has unsupported dtype {info.get('dtype')}")
        shape = tuple(int(s) for s in info["shape"])
        lo, hi = (int(x) for x in info["data_offsets"])
        if start + hi > size or hi - lo != int(np.prod(shape)) * np.dtype(dtype).itemsize:
            raise ExportError(f"{path}: tensor {name!r} does not fit the file")
        if hi == lo:
            out[name] = np.empty(shape, dtype)
            continue
        if whole is None:
            with open(path, "rb") as fh:
                whole = mmap.mmap(fh.fileno(), size, access=mmap.ACCESS_READ)
        out[name] = np.frombuffer(whole, dtype=dtype, count=int(np.prod(shape)),
                                  offset=start + lo).reshape(shape)
    return out
