"""Writing versions: a full model from a checkpoint or a live trainer, and deltas during
training holding only what changed since the previous version.

Order of writes, for local folders and object stores alike: sparse shards, deleted keys,
dense weights, then ``manifest.json`` (with every file's sha256), then ``LATEST``. A
reader that finds a manifest finds every file it lists, whole.

Under torchrun (a ``DistContext`` of N ranks) a version is written by every rank
together, in the same format: readers need shards of disjoint, increasing key ranges,
while a rank owns keys by hash, so the ranks merge their key-ordered streams (a
distributed k-way merge) and each merged piece becomes one shard, written by one rank::

    every round   each rank offers the next shard_rows / N rows of its stream;
                  bound = the smallest last offered key among ranks with more to come
                  rows <= bound ──gather──> rank (round mod N), which merges them by key
                  and writes shard `round` (nothing later can sort before them)
    then          shard entries ──gather──> rank 0: deleted keys, dense weights,
                  manifest, LATEST

so a rank holds about one shard of rows at a time, and rank 0 writes the manifest only
once every rank's shard files are complete.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.numpy import save as save_numpy_bytes
from safetensors.torch import save as save_torch_bytes

from terarec.config import ModelConfig, to_dict
from terarec.distributed.context import DistContext
from terarec.embedding.store import CHUNK_ROWS
from terarec.embedding.types import RowChunk
from terarec.export.compressed import RowCodec, compress_rows, shard_bytes
from terarec.export.format import (
    CLAIM,
    DEFAULT_SHARD_ROWS,
    DELETED_FILE,
    DENSE_FILE,
    FORMAT,
    FORMAT_VERSION,
    LATEST,
    MANIFEST,
    SHOWS_FILE,
    SHOWS_LISTED,
    ExportError,
    Manifest,
    check_member_path,
    latest_version,
    list_versions,
    parse_version_name,
    rows_bytes,
    sha256_bytes,
    shard_name,
    version_name,
)
from terarec.export.reader import newest_readable, version_manifest
from terarec.export.storage import Storage, StorageError
from terarec.finite import check_finite
from terarec.kernels import grown
from terarec.modeldir import checkpoint_name, load_checkpoint, read_model_meta
from terarec.models import row_dim_for
from terarec.types import FeatureSchema

log = logging.getLogger(__name__)
FEATURES_DIR = "features"  # a version's copy of the model's AutoFeature tables


@dataclass
class ExportedVersion:
    """What one export wrote."""

    name: str
    kind: str
    rows: int
    deleted: int
    bytes: int
    seconds: float


class ModelExporter:
    """Writes versions of one model under one URI."""

    def __init__(self, uri: str | Path, storage_options: dict[str, Any] | None = None,
                 shard_rows: int = DEFAULT_SHARD_ROWS, codec: RowCodec | None = None) -> None:
        if shard_rows < 1:
            raise ValueError(f"shard_rows must be >= 1, got {shard_rows}")
        self.storage = Storage(uri, storage_options)
        self.shard_rows = shard_rows
        # Rows encoded for serving (export/compressed.py); None keeps plain fp32 values.
        self.codec = codec

    def latest(self) -> Manifest | None:
        """The newest version whose manifest can be read (``newest_readable``): the next
        version, full or delta, must be able to replace an unreadable one rather than
        fail on it. Each one skipped is logged."""
        return newest_readable(
            self.storage, latest_version(self.storage),
            lambda name: version_manifest(self.storage, name),
            lambda name, why: log.warning("%s: skipping version %s: %s",
                                          self.storage.uri, name, why))

    def _next_version(self) -> int:
        # Past every folder, half-written ones included: a name is never reused.
        numbers = [parse_version_name(n) or 0 for n in list_versions(self.storage)]
        return max(numbers, default=0) + 1

    def _claim_version(self) -> int:
        """The next version number, claimed so that a concurrent writer to the same URI
        never takes it too: a claim file created exclusively in the version folder
        (``O_EXCL`` locally, a conditional put on object stores)."""
        version = self._next_version()
        token = json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                            "time": time.time()}).encode()
        for _ in range(1000):
            if self.storage.create_exclusive(f"{version_name(version)}/{CLAIM}", token):
                return version
            version += 1  # taken by another writer since we listed
        raise ExportError(f"{self.storage.uri}: could not claim a version number after "
                          f"{version}")

    def _publish(self, name: str) -> None:
        """Point ``LATEST`` at ``name`` unless a concurrent writer already moved it to a
        newer version (it only moves forward)."""
        try:
            newest = parse_version_name(self.storage.read_bytes(LATEST).decode().strip())
        except (StorageError, UnicodeDecodeError):
            newest = None
        if newest is None or newest < (parse_version_name(name) or 0):
            self.storage.write_bytes(LATEST, name.encode())

    def write_full(self, *, schema: FeatureSchema, model_config: ModelConfig,
                   dense: dict[str, torch.Tensor], keys: np.ndarray | None = None,
                   values: np.ndarray | None = None, rows: Iterable[RowChunk] | None = None,
                   row_dim: int | None = None, pass_id: int,
                   features_dir: str | Path | None = None,
                   ctx: DistContext | None = None,
                   slice_info: dict[str, Any] | None = None) -> ExportedVersion:
        """A self-contained version: every row of the store and the dense weights, and the
        model's AutoFeature tables (``features_dir``) when it was trained with them.

        Rows come as ``keys`` + ``values`` arrays, or streamed as key-ordered ``rows``
        chunks (``EmbeddingStore.iter_sorted``) of ``row_dim`` values: then no more than
        one shard is held in RAM. Collective with a ``ctx`` of N ranks, each passing the
        rows it owns."""
        header: dict | None = None
        extra: dict[str, bytes] = {}
        if ctx is None or ctx.is_main:
            version = self._claim_version()
            name = version_name(version)
            header = {"name": name, "version": version, "kind": "full", "base": name,
                      "deltas": [], "parent": None, "schema": schema.to_dict(),
                      "model": to_dict(model_config)}
            if slice_info is not None:
                header["slice"] = slice_info
            if features_dir is not None:
                header["features"] = FEATURES_DIR
                extra = {f"{FEATURES_DIR}/{p.name}": p.read_bytes()
                         for p in sorted(Path(features_dir).iterdir()) if p.is_file()}
        if rows is None:
            if keys is None or values is None:
                raise ValueError("write_full needs keys and values, or rows")
            return self._write(header, dense, keys, values, None, pass_id, extra, ctx)
        if row_dim is None:
            raise ValueError("write_full with streamed rows needs row_dim")
        shows = _TopShows()  # each rank's most-shown keys, merged on rank 0
        return self._write_rows(header, dense, ((c.keys, c.values) for c in shows.watch(rows)),
                                row_dim, None, pass_id, extra, ctx, shows)

    def write_delta(self, *, dense: dict[str, torch.Tensor], keys: np.ndarray,
                    values: np.ndarray, deleted: np.ndarray, pass_id: int,
                    ctx: DistContext | None = None) -> ExportedVersion:
        """Rows upserted and keys deleted since the latest version, plus the dense weights.
        Collective with a ``ctx`` of N ranks, each passing its own keys."""
        header: dict | ExportError | None = None
        if ctx is None or ctx.is_main:
            parent = self.latest()
            if parent is None:
                header = ExportError(f"{self.storage.uri}: no version to build a delta on; "
                                     "write a full version first")
            else:
                version = self._claim_version()
                name = version_name(version)
                header = {"name": name, "version": version, "kind": "delta",
                          "base": parent.base, "deltas": [*parent.deltas, name],
                          "parent": parent.name, "schema": parent.data["schema"],
                          "model": parent.data["model"]}
                for key in ("features", "slice"):  # the base's tables; the same slice
                    if key in parent.data:
                        header[key] = parent.data[key]
        return self._write(header, dense, keys, values, deleted, pass_id, None, ctx)

    def _write(self, header: dict | ExportError | None, dense: dict[str, torch.Tensor],
               keys: np.ndarray, values: np.ndarray, deleted: np.ndarray | None,
               pass_id: int, extra: dict[str, bytes] | None = None,
               ctx: DistContext | None = None) -> ExportedVersion:
        values = np.asarray(values, np.float32)
        if values.ndim != 2 or len(values) != len(keys):
            raise ValueError(f"values of shape {values.shape} do not match {len(keys)} keys")
        return self._write_rows(header, dense, [(keys, values)], values.shape[1], deleted,
                                pass_id, extra, ctx)

    def _write_rows(self, header: dict | ExportError | None, dense: dict[str, torch.Tensor],
                    rows: Iterable[tuple[np.ndarray, np.ndarray]], row_dim: int,
                    deleted: np.ndarray | None, pass_id: int,
                    extra: dict[str, bytes] | None = None,
                    ctx: DistContext | None = None,
                    shows: _TopShows | None = None) -> ExportedVersion:
        """Write the version ``header`` describes (made on rank 0, or alone) from
        key-ordered (keys, values) parts, shard by shard; with ``shows`` (watching the
        parts), also SHOWS_FILE: the most-shown keys of every rank's rows."""
        t0 = time.perf_counter()
        ctx = ctx or DistContext.single(torch.device("cpu"))
        header = ctx.broadcast_object(header)
        if isinstance(header, ExportError):
            raise header
        assert header is not None
        name = header["name"]
        check_finite(dense, f"export {name} dense weights")  # rows: checked in _shards
        files: dict[str, dict] = {}

        def put(rel: str, data: bytes) -> None:
            check_member_path(rel, f"{self.storage.uri}/{name}")
            self.storage.write_bytes(f"{name}/{rel}", data)
            files[rel] = {"sha256": sha256_bytes(data), "bytes": len(data)}

        mine: list[tuple[int, dict]] = []
        pieces = (_shards(rows, self.shard_rows, row_dim) if ctx.world == 1
                  else _rank_shards(ctx, _checked(rows, row_dim), self.shard_rows))
        for i, (keys, values) in pieces:
            if mine and int(keys[0]) <= mine[-1][1]["last_key"]:
                raise ValueError("keys must be sorted and unique")
            if self.codec is None:
                put(shard_name(i), rows_bytes(keys, values))
            else:
                _check_fits(keys, values, self.codec)
                put(shard_name(i), shard_bytes(compress_rows(keys, values, self.codec)))
            mine.append((i, {"file": shard_name(i), "rows": len(keys),
                             "first_key": int(keys[0]), "last_key": int(keys[-1])}))
        # past here, every rank's shard files are complete
        top = (shows.keys, shows.shows) if shows is not None else None
        every_rank = ctx.gather_object((mine, files, deleted, top))
        result = None
        if ctx.is_main:
            assert every_rank is not None
            listed = [part[3] for part in every_rank if part[3] is not None]
            if listed:  # ranks own disjoint keys: the global top is the top of theirs
                extra = {**(extra or {}), SHOWS_FILE: _TopShows.merged(listed)}
            shards = [entry for _, entry in sorted((e for part in every_rank for e in part[0]),
                                                   key=lambda e: e[0])]
            files = {k: v for part in every_rank for k, v in part[1].items()}
            parts = [np.asarray(part[2], np.int64) for part in every_rank
                     if part[2] is not None]
            result = self._commit(header, files, shards,
                                  np.concatenate(parts) if parts else None, dense, extra,
                                  pass_id, row_dim, put, t0)
        return ctx.broadcast_object(result)

    def _commit(self, header: dict, files: dict[str, dict], shards: list[dict],
                deleted: np.ndarray | None, dense: dict[str, torch.Tensor],
                extra: dict[str, bytes] | None, pass_id: int, row_dim: int,
                put: Callable[[str, bytes], None], t0: float) -> ExportedVersion:
        """Deleted keys, dense weights, extra files, then the manifest and ``LATEST``."""
        name = header["name"]
        total = sum(s["rows"] for s in shards)
        sparse: dict[str, Any] = {"shards": shards, "rows": total, "deleted": 0}
        if self.codec is not None:
            sparse["codec"] = self.codec.name
        if deleted is not None:
            deleted = np.unique(deleted)
            put(DELETED_FILE, rows_bytes(deleted))
            sparse.update(deleted=int(len(deleted)), deleted_file=DELETED_FILE)
        state = {k: v.detach().cpu().contiguous() for k, v in dense.items()}
        put(DENSE_FILE, save_torch_bytes(state))
        for rel, data in (extra or {}).items():
            put(rel, data)
        manifest = Manifest({
            "format": FORMAT, "format_version": FORMAT_VERSION, **header,
            "pass_id": int(pass_id), "created": time.time(), "row_dim": int(row_dim),
            "dense": DENSE_FILE, "sparse": sparse, "files": files,
        })
        raw = manifest.to_bytes()
        self.storage.write_bytes(f"{name}/{MANIFEST}", raw)
        self._publish(name)
        written = sum(f["bytes"] for f in files.values()) + len(raw)
        result = ExportedVersion(name=name, kind=header["kind"], rows=total,
                                 deleted=sparse["deleted"], bytes=written,
                                 seconds=time.perf_counter() - t0)
        log.info("exported %s version %s: %d rows, %d deleted, %d bytes", result.kind, name,
                 result.rows, result.deleted, result.bytes)
        return result


class _TopShows:
    """The SHOWS_LISTED most-shown keys of the rows streamed through ``watch``, most shown
    first (a server's hot rows), held in bounded memory."""

    def __init__(self) -> None:
        self.keys = np.empty(0, np.int64)
        self.shows = np.empty(0, np.float32)

    def watch(self, rows: Iterable[RowChunk]) -> Iterator[RowChunk]:
        """``rows`` passed through; ``keys`` / ``shows`` are complete once exhausted."""
        key_parts, show_parts = [self.keys], [self.shows]
        held = 0
        for chunk in rows:
            key_parts.append(np.asarray(chunk.keys, np.int64))
            show_parts.append(np.asarray(chunk.show, np.float32))
            held += len(chunk.keys)
            if held > 2 * SHOWS_LISTED:  # keep the top SHOWS_LISTED so far
                keys, shows = np.concatenate(key_parts), np.concatenate(show_parts)
                top = np.argpartition(-shows, SHOWS_LISTED)[:SHOWS_LISTED]
                key_parts, show_parts, held = [keys[top]], [shows[top]], SHOWS_LISTED
            yield chunk
        self.keys, self.shows = self._top(np.concatenate(key_parts),
                                          np.concatenate(show_parts))

    @staticmethod
    def _top(keys: np.ndarray, shows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        order = np.lexsort((keys, -shows))[:SHOWS_LISTED]
        return np.ascontiguousarray(keys[order]), np.ascontiguousarray(shows[order])

    @classmethod
    def merged(cls, parts: list[tuple[np.ndarray, np.ndarray]]) -> bytes:
        """SHOWS_FILE's bytes: the top of several (keys, shows) lists of disjoint keys."""
        keys, shows = cls._top(np.concatenate([np.asarray(k, np.int64) for k, _ in parts]),
                               np.concatenate([np.asarray(v, np.float32) for _, v in parts]))
        return save_numpy_bytes({"keys": keys, "shows": shows})


def _checked(rows: Iterable[tuple[np.ndarray, np.ndarray]], row_dim: int
             ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Key-ordered (keys, values) parts as contiguous int64 / float32, checked for shape,
    order (within and across parts) and finiteness."""
    last: int | None = None  # the previous part's last key
    for keys, values in rows:
        keys = np.ascontiguousarray(keys, np.int64)
        values = np.ascontiguousarray(values, np.float32)
        if values.shape != (len(keys), row_dim):
            raise ValueError(f"values of shape {values.shape} do not match {len(keys)} keys "
                             f"of {row_dim} values")
        if (len(keys) > 1 and not bool(np.all(keys[1:] > keys[:-1]))) or (
                len(keys) and last is not None and int(keys[0]) <= last):
            raise ValueError("keys must be sorted and unique")
        if len(keys):
            last = int(keys[-1])
        bad = ~np.isfinite(values).all(axis=1)
        if bad.any():
            raise ValueError(f"{int(bad.sum())} rows hold non-finite values (first key "
                             f"{int(keys[bad][0])}): refusing to export them")
        yield keys, values


def _check_fits(keys: np.ndarray, values: np.ndarray, codec: RowCodec) -> None:
    """fp16 rows hold at most +-65504; the encoder's own error named the row's position
    in its shard, not its key."""
    if codec.bits != 16 or codec.codebook or not len(keys):
        return
    big = np.abs(values).max(axis=1) > float(np.finfo(np.float16).max)
    if big.any():
        raise ValueError(f"{int(big.sum())} rows hold values beyond +-65504, which fp16 "
                         f"(--bits 16) cannot store (first key {int(keys[big][0])}): "
                         "export them at --bits 32 or 8")


def _rank_shards(ctx: DistContext, rows: Iterator[tuple[np.ndarray, np.ndarray]],
                 shard_rows: int) -> Iterator[tuple[int, tuple[np.ndarray, np.ndarray]]]:
    """Collective: (index, (keys, values)) of the shards this rank writes, cut from the
    k-way merge of every rank's key-ordered rows (see the module docstring)."""
    hold = max(1, shard_rows // ctx.world)
    keys_buf: list[np.ndarray] = []
    values_buf: list[np.ndarray] = []
    held, done, index = 0, False, 0
    while True:
        while not done and held < hold:
            part = next(rows, None)
            if part is None:
                done = True
            elif len(part[0]):
                keys_buf.append(part[0])
                values_buf.append(part[1])
                held += len(part[0])
        keys = np.concatenate(keys_buf) if keys_buf else np.empty(0, np.int64)
        # Offer the first `hold` rows: the last of them bounds the round unless they are
        # this rank's last rows.
        last = int(keys[min(held, hold) - 1]) if held else None
        status = ctx.all_gather_object((last, not done or held > hold, held))
        if all(h == 0 for _, _, h in status) and all(not c for _, c, _ in status):
            return
        bounds = [k for k, bounding, _ in status if bounding and k is not None]
        n = (int(np.searchsorted(keys[:hold], min(bounds), side="right")) if bounds
             else min(held, hold))
        values = np.concatenate(values_buf) if values_buf else np.empty((0, 0), np.float32)
        send = (keys[:n], values[:n])
        keys_buf, values_buf = ([keys[n:]], [values[n:]]) if n < held else ([], [])
        held -= n
        parts = ctx.gather_object(send, dst=index % ctx.world)
        if parts is not None:
            merged = np.concatenate([k for k, _ in parts])
            order = np.argsort(merged, kind="stable")
            yield index, (merged[order], np.concatenate(
                [v for _, v in parts if len(v)])[order])
        index += 1


def _shards(rows: Iterable[tuple[np.ndarray, np.ndarray]], shard_rows: int,
            row_dim: int) -> Iterator[tuple[int, tuple[np.ndarray, np.ndarray]]]:
    """Re-cut key-ordered (keys, values) parts into numbered shards of ``shard_rows`` rows
    (the last one shorter), checking them on the way (``_checked``). Holds one shard
    buffer (filled in place) plus one part; each yielded shard is a view of the buffer,
    valid until the next one is asked for. The buffer grows with the rows it is given,
    up to ``shard_rows``: a ``shard_rows`` beyond the table's size costs no memory."""
    keys_buf = np.empty(0, np.int64)
    values_buf = np.empty((0, row_dim), np.float32)
    held = index = 0
    for keys, values in _checked(rows, row_dim):
        pos = 0
        while pos < len(keys):
            take = min(shard_rows - held, len(keys) - pos)
            if held + take > len(keys_buf):  # at least double, so rows are copied O(1) times
                size = min(shard_rows, max(held + take, 2 * len(keys_buf)))
                keys_buf = grown(keys_buf, size, double=False)
                values_buf = grown(values_buf, size, double=False)
            keys_buf[held:held + take] = keys[pos:pos + take]
            values_buf[held:held + take] = values[pos:pos + take]
            held, pos = held + take, pos + take
            if held == shard_rows:
                yield index, (keys_buf, values_buf)
                index += 1
                held = 0
    if held:
        yield index, (keys_buf[:held], values_buf[:held])


def as_json(value: Any) -> Any:
    """``value`` as a manifest holds it once read back (tuples become lists)."""
    return json.loads(json.dumps(value))


def export_model_dir(model_dir: str | Path, uri: str | Path,
                     storage_options: dict[str, Any] | None = None,
                     shard_rows: int = DEFAULT_SHARD_ROWS,
                     codec: RowCodec | None = None,
                     checkpoint: str = "best") -> ExportedVersion:
    """Write a checkpoint of a model directory as a full version (rows encoded with
    ``codec`` when given): ``checkpoint`` is best (the validation set's best, else the
    newest good one), latest, or pass-N."""
    schema, config = read_model_meta(Path(model_dir))
    ckpt = load_checkpoint(model_dir, checkpoint_name(model_dir, checkpoint))
    exporter = ModelExporter(uri, storage_options, shard_rows, codec)
    check_same_part(exporter.storage.uri, exporter.latest(), None)
    return exporter.write_full(schema=schema, model_config=config.model, dense=ckpt.dense,
                               rows=ckpt.iter_sorted(CHUNK_ROWS),
                               row_dim=row_dim_for(config.model.name, config.model),
                               pass_id=int(ckpt.meta["pass_id"]),
                               features_dir=model_features_dir(model_dir))


def check_same_part(uri: str, latest: Manifest | None, slice_name: str | None) -> None:
    """A version of a whole model (``slice_name`` None) or of slice ``slice_name`` goes
    only where the newest version holds the same: written over another part, it silently
    became what a server or an index of the URI loads (an item index built from user
    tower rows, a ranking server left with one tower)."""
    held = (latest.data.get("slice") or {}).get("name") if latest is not None else None
    if latest is None or held == slice_name:
        return

    def what(name: str | None) -> str:
        return f"slice {name!r}" if name is not None else "a whole model"

    raise ExportError(f"{uri} holds {what(held)} (newest version {latest.name}); export "
                      f"{what(slice_name)} to a URI of its own")


def model_features_dir(model_dir: str | Path) -> Path | None:
    """The AutoFeature tables a model directory carries, or None."""
    from terarec.autofeature.features import CONFIG_FILE, MODEL_FEATURES_DIR

    path = Path(model_dir) / MODEL_FEATURES_DIR
    return path if (path / CONFIG_FILE).exists() else None


class IncrementalExporter:
    """Exports a training run: a full version at the first export, then deltas.

    Hook ``on_pass_end`` into ``Trainer.fit``; a delta is written every ``every_passes``
    passes and/or once ``every_minutes`` have passed since the previous export (at the
    next pass boundary), holding the rows of every key trained since the previous export
    and the keys evicted since then.

    When the target's newest version was exported at exactly the trainer's pass (a
    resumed run), deltas continue from it, the first one due at the first pass end (the
    server has waited while the run was down); otherwise the first export is a full
    version, since evictions between that version and this trainer's state are unknown.
    """

    def __init__(self, uri: str | Path, trainer, *, every_passes: int | None = None,
                 every_minutes: float | None = None,
                 storage_options: dict[str, Any] | None = None,
                 shard_rows: int = DEFAULT_SHARD_ROWS,
                 clock: Callable[[], float] = time.monotonic,
                 features_dir: str | Path | None = None,
                 full_every_hours: float | None = None, full_at: str | None = None,
                 wall_clock: Callable[[], float] = time.time) -> None:
        # NaN or inf compared as > 0 and never came due: refused with the others.
        if full_every_hours is not None and not 0 < full_every_hours < float("inf"):
            raise ValueError(f"a full version every {full_every_hours} hours: must be > 0 "
                             "and finite")
        self.full_at = parse_hhmm(full_at) if full_at is not None else None
        if every_passes is not None and every_passes < 1:
            raise ValueError(f"delta every {every_passes} passes: must be >= 1")
        if every_minutes is not None and not 0 < every_minutes < float("inf"):
            raise ValueError(f"delta every {every_minutes} minutes: must be > 0 and finite")
        self.exporter = ModelExporter(uri, storage_options, shard_rows)
        self.features_dir = features_dir  # AutoFeature tables, sent with full versions
        self.every_passes = every_passes
        self.every_minutes = every_minutes
        self.exported: list[ExportedVersion] = []
        trainer.store.track_evictions()
        self.ctx: DistContext = trainer.ctx  # on N ranks every export is collective
        self._last_pass: int | None = None  # trainer.pass_id at the previous export
        self._clock = clock
        self._last_time = clock()
        # A full version on a schedule (the off-peak rebuild); deltas between them.
        self.full_every_hours = full_every_hours
        self._last_full_time = clock()
        self._wall_clock = wall_clock
        self._last_full_wall = wall_clock()
        reading: bool | ExportError = False  # resumes, or why the target does not fit
        if self.ctx.is_main:  # rank 0 reads the target; every rank follows its reading
            latest = self.exporter.latest()
            try:
                check_same_part(self.exporter.storage.uri, latest, None)
                reading = (latest is not None and latest.pass_id == trainer.pass_id
                           and latest.data["schema"] == as_json(trainer.schema.to_dict())
                           and latest.data["model"] == as_json(
                               to_dict(trainer.config.model)))
            except ExportError as exc:
                reading = exc
        reading = self.ctx.broadcast_object(reading)
        if isinstance(reading, ExportError):
            raise reading
        if reading:
            self._last_pass = trainer.pass_id
            if every_minutes is not None:  # restarted: the server waited; export at once
                self._last_time = clock() - every_minutes * 60.0

    def due(self, trainer) -> bool:
        if self._last_pass is None:
            return True
        passes = trainer.pass_id - self._last_pass
        if passes <= 0:
            return False
        if self.every_passes is not None and passes >= self.every_passes:
            return True
        minutes = (self._clock() - self._last_time) / 60.0
        return self.every_minutes is not None and minutes >= self.every_minutes

    def full_due(self, trainer) -> bool:
        """A scheduled full version is due (and something was trained since the last)."""
        if self._last_pass is None or trainer.pass_id <= self._last_pass:
            return False
        if self.full_at is not None:  # the latest daily time passed since the last full
            now = self._wall_clock()
            if self._last_full_wall < _latest_daily(now, *self.full_at) <= now:
                return True
        if self.full_every_hours is None:
            return False
        hours = (self._clock() - self._last_full_time) / 3600.0
        return hours >= self.full_every_hours

    def on_pass_end(self, trainer, record: dict | None = None) -> ExportedVersion | None:
        """Export if a delta (or a scheduled full version) is due; also called while a
        followed source has no new file, so deltas keep to the clock."""
        # Rank 0's clock decides, so that every rank joins the same exports.
        due = self.ctx.broadcast_object((self.due(trainer), self.full_due(trainer)))
        if due[1]:
            return self.export(trainer, full=True)
        return self.export(trainer) if due[0] else None

    def finish(self, trainer) -> ExportedVersion | None:
        """Export whatever the last passes changed, if anything was trained since."""
        if self._last_pass is not None and trainer.pass_id == self._last_pass:
            return None
        return self.export(trainer)

    def export(self, trainer, full: bool = False) -> ExportedVersion:
        """Write a version now (collective on N ranks: each passes the rows it owns)."""
        trainer.sync_store()  # rows newer on the device are exported
        dense = trainer.model.state_dict()
        store = trainer.store
        if full or self._last_pass is None:
            self._last_full_time = self._clock()
            self._last_full_wall = self._wall_clock()
            store.take_evicted()  # a full version supersedes every earlier deletion
            result = self.exporter.write_full(
                schema=trainer.schema, model_config=trainer.config.model, dense=dense,
                rows=store.iter_sorted(CHUNK_ROWS), row_dim=store.row_dim,
                pass_id=trainer.pass_id, features_dir=self.features_dir, ctx=self.ctx)
        else:
            keys, values = store.changed_since(self._last_pass)
            evicted = store.take_evicted()
            # A key evicted and admitted again since the last export is an upsert.
            deleted = np.setdiff1d(evicted, keys, assume_unique=True)
            result = self.exporter.write_delta(dense=dense, keys=keys, values=values,
                                               deleted=deleted, pass_id=trainer.pass_id,
                                               ctx=self.ctx)
        self._last_pass = trainer.pass_id
        self._last_time = self._clock()
        self.exported.append(result)
        return result


def parse_hhmm(text: str) -> tuple[int, int]:
    """``HH:MM`` (local time) as (hour, minute)."""
    try:
        hour, minute = (int(x) for x in text.split(":"))
    except ValueError:
        raise ValueError(f"full version time {text!r}: expected HH:MM") from None
    if not (0 <= hour < 24 and 0 <= minute < 60):
        raise ValueError(f"full version time {text!r}: expected HH:MM, 00:00 to 23:59")
    return hour, minute


def _latest_daily(now: float, hour: int, minute: int) -> float:
    """The most recent local ``hour:minute`` at or before ``now`` (a Unix time)."""
    from datetime import datetime, timedelta

    moment = datetime.fromtimestamp(now)
    today = moment.replace(hour=hour, minute=minute, second=0, microsecond=0)
    return (today if today <= moment else today - timedelta(days=1)).timestamp()
