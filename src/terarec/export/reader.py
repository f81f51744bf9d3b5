"""Reading exported versions (the layout in export/format.py), the other half of writer.py.

Every file is first copied into ``cache_dir`` (downloaded when remote) and the copy is
verified against the manifest's size and sha256 before anything maps or loads it: what a
server maps is a private copy nobody else writes, so the export may be truncated,
rewritten or deleted underneath it. Each method raises ``ExportError`` naming the version
and file when something does not fit, ``IncompleteVersionError`` when a file or manifest
is not there (yet).
"""

from __future__ import annotations

import contextlib
import shutil
import stat
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file as load_torch_file

from terarec.autofeature.candidates import AutoFeatureError
from terarec.autofeature.features import CONFIG_FILE, FeatureConfig
from terarec.config import ModelConfig, from_dict
from terarec.export.compressed import EncodedRows, RowCodec
from terarec.export.format import (
    MANIFEST,
    SHOWS_FILE,
    ExportError,
    Manifest,
    latest_version,
    list_versions,
    memmap_tensors,
    parse_version_name,
    read_manifest,
    release_mapped,
)
from terarec.export.storage import Storage, StorageError
from terarec.io import sha256_file, waiting_lock
from terarec.models import build_model
from terarec.models.base import CTRModel
from terarec.types import FeatureSchema

FETCH_LOCK = ".fetch.lock"
Rows = tuple[np.ndarray, np.ndarray]  # keys [n] int64, values [n, row_dim] (maybe encoded)


class IncompleteVersionError(ExportError):
    """A version whose manifest or some of its files are not there (yet): still being
    copied or uploaded. A server retries it for a while before refusing it."""


def version_manifest(storage: Storage, name: str) -> Manifest:
    """A version's manifest; a missing one may still be arriving (``IncompleteVersionError``)."""
    try:
        if not storage.exists(f"{name}/{MANIFEST}"):
            raise IncompleteVersionError(f"{storage.uri}: version {name} has no "
                                         "manifest (yet)")
        return read_manifest(storage, name)
    except StorageError as exc:
        raise ExportError(str(exc)) from None


def newest_readable(storage: Storage, newest: str | None,
                    read: Callable[[str], Manifest],
                    refused: Callable[[str, str], None]) -> Manifest | None:
    """The manifest of version ``newest`` (what ``LATEST`` names) or, when it is
    unreadable, of the newest older version with a readable one, ``refused(name, why)``
    told of each one passed over; older half-written versions (no manifest) are skipped,
    and None if ``newest`` itself has gone. A broken newest manifest must not hide the
    versions before it: servers serve them, writers build on them, publish sends them."""
    if newest is None:
        return None
    try:
        return read(newest)
    except IncompleteVersionError:
        return None  # removed since it was named
    except ExportError as exc:
        refused(newest, str(exc))
    number = parse_version_name(newest) or 0
    for name in reversed(list_versions(storage)):
        if (parse_version_name(name) or 0) >= number:
            continue
        try:
            return read(name)
        except IncompleteVersionError:
            continue  # half-written: no manifest
        except ExportError as exc:
            refused(name, str(exc))
    return None


class VersionReader:
    """Manifests, verified files, rows and networks of the versions under ``storage``;
    files are served from private copies under ``cache_dir``."""

    def __init__(self, storage: Storage, cache_dir: Path) -> None:
        self.storage = storage
        self.cache_dir = cache_dir

    def latest(self) -> str | None:
        return latest_version(self.storage)

    def manifest(self, name: str) -> Manifest:
        """A version's manifest; a missing one may still be arriving."""
        return version_manifest(self.storage, name)

    def fetch(self, manifest: Manifest, rel: str) -> Path:
        """A private copy of one of the version's files, verified (size and sha256)
        before anything maps it. A missing file, or a local one shorter than listed, is
        an incomplete version (it may still be arriving: an object store's PUT is atomic,
        a local ``cp`` is not); a wrong checksum is a corrupted one."""
        info = manifest.files.get(rel)
        if info is None:
            raise ExportError(f"{manifest.name}: {rel} is not listed in the manifest")
        # Servers sharing ``cache_dir`` (serve --workers) copy one file at a time, so
        # that the second finds the first's copy (and maps the same pages). Without a
        # lock (the folder cannot be written) the copy below says why.
        with contextlib.ExitStack() as stack:
            try:
                self.cache_dir.mkdir(parents=True, exist_ok=True)
                stack.enter_context(waiting_lock(self.cache_dir / FETCH_LOCK))
            except OSError:
                pass
            return self._fetch(manifest, rel, info)

    def _fetch(self, manifest: Manifest, rel: str, info: dict[str, Any]) -> Path:
        source = f"{manifest.name}/{rel}"
        path = self.cache_dir / manifest.name / rel
        size, digest = int(info["bytes"]), info["sha256"]
        self._check_local(manifest.name, rel)
        if path.exists() and path.stat().st_size == size and sha256_file(path) == digest:
            return path  # copied for an earlier version of the same content
        try:
            self.storage.download(source, path)
        except StorageError:
            raise IncompleteVersionError(f"{self.storage.uri}/{source}: missing") from None
        except OSError as exc:  # e.g. our disk is full: retried, then refused
            raise IncompleteVersionError(f"{self.storage.uri}/{source}: cannot copy it to "
                                         f"{path} ({exc})") from None
        got = path.stat().st_size
        if got != size:
            path.unlink(missing_ok=True)  # a bad copy is not kept
            message = f"{self.storage.uri}/{source}: {got} bytes, the manifest says {size}"
            if got < size and self.storage.is_local:
                raise IncompleteVersionError(message)
            raise ExportError(message)
        if sha256_file(path) != digest:
            path.unlink(missing_ok=True)
            raise ExportError(f"{self.storage.uri}/{source}: checksum mismatch, the file is "
                              "corrupted or was replaced")
        with contextlib.suppress(OSError):
            path.chmod(0o444)  # a mapped copy: nothing should write it in place
        return path

    def _check_local(self, name: str, rel: str) -> None:
        """Refuse a local version file that is, or lies under, a symbolic link, resolves
        outside its version folder, or is not a regular file: a manifest's paths are
        checked as text (``check_member_path``), but a link planted in the folder would
        still have the server copy (and log) whatever it points at."""
        version = self.storage.local_path(name)
        if version is None:
            return
        where = f"{self.storage.uri}/{name}/{rel}"
        current = version
        for part in ["", *rel.split("/")]:
            current = current / part if part else current
            if current.is_symlink():
                raise ExportError(f"{where}: {current} is a symbolic link; a version's "
                                  "files must be regular files inside its folder")
        local = version / rel
        try:
            inside = local.resolve().is_relative_to(version.resolve())
            regular = stat.S_ISREG(local.stat().st_mode)
        except OSError:
            return  # missing: the copy below says so (an incomplete version)
        if not inside or not regular:
            raise ExportError(f"{where}: not a regular file inside the version folder")

    def tensors(self, manifest: Manifest, rel: str, need: Sequence[str]
                ) -> dict[str, np.ndarray]:
        tensors = memmap_tensors(self.fetch(manifest, rel))
        lacking = [n for n in need if n not in tensors]
        if lacking:
            raise ExportError(f"{manifest.name}/{rel}: lacks tensors {lacking}")
        return tensors

    def schema(self, manifest: Manifest) -> FeatureSchema:
        try:
            return FeatureSchema.from_dict(manifest.data["schema"])
        except ValueError as exc:
            raise ExportError(f"{manifest.name}: bad feature schema ({exc})") from None

    def network(self, manifest: Manifest, schema: FeatureSchema) -> CTRModel:
        """The version's dense network, weights loaded, in eval mode."""
        try:
            config = from_dict(ModelConfig, manifest.data["model"])
            model = build_model(schema, config)
        except (ValueError, TypeError, KeyError) as exc:
            raise ExportError(f"{manifest.name}: bad model config ({exc})") from None
        path = self.fetch(manifest, manifest.data["dense"])
        try:
            state = load_torch_file(str(path))
        except Exception as exc:  # safetensors raises its own error types
            raise ExportError(f"{manifest.name}: unreadable dense weights ({exc})") from None
        try:
            if "slice" in manifest.data:
                _load_slice_state(model, state, manifest)
            else:
                model.load_state_dict(state, strict=True)
        except RuntimeError as exc:
            raise ExportError(f"{manifest.name}: dense weights do not fit the model "
                              f"({str(exc).splitlines()[0]})") from None
        for key, tensor in model.state_dict().items():
            if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                raise ExportError(f"{manifest.name}: dense weight {key!r} holds non-finite "
                                  "values")
        if model.row_dim != manifest.row_dim:
            raise ExportError(f"{manifest.name}: rows have {manifest.row_dim} floats, the "
                              f"model needs {model.row_dim}")
        return model.eval()

    def rows(self, manifest: Manifest, shard: dict[str, Any]) -> Rows:
        """One sparse shard's keys and values (memory-mapped; encoded rows decode per
        lookup, export/compressed.py)."""
        rel, rows = shard["file"], int(shard["rows"])
        codec = manifest.data["sparse"].get("codec")
        values: Any
        if codec is not None:
            t = self.tensors(manifest, rel, ("keys", "codes"))
            try:
                values = EncodedRows(t["codes"], manifest.row_dim, RowCodec.parse(codec),
                                     t.get("codebook"))
            except ValueError as exc:
                raise ExportError(f"{manifest.name}/{rel}: {exc}") from None
        else:
            t = self.tensors(manifest, rel, ("keys", "values"))
            values = t["values"]
        keys = t["keys"]
        if keys.shape != (rows,) or values.shape != (rows, manifest.row_dim):
            raise ExportError(f"{manifest.name}/{rel}: holds keys {keys.shape} and values "
                              f"{values.shape}, the manifest says {rows} rows of "
                              f"{manifest.row_dim}")
        if len(keys) and (int(keys[0]) != shard["first_key"]
                          or int(keys[-1]) != shard["last_key"]):
            raise ExportError(f"{manifest.name}/{rel}: key range differs from the manifest")
        check_rows(f"{manifest.name}/{rel}", keys, values)
        return keys, values

    def shards(self, manifest: Manifest) -> list[Rows]:
        """The non-empty shards of a version, in key order."""
        return [r for r in (self.rows(manifest, s) for s in manifest.shards) if len(r[0])]

    def delta(self, manifest: Manifest) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(upserted keys, their rows as fp32, deleted keys) of a delta version."""
        keys, values = [], []
        for shard in manifest.shards:
            k, v = self.rows(manifest, shard)
            keys.append(np.array(k))
            values.append(np.array(v))
        upserts = np.concatenate(keys) if keys else np.empty(0, np.int64)
        rows = (np.concatenate(values) if values
                else np.empty((0, manifest.row_dim), np.float32))
        deleted = np.empty(0, np.int64)
        sparse = manifest.data["sparse"]
        if sparse.get("deleted_file"):
            deleted = np.array(self.tensors(manifest, sparse["deleted_file"], ("keys",))["keys"])
            if len(deleted) != int(sparse["deleted"]):
                raise ExportError(f"{manifest.name}: {len(deleted)} deleted keys, the "
                                  f"manifest says {sparse['deleted']}")
        return upserts, rows, deleted

    def shows(self, manifest: Manifest) -> tuple[np.ndarray, np.ndarray] | None:
        """(keys, show counts) of the version's most-shown keys, most shown first; None
        when the export lists none (an older export)."""
        if SHOWS_FILE not in manifest.files:
            return None
        t = self.tensors(manifest, SHOWS_FILE, ("keys", "shows"))
        return np.array(t["keys"]), np.array(t["shows"])

    def features(self, manifest: Manifest) -> FeatureConfig | None:
        """The version's AutoFeature tables, verified, if it lists any."""
        folder = manifest.data.get("features")
        if folder is None:
            return None
        local = [self.fetch(manifest, rel) for rel in manifest.files
                 if rel.startswith(f"{folder}/")]
        if not local:
            raise ExportError(f"{manifest.name}: lists feature tables but holds none")
        try:
            return FeatureConfig.load(local[0].parent / CONFIG_FILE)
        except (AutoFeatureError, OSError) as exc:
            raise ExportError(f"{manifest.name}: bad feature tables ({exc})") from None

    def prune_downloads(self, keep: Iterable[str]) -> None:
        """Drop private copies of versions not in ``keep`` (a version still scoring a
        request keeps its mapped files: unlinked files stay readable)."""
        if not self.cache_dir.exists():
            return
        names = set(keep)
        for folder in self.cache_dir.iterdir():
            if (folder.is_dir() and folder.name not in names
                    and parse_version_name(folder.name) is not None):
                shutil.rmtree(folder, ignore_errors=True)


CHECK_ROWS = 1 << 18  # rows checked at a time: bounded temporaries on any shard size


def check_rows(where: str, keys: np.ndarray, values: Any) -> None:
    """Refuse a shard a checksum cannot fault: keys not strictly increasing (lookups
    binary-search them, so such a shard serves wrong rows) or a value that is not finite
    (every score touching it would be NaN). Read once, a slice at a time, when a version
    is loaded; encoded rows are checked decoded."""
    n = len(keys)
    for lo in range(0, n, CHECK_ROWS):
        hi = min(lo + CHECK_ROWS, n)
        k = np.asarray(keys[lo:min(hi + 1, n)])
        rising = k[1:] > k[:-1]
        if not bool(rising.all()):
            at = lo + int(np.argmin(rising)) + 1
            raise ExportError(f"{where}: keys are not sorted and unique (row {at}, key "
                              f"{int(keys[at])} after {int(keys[at - 1])})")
        finite = np.isfinite(np.asarray(values[lo:hi], np.float32)).all(axis=1)
        if not bool(finite.all()):
            at = lo + int(np.argmin(finite))
            raise ExportError(f"{where}: the row of key {int(keys[at])} (row {at}) holds a "
                              "non-finite value")
        release_mapped(keys, values)  # a shard read whole would stay resident


def _load_slice_state(model: CTRModel, state: dict[str, Any], manifest: Manifest) -> None:
    """Load a slice's weights: exactly its layers' (``slice.modules``: state-dict key
    prefixes, all when absent); every other parameter is zero, so a layer the slice
    leaves out contributes nothing rather than random weights."""
    prefixes = manifest.data["slice"].get("modules")
    own = model.state_dict()
    needed = {k for k in own if prefixes is None or any(k.startswith(p) for p in prefixes)}
    if set(state) != needed:
        missing, extra = sorted(needed - set(state)), sorted(set(state) - needed)
        raise RuntimeError(f"slice {manifest.data['slice'].get('name')!r}: missing "
                           f"{missing[:5]}, unexpected {extra[:5]}")
    with torch.no_grad():
        for key, tensor in own.items():
            if key not in needed and tensor.is_floating_point():
                tensor.zero_()
    model.load_state_dict({**own, **state}, strict=True)
