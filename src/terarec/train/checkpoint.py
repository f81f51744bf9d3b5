"""Model directories and checkpoints, committed atomically at pass boundaries.

::

    model_dir/
      schema.json                 FeatureSchema: how raw rows become keys
      train_config.json           TrainConfig used
      checkpoints/
        pass-000003/              one committed pass (older ones pruned)
          dense.safetensors       model weights
          dense_optimizer.pt      dense optimizer state
          sparse/                 what ``store.save`` wrote; for a memory store:
            rows.safetensors        keys (sorted) + values + optimizer state + counters
                                  (older checkpoints: sparse.safetensors, still loaded)
                                  for a tiered store (docs/tiered-store.md):
            slab-NNNNNN.bin         disk-tier slabs, hard-linked from the previous
                                    checkpoint where unchanged since it
            index.safetensors       key -> slot
            store.safetensors       admission candidates, counters
          meta.json               pass id, history, sha256 of each file: written last
      LATEST                      name of the newest committed checkpoint
      BEST                        name of the best one on the validation set (training
                                  with --valid): kept out of pruning; what eval, predict
                                  and export load unless told otherwise

A checkpoint is written into a hidden temp folder, each file fsynced, the folder renamed
into place, then ``LATEST`` replaced atomically; a crash at any point leaves the previous
checkpoint intact and loadable. Each key's values and optimizer state are taken from the
same moment (the store between passes), never from two snapshots.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import numpy as np
import torch
from pydantic import ConfigDict, Field, with_config
from safetensors.numpy import load_file as load_numpy
from safetensors.torch import load_file as load_torch
from safetensors.torch import save_file as save_torch
from typing_extensions import NotRequired, TypedDict

from terarec.config import TrainConfig, from_dict, to_dict
from terarec.embedding.optimizers import SparseOptimizer
from terarec.embedding.protocol import EmbeddingStore
from terarec.embedding.store import CHUNK_ROWS, RowChunk, arrays_file, merge_sorted
from terarec.embedding.tiered import iter_saved, snapshot_arrays
from terarec.finite import check_trainer_finite
from terarec.io import atomic_write_text, fsync_dir, sha256_file
from terarec.models import row_dim_for
from terarec.types import FeatureSchema
from terarec.validation import validate_json

log = logging.getLogger(__name__)
KEEP_CHECKPOINTS = 2
LATEST_FILE = "LATEST"
BEST_FILE = "BEST"


class CheckpointError(ValueError):
    """A checkpoint that is missing, half-written or corrupted."""


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_model_meta(model_dir: Path, schema: FeatureSchema, config: TrainConfig) -> None:
    model_dir.mkdir(parents=True, exist_ok=True)
    schema.save(model_dir / "schema.json")
    atomic_write_text(model_dir / "train_config.json", json.dumps(to_dict(config), indent=2))


def read_model_meta(model_dir: Path) -> tuple[FeatureSchema, TrainConfig]:
    model_dir = Path(model_dir)
    if not (model_dir / "schema.json").exists():
        raise CheckpointError(f"{model_dir}: not a terarec model directory (no schema.json)")
    schema = FeatureSchema.load(model_dir / "schema.json")
    with open(model_dir / "train_config.json") as fh:
        config = from_dict(TrainConfig, json.load(fh))
    return schema, config


def save_checkpoint(model_dir: str | Path, trainer, extra: dict | None = None) -> Path:
    """Commit the trainer's state after its last pass as a new checkpoint."""
    check_trainer_finite(trainer)  # a diverged model never replaces a good checkpoint
    model_dir = Path(model_dir)
    write_model_meta(model_dir, trainer.schema, trainer.config)
    ckpt_root = model_dir / "checkpoints"
    ckpt_root.mkdir(parents=True, exist_ok=True)
    name = f"pass-{trainer.pass_id:06d}"
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=ckpt_root))
    try:
        dense = {k: v.detach().cpu().contiguous() for k, v in trainer.model.state_dict().items()}
        save_torch(dense, str(tmp / "dense.safetensors"))
        torch.save(trainer.dense_optimizer.state_dict(), tmp / "dense_optimizer.pt")
        files = ["dense.safetensors", "dense_optimizer.pt"]
        store = trainer.store
        # The store writes its own files (a tiered store never materialises its table).
        sparse_digests = {f"sparse/{name}": digest for name, digest in
                          store.save(tmp / "sparse").items()}
        files += list(sparse_digests)
        fsync_dir(tmp / "sparse")
        for f in files:
            _fsync_file(tmp / f)
        digests = {f: sparse_digests.get(f) or sha256_file(tmp / f) for f in files}
        meta = {
            "pass_id": trainer.pass_id,
            "history": trainer.history,
            "rng": {"torch": torch.get_rng_state().tolist()},
            "sha256": digests,
            "sparse_format": store.saved_format,
            "store": store_summary(store),
            **(extra or {}),
        }
        with open(tmp / "meta.json", "w") as fh:
            json.dump(meta, fh)
            fh.flush()
            os.fsync(fh.fileno())
        fsync_dir(tmp)
        final = ckpt_root / name
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        fsync_dir(ckpt_root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    store.committed(final / "sparse", {k[len("sparse/"):]: v for k, v in
                                       sparse_digests.items()})
    atomic_write_text(model_dir / LATEST_FILE, name)
    _prune(ckpt_root, keep=KEEP_CHECKPOINTS)
    return final


def store_summary(store: EmbeddingStore) -> dict:
    """Key counts and bytes per tier at commit time, for ``terarec inspect``."""
    out = asdict(store.stats())
    tiers = store.tier_stats()
    if tiers is not None:
        out["tiers"] = asdict(tiers)
    return out


def mark_best(model_dir: str | Path, name: str) -> None:
    """Point ``BEST`` at committed checkpoint ``name`` (atomically)."""
    model_dir = Path(model_dir)
    if not (model_dir / "checkpoints" / name / "meta.json").exists():
        raise CheckpointError(f"{model_dir}: no committed checkpoint {name} to mark best")
    atomic_write_text(model_dir / BEST_FILE, name)


def best_checkpoint(model_dir: str | Path) -> str | None:
    """The checkpoint ``BEST`` names, or None when there is none."""
    path = Path(model_dir) / BEST_FILE
    if not path.exists():
        return None
    return path.read_text().strip() or None


def clear_best(model_dir: str | Path) -> None:
    """Forget ``BEST`` (a fresh run into a directory an older run left one in)."""
    (Path(model_dir) / BEST_FILE).unlink(missing_ok=True)


def checkpoint_name(model_dir: str | Path, which: str = "best") -> str | None:
    """The checkpoint ``which`` selects: ``best`` (``BEST``, else the newest), ``latest``
    (None: the newest that verifies) or a name such as ``pass-3`` / ``pass-000003``."""
    if which == "latest":
        return None
    if which == "best":
        return best_checkpoint(model_dir)
    if which.startswith("pass-") and which[5:].isdigit():
        name = f"pass-{int(which[5:]):06d}"
        if not (Path(model_dir) / "checkpoints" / name).is_dir():
            have = ", ".join(p.name for p in list_checkpoints(model_dir)) or "none"
            raise CheckpointError(f"{model_dir}: no checkpoint {name} (have: {have})")
        return name
    raise ValueError(f"--checkpoint {which!r}: expected latest, best or pass-N")


def _prune(ckpt_root: Path, keep: int) -> None:
    """Drop all but the newest ``keep`` checkpoints, never the one ``BEST`` names."""
    done = sorted(p for p in ckpt_root.iterdir() if p.is_dir() and p.name.startswith("pass-"))
    best = best_checkpoint(ckpt_root.parent)
    for old in done[:-keep]:
        if old.name != best:
            shutil.rmtree(old, ignore_errors=True)
    for tmp in ckpt_root.glob(".pass-*"):
        shutil.rmtree(tmp, ignore_errors=True)


@with_config(ConfigDict(extra="allow", strict=True, allow_inf_nan=False))
class _RngState(TypedDict):
    torch: list[Annotated[int, Field(ge=0, le=255)]]


@with_config(ConfigDict(extra="allow", strict=True, allow_inf_nan=False))
class CheckpointMeta(TypedDict):
    """The keys of ``meta.json`` that restoring relies on (writers may add others)."""

    pass_id: Annotated[int, Field(ge=0)]
    sha256: dict[str, Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]]
    rng: _RngState
    history: NotRequired[list[dict[str, Any]]]
    sparse_format: NotRequired[Literal["arrays", "tiered"]]
    sparse_shards: NotRequired[list[str]]
    world_size: NotRequired[Annotated[int, Field(ge=1)]]


def verify_checkpoint(path: Path) -> dict:
    """Return the checkpoint's meta after validating it (``CheckpointMeta``) and checking
    every file's checksum."""
    meta_path = path / "meta.json"
    if not meta_path.exists():
        raise CheckpointError(f"{path}: half-written checkpoint (no meta.json)")
    try:
        meta: dict[str, Any] = dict(validate_json(CheckpointMeta, meta_path.read_bytes(),
                                                  str(meta_path), root="meta"))
    except ValueError as exc:
        raise CheckpointError(f"corrupted checkpoint: {exc}") from None
    for fname, digest in meta["sha256"].items():
        fpath = path / fname
        if not fpath.exists():
            raise CheckpointError(f"{fpath}: missing from checkpoint")
        if sha256_file(fpath) != digest:
            raise CheckpointError(f"{fpath}: checksum mismatch, the file is corrupted")
    return meta


def list_checkpoints(model_dir: str | Path) -> list[Path]:
    """Committed checkpoints, newest first."""
    root = Path(model_dir) / "checkpoints"
    if not root.exists():
        return []
    return sorted((p for p in root.iterdir() if p.is_dir() and p.name.startswith("pass-")),
                  reverse=True)


@dataclass
class LoadedCheckpoint:
    path: Path
    meta: dict
    dense: dict[str, torch.Tensor]
    dense_optimizer: dict

    @property
    def tiered(self) -> bool:
        return self.meta.get("sparse_format") == "tiered"

    @property
    def sparse_dir(self) -> Path:
        """The tiered store's snapshot folder (``tiered`` checkpoints)."""
        return self.path / "sparse"

    @property
    def sparse_source(self) -> Path:
        """What the store saved (``EmbeddingStore.load`` reads it): the ``sparse/``
        folder, or ``sparse.safetensors`` in checkpoints written before stores saved
        themselves."""
        return self.sparse_dir if self.sparse_dir.is_dir() else self.path / "sparse.safetensors"

    @property
    def sparse_digests(self) -> dict[str, str]:
        """sha256 of the files in ``sparse/``, by name inside it."""
        return {k[len("sparse/"):]: v for k, v in self.meta["sha256"].items()
                if k.startswith("sparse/")}

    def _dims(self) -> tuple[int, int]:
        """(row_dim, state_dim) of the stored rows, from the model directory's config."""
        _, config = read_model_meta(self.path.parents[1])
        row_dim = row_dim_for(config.model.name, config.model)
        return row_dim, SparseOptimizer(config.sparse_optimizer).state_dim(row_dim)

    def iter_sorted(self, chunk_rows: int = CHUNK_ROWS) -> Iterator[RowChunk]:
        """The stored rows in increasing key order, at most ``chunk_rows`` per chunk,
        whatever wrote them (either store, any number of torchrun ranks): exports and
        ``inspect`` read a checkpoint this way, never the whole table at once."""
        shards = self.meta.get("sparse_shards")
        if shards:
            yield from merge_sorted([iter_saved(self.path / name, chunk_rows)
                                     for name in shards], chunk_rows)
            return
        row_dim, state_dim = self._dims()
        yield from iter_saved(self.sparse_source, chunk_rows, row_dim, state_dim)

    @functools.cached_property
    def sparse(self) -> dict[str, np.ndarray]:
        """The store as sorted-key arrays (``MemoryStore.to_arrays`` form), read on first
        use; for a tiered checkpoint this materialises the table, so restoring a tiered
        store goes through ``sparse_dir`` instead."""
        if self.meta.get("sparse_shards"):
            return load_sparse(self.path, self.meta)
        rows = arrays_file(self.sparse_source)
        if rows is not None:
            return load_numpy(str(rows))
        return snapshot_arrays(self.sparse_dir, *self._dims())


def sparse_key_column(name: str) -> str | None:
    """Which key array orders sparse array ``name``: rows by ``keys``, admission
    candidates by ``cand_keys``; None for store-wide totals (``counters``, ``pruned``)."""
    if name in ("counters", "pruned"):
        return None
    return "cand_keys" if name.startswith("cand_") else "keys"


def load_sparse(path: Path, meta: dict) -> dict[str, np.ndarray]:
    """A checkpoint's sparse rows as one sorted-key table.

    A checkpoint written by N torchrun ranks lists one file per rank under
    ``sparse_shards`` (disjoint key sets): they are merged, so any number of processes
    can restore, export or score a model trained by any number of ranks.
    """
    shards = meta.get("sparse_shards")
    if not shards:
        return load_numpy(str(path / "sparse.safetensors"))
    parts = [load_numpy(str(path / name)) for name in shards]
    orders = {col: np.argsort(np.concatenate([p[col] for p in parts]), kind="stable")
              for col in ("keys", "cand_keys") if col in parts[0]}
    merged = {}
    for name in parts[0]:
        column = sparse_key_column(name)
        if column is None:
            merged[name] = np.sum([p[name] for p in parts], axis=0)
        else:
            merged[name] = np.concatenate([p[name] for p in parts])[orders[column]]
    return merged


def load_checkpoint(model_dir: str | Path, name: str | None = None) -> LoadedCheckpoint:
    """Load checkpoint ``name``, or the newest one that verifies.

    A corrupted newest checkpoint is refused with a logged message naming the problem,
    and the previous committed one is loaded instead.
    """
    model_dir = Path(model_dir)
    if name is not None:
        candidates = [model_dir / "checkpoints" / name]
    else:
        candidates = list_checkpoints(model_dir)
    if not candidates:
        raise CheckpointError(f"{model_dir}: no committed checkpoint")
    errors = []
    for path in candidates:
        try:
            meta = verify_checkpoint(path)
        except CheckpointError as exc:
            log.warning("refusing checkpoint: %s", exc)
            errors.append(str(exc))
            continue
        return LoadedCheckpoint(
            path=path, meta=meta,
            dense=load_torch(str(path / "dense.safetensors")),
            dense_optimizer=torch.load(path / "dense_optimizer.pt", weights_only=True))
    raise CheckpointError("no loadable checkpoint: " + "; ".join(errors))


def restore_trainer(model_dir: str | Path, config: TrainConfig | None = None,
                    name: str | None = None, scratch_dir: str | Path | None = None):
    """A Trainer holding the newest good checkpoint of ``model_dir``. Without ``config``
    (scoring a saved model) a tiered store lives in ``scratch_dir``, a folder private to
    this process (else a temp folder), never in the training run's live one."""
    from terarec.train.trainer import Trainer

    schema, saved_config = read_model_meta(Path(model_dir))
    if config is None:
        saved_config.store.disk_path = None if scratch_dir is None else str(scratch_dir)
    ckpt = load_checkpoint(model_dir, name)
    trainer = Trainer(schema, config or saved_config)
    trainer.model.load_state_dict(ckpt.dense)
    trainer.dense_optimizer.load_state_dict(ckpt.dense_optimizer)
    if ckpt.meta.get("sparse_shards"):
        trainer.store.load_arrays(ckpt.sparse)
    else:
        trainer.store.load(ckpt.sparse_source, ckpt.sparse_digests)
    trainer.pass_id = int(ckpt.meta["pass_id"])
    trainer.history = list(ckpt.meta.get("history", []))
    torch.set_rng_state(torch.tensor(ckpt.meta["rng"]["torch"], dtype=torch.uint8))
    return trainer
