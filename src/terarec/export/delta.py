"""A delta from a model directory against an export's newest version (``terarec export
--delta``): the rows that are new or changed since that version, the keys it held that
the checkpoint no longer does, and the dense weights. What ``train --export-to`` writes
after each pass, for a model trained elsewhere (another run, a job that only keeps its
model directory) whose previous version is already served."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from terarec.config import to_dict
from terarec.embedding.store import CHUNK_ROWS
from terarec.export.format import DEFAULT_SHARD_ROWS, ExportError, Manifest, read_manifest
from terarec.export.reader import VersionReader
from terarec.export.writer import (
    ExportedVersion,
    ModelExporter,
    as_json,
    check_same_part,
    model_features_dir,
)
from terarec.modeldir import checkpoint_name, load_checkpoint, read_model_meta
from terarec.models import row_dim_for


def version_rows(exporter: ModelExporter, manifest: Manifest) -> tuple[np.ndarray, np.ndarray]:
    """Every row of a version (its full version with its deltas applied), sorted by key."""
    with tempfile.TemporaryDirectory(prefix="terarec-rows-") as tmp:
        reader = VersionReader(exporter.storage, Path(tmp))
        base = read_manifest(exporter.storage, manifest.base)
        shards = reader.shards(base)
        keys = np.concatenate([np.array(k) for k, _ in shards]) if shards \
            else np.empty(0, np.int64)
        values = np.concatenate([np.array(v) for _, v in shards]) if shards \
            else np.empty((0, manifest.row_dim), np.float32)
        for name in manifest.deltas:
            upserts, rows, deleted = reader.delta(read_manifest(exporter.storage, name))
            keep = ~np.isin(keys, np.concatenate([upserts, deleted]))
            keys, values = np.concatenate([keys[keep], upserts]), np.concatenate(
                [values[keep], rows])
            order = np.argsort(keys, kind="stable")
            keys, values = keys[order], values[order]
    return keys, values


def row_diff(keys: np.ndarray, values: np.ndarray, old_keys: np.ndarray,
             old_values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(positions in sorted ``keys`` whose rows are new or changed, keys gone since)."""
    pos = np.minimum(np.searchsorted(old_keys, keys), max(len(old_keys) - 1, 0))
    known = (old_keys[pos] == keys) if len(old_keys) else np.zeros(len(keys), bool)
    changed = ~known
    if known.any() and values.size:
        changed[known] = (values[known] != old_values[pos[known]]).any(axis=1)
    return np.flatnonzero(changed), np.setdiff1d(old_keys, keys, assume_unique=True)


def export_model_delta(model_dir: str | Path, uri: str | Path,
                       storage_options: dict[str, Any] | None = None,
                       shard_rows: int = DEFAULT_SHARD_ROWS,
                       checkpoint: str = "best") -> ExportedVersion:
    """Write a checkpoint of ``model_dir`` as a delta on ``uri``'s newest version. That
    version must be of the same model (schema and model configuration), of the whole
    model and with fp32 rows; its rows are read back and compared with the checkpoint's,
    so the delta holds exactly what changed, whatever trained the model in between."""
    model_dir = Path(model_dir)
    schema, config = read_model_meta(model_dir)
    exporter = ModelExporter(uri, storage_options, shard_rows)
    where = exporter.storage.uri
    latest = exporter.latest()
    if latest is None:
        raise ExportError(f"--delta: {where} holds no version to build a delta on; "
                          f"export a full version there first (without --delta)")
    check_same_part(where, latest, None)
    differs = [what for what, key, ours in (
        ("schema", "schema", as_json(schema.to_dict())),
        ("model configuration", "model", as_json(to_dict(config.model))))
        if latest.data[key] != ours]
    if differs:
        what = differs[0]
        raise ExportError(f"--delta: {where}'s newest version {latest.name} is of another "
                          f"model ({what} differs from {model_dir}'s); export a full "
                          f"version instead")
    codec = read_manifest(exporter.storage, latest.base).data["sparse"].get("codec")
    if codec is not None:
        raise ExportError(f"--delta: {where}'s version {latest.base} holds {codec} rows; a "
                          f"delta is written on fp32 versions only (export a full one)")
    features = model_features_dir(model_dir)
    if ("features" in latest.data) != (features is not None):
        raise ExportError(f"--delta: {model_dir} and {where}'s newest version "
                          f"{latest.name} differ in AutoFeature tables; export a full "
                          f"version instead")
    ckpt = load_checkpoint(model_dir, checkpoint_name(model_dir, checkpoint))
    row_dim = row_dim_for(config.model.name, config.model)
    keys = [np.empty(0, np.int64)]
    values = [np.empty((0, row_dim), np.float32)]
    for chunk in ckpt.iter_sorted(CHUNK_ROWS):
        keys.append(np.asarray(chunk.keys, np.int64))
        values.append(np.asarray(chunk.values, np.float32))
    new_keys, new_values = np.concatenate(keys), np.concatenate(values)
    old_keys, old_values = version_rows(exporter, latest)
    changed, deleted = row_diff(new_keys, new_values, old_keys, old_values)
    return exporter.write_delta(dense=ckpt.dense, keys=new_keys[changed],
                                values=new_values[changed], deleted=deleted,
                                pass_id=int(ckpt.meta["pass_id"]))
