"""Model directories and checkpoints, committed atomically at pass boundaries, by one
process or by all the ranks of a torchrun job together.

::

    model_dir/
      schema.json                 FeatureSchema: how raw rows become keys
      train_config.json           TrainConfig used
      checkpoints/
        pass-000003/              one committed pass (older ones pruned)
          dense.safetensors       model weights                  (rank 0; equal on all)
          dense_optimizer.pt      dense optimizer state          (rank 0)
          sparse/                 one process: what ``store.save`` wrote; for a memory
            rows.safetensors        store keys (sorted) + values + optimizer state +
                                    counters; for a tiered store (docs/tiered-store.md):
            slab-NNNNNN.bin         disk-tier slabs, hard-linked from the previous
                                    checkpoint where unchanged since it
            index.safetensors       key -> slot
            store.safetensors       admission candidates, counters
          sparse-0000R-of-0000N/  instead, N torchrun ranks: rank R's keys, saved the same
                                  way by its store
          dense_comm-0000R-of-0000N.pt  rank R's unsent DGC residuals (dgc only)
          meta.json               pass id, world size, shard list, history, sha256 of
                                  each file: written last, by rank 0
      LATEST                      name of the newest committed checkpoint
      BEST                        name of the best one on the validation set (training
                                  with --valid): kept out of pruning; what eval, predict
                                  and export load unless told otherwise

One process writes one shard (``sparse/``), N ranks one each. Checkpoints from before
this layout still load: ``sparse.safetensors`` (one process, before stores saved
themselves) and ``sparse-0000R-of-0000N.safetensors`` files (N ranks).

Commit: rank 0 makes a hidden staging folder; every rank writes and fsyncs its files
into it; the checksums are gathered to rank 0 (nobody gets past that point before every
rank's files are durable); rank 0 writes the manifest, renames the folder into place and
replaces ``LATEST``; a final barrier returns once the pass is committed. A crash (of any
rank) at any point leaves the previous checkpoint intact and loadable. Each key's values
and optimizer state are taken from the same moment (the store between passes). Alone,
every collective is free. On several nodes the model directory must be on a
filesystem every rank sees.

Restoring works at any world size: with the shard count of the checkpoint, each rank
reads its own shard (a tiered store adopts its slab files); otherwise every rank reads
the shards one by one and keeps the keys it now owns (``shard_of``).
"""

from __future__ import annotations

import errno
import functools
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
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

from terarec.config import TrainConfig, load_train_config, to_dict
from terarec.distributed.context import DistContext, resolve_device
from terarec.distributed.dense_comm import DenseCommConfig
from terarec.distributed.sharding import shard_of
from terarec.embedding.admission import SKETCH_ARRAY
from terarec.embedding.optimizers import SparseOptimizer
from terarec.embedding.protocol import EmbeddingStore
from terarec.embedding.store import CHUNK_ROWS, STORE_TOTALS, arrays_file, merge_sorted
from terarec.embedding.tiered import iter_saved, saved_extras, snapshot_arrays
from terarec.embedding.types import RowChunk
from terarec.finite import check_trainer_finite
from terarec.io import (
    NotWritableError,
    atomic_write_text,
    fsync_dir,
    sha256_file,
    write_text_if_changed,
)
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
    """The model's schema and configuration, written with every checkpoint (rewritten
    only where they changed)."""
    model_dir.mkdir(parents=True, exist_ok=True)
    write_text_if_changed(model_dir / "schema.json", schema.json_text)
    write_train_config(model_dir, config)


def write_train_config(model_dir: Path, config: TrainConfig) -> None:
    """``model_dir/train_config.json``, what ``read_model_meta`` reads back."""
    write_text_if_changed(model_dir / "train_config.json",
                          json.dumps(to_dict(config), indent=2))


def read_model_meta(model_dir: Path) -> tuple[FeatureSchema, TrainConfig]:
    model_dir = Path(model_dir)
    if not (model_dir / "schema.json").exists():
        raise CheckpointError(f"{model_dir}: not a terarec model directory (no schema.json)")
    schema = FeatureSchema.load(model_dir / "schema.json")
    if not (model_dir / "train_config.json").exists():
        raise CheckpointError(f"{model_dir}: train_config.json is missing")
    return schema, load_train_config(model_dir / "train_config.json")


def shard_name(rank: int, world: int) -> str:
    """Rank ``rank``'s sparse shard: the folder its store saves itself into."""
    return "sparse" if world == 1 else f"sparse-{rank:05d}-of-{world:05d}"


def comm_file(rank: int, world: int) -> str:
    return f"dense_comm-{rank:05d}-of-{world:05d}.pt"


def _durable(path: Path, files: dict[str, str], rel: str | None = None) -> None:
    _fsync_file(path)
    files[rel or path.name] = sha256_file(path)


def save_checkpoint(model_dir: str | Path, trainer, extra: dict | None = None,
                    pinned: str | None = None, rng: list[int] | None = None) -> Path:
    """Commit the trainer's state after its last pass as a new checkpoint; collective
    when the trainer is one of N ranks. ``pinned``: a checkpoint the pruning of older
    ones keeps (besides ``BEST``). ``rng``: torch's random state to record, taken when
    the pass ended (a commit written later, on another thread, cannot read it then)."""
    trainer.sync_store()  # rows newer on the device go into the checkpoint
    check_trainer_finite(trainer)  # a diverged model never replaces a good checkpoint
    ctx: DistContext = trainer.ctx
    model_dir = Path(model_dir)
    root = model_dir / "checkpoints"
    name = f"pass-{trainer.pass_id:06d}"
    staging: Path | None = None
    if ctx.is_main:
        write_model_meta(model_dir, trainer.schema, trainer.config)
        root.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=root))
    staging = Path(ctx.broadcast_object(str(staging)))
    ctx.barrier()
    if not staging.is_dir():
        raise CheckpointError(f"rank {ctx.rank}: {staging} is not visible; the model "
                              "directory must be on a filesystem every rank sees")
    try:
        files, shard, shard_digests = _write_rank_files(staging, trainer)
    except BaseException as exc:
        full = _out_of_space(exc, staging)
        if ctx.world == 1:
            shutil.rmtree(staging, ignore_errors=True)
        if full:
            raise NotWritableError(errno.ENOSPC, f"cannot write checkpoint {root / name}: "
                                   "no space left on device") from exc
        raise  # a rank that fails exits; torchrun stops the others
    # past here, every rank's files are durable
    every_rank = ctx.all_gather_object((files, store_summary(trainer.store)))
    final = root / name
    if ctx.is_main:
        try:
            _commit(staging, final, trainer, every_rank, extra, rng)
        except BaseException as exc:
            full = _out_of_space(exc, staging)
            shutil.rmtree(staging, ignore_errors=True)
            if full:
                raise NotWritableError(errno.ENOSPC, f"cannot write checkpoint {final}: "
                                       "no space left on device") from exc
            raise
        atomic_write_text(model_dir / LATEST_FILE, name)
        _prune(root, keep=KEEP_CHECKPOINTS, pinned=pinned)
    ctx.barrier()
    trainer.store.committed(final / shard, shard_digests)  # later saves link unchanged slabs
    return final


def _out_of_space(exc: BaseException, where: Path) -> bool:
    """Whether a failed checkpoint write ran out of disk: an ENOSPC, or torch.save's
    writer, which reports a short write as a RuntimeError, on a filesystem left full."""
    if isinstance(exc, OSError):
        return exc.errno in (errno.ENOSPC, errno.EDQUOT)
    if isinstance(exc, RuntimeError):
        try:
            return shutil.disk_usage(where).free < (1 << 20)
        except OSError:
            return False
    return False


def _write_rank_files(staging: Path, trainer) -> tuple[dict[str, str], str, dict[str, str]]:
    """This rank's sparse shard (and DGC residuals; the dense files on rank 0), fsynced:
    ({file: sha256}, shard name, {file in the shard: sha256})."""
    ctx: DistContext = trainer.ctx
    store = trainer.store
    files: dict[str, str] = {}
    shard = shard_name(ctx.rank, ctx.world)
    # The store writes its own files (a tiered store never materialises its table).
    shard_digests = store.save(staging / shard)
    for fname, digest in shard_digests.items():
        _fsync_file(staging / shard / fname)
        files[f"{shard}/{fname}"] = digest
    fsync_dir(staging / shard)
    comm_state = trainer.dense_comm.state_dict() if trainer.dense_comm is not None else {}
    if comm_state:
        torch.save(comm_state, staging / comm_file(ctx.rank, ctx.world))
        _durable(staging / comm_file(ctx.rank, ctx.world), files)
    if ctx.is_main:
        dense = {k: v.detach().cpu().contiguous() for k, v in trainer.model.state_dict().items()}
        save_torch(dense, str(staging / "dense.safetensors"))
        _durable(staging / "dense.safetensors", files)
        torch.save(trainer.dense_optimizer.state_dict(), staging / "dense_optimizer.pt")
        _durable(staging / "dense_optimizer.pt", files)
    return files, shard, shard_digests


def _commit(staging: Path, final: Path, trainer, every_rank: list, extra: dict | None,
            rng: list[int] | None = None) -> None:
    """Rank 0: the manifest, then the folder renamed into place."""
    world = trainer.ctx.world
    summaries = [summary for _, summary in every_rank]
    meta = {
        "pass_id": trainer.pass_id,
        "world_size": world,
        "sparse_format": trainer.store.saved_format,
        "history": trainer.history,
        "rng": {"torch": rng if rng is not None else torch.get_rng_state().tolist()},
        "sha256": {k: v for part, _ in every_rank for k, v in part.items()},
        "store": sum_store_summaries(summaries),  # the whole model's figures
        # every input file's row position after this pass (data.positions)
        **({"inputs": trainer.inputs} if getattr(trainer, "inputs", None) else {}),
        **({"sparse_shards": [shard_name(r, world) for r in range(world)],
            "stores": summaries,  # per rank: keys, tiers
            "dense_comm": trainer.dense_comm_config.as_dict()} if world > 1 else {}),
        **(extra or {}),
    }
    with open(staging / "meta.json", "w") as fh:
        fh.write(json.dumps(meta))  # json.dump encodes in Python, dumps in C: 10x faster
        fh.flush()
        os.fsync(fh.fileno())
    fsync_dir(staging)
    if final.exists():
        shutil.rmtree(final)
    os.replace(staging, final)
    fsync_dir(final.parent)


def sum_store_summaries(parts: list[dict]) -> dict:
    """Per-rank store figures (``store_summary``) added up: numbers summed, nested dicts
    likewise."""
    if len(parts) == 1:
        return parts[0]
    out: dict = {}
    for key, value in parts[0].items():
        values = [p.get(key) for p in parts]
        if isinstance(value, dict):
            out[key] = sum_store_summaries([v or {} for v in values])
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[key] = sum(v or 0 for v in values)
        else:
            out[key] = value
    return out


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
        best = best_checkpoint(model_dir)
        # A name that is no checkpoint folder was reported as a half-written checkpoint.
        if best is not None and not (best.startswith("pass-") and best[5:].isdigit() and (
                Path(model_dir) / "checkpoints" / best).is_dir()):
            have = ", ".join(p.name for p in list_checkpoints(model_dir)) or "none"
            raise CheckpointError(f"{Path(model_dir) / BEST_FILE} names {best!r}, which is "
                                  f"not a checkpoint here (have: {have}); --checkpoint "
                                  "latest or pass-N picks one")
        return best
    if which.startswith("pass-") and which[5:].isdigit():
        name = f"pass-{int(which[5:]):06d}"
        if not (Path(model_dir) / "checkpoints" / name).is_dir():
            have = ", ".join(p.name for p in list_checkpoints(model_dir)) or "none"
            raise CheckpointError(f"{model_dir}: no checkpoint {name} (have: {have})")
        return name
    raise ValueError(f"--checkpoint {which!r}: expected latest, best or pass-N")


def _prune(ckpt_root: Path, keep: int, pinned: str | None = None) -> None:
    """Drop all but the newest ``keep`` checkpoints, never the one ``BEST`` names nor
    ``pinned``."""
    done = sorted(p for p in ckpt_root.iterdir() if p.is_dir() and p.name.startswith("pass-"))
    kept = {best_checkpoint(ckpt_root.parent), pinned}
    for old in done[:-keep]:
        if old.name not in kept:
            shutil.rmtree(old, ignore_errors=True)
    for tmp in ckpt_root.glob(".pass-*"):
        shutil.rmtree(tmp, ignore_errors=True)


@with_config(ConfigDict(extra="allow", strict=True, allow_inf_nan=False))
class _RngState(TypedDict):
    torch: list[Annotated[int, Field(ge=0, le=255)]]


@with_config(ConfigDict(extra="forbid", strict=True, allow_inf_nan=False))
class _FileMark(TypedDict):
    rows: Annotated[int, Field(ge=0)]
    done: bool
    size: Annotated[int, Field(ge=0)]
    sha256: Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]
    skipped: NotRequired[Annotated[int, Field(ge=0)]]


@with_config(ConfigDict(extra="forbid", strict=True, allow_inf_nan=False))
class _Inputs(TypedDict):
    """Row positions per input file (``data.positions.Positions``)."""

    epoch: Annotated[int, Field(ge=0)]
    files: dict[str, _FileMark]


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
    inputs: NotRequired[_Inputs]


def verify_checkpoint(path: Path) -> dict:
    """Return the checkpoint's meta after validating it (``CheckpointMeta``) and checking
    every file's checksum."""
    meta = checkpoint_meta(path)
    _verify_files(path, meta, sorted(meta["sha256"]))
    return meta


def checkpoint_meta(path: Path) -> dict:
    """The checkpoint's ``meta.json``, validated (``CheckpointMeta``); files unchecked."""
    meta_path = path / "meta.json"
    if not meta_path.exists():
        raise CheckpointError(f"{path}: half-written checkpoint (no meta.json)")
    try:
        return dict(validate_json(CheckpointMeta, meta_path.read_bytes(), str(meta_path),
                                  root="meta"))
    except ValueError as exc:
        raise CheckpointError(f"corrupted checkpoint: {exc}") from None


def _verify_files(path: Path, meta: dict, names: list[str]) -> None:
    for fname in names:
        fpath = path / fname
        if not fpath.exists():
            raise CheckpointError(f"{fpath}: missing from checkpoint")
        if sha256_file(fpath) != meta["sha256"][fname]:
            raise CheckpointError(f"{fpath}: checksum mismatch, the file is corrupted")


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
    def world_size(self) -> int:
        """How many ranks wrote it (shards are split by ``shard_of(key, world_size)``)."""
        return int(self.meta.get("world_size", 1))

    @property
    def shards(self) -> list[str]:
        """The sparse shards, one per rank, each what a store saved (a folder) or an
        arrays file (older layouts): ``sparse`` for one process, or
        ``sparse.safetensors`` in checkpoints written before stores saved themselves."""
        if self.meta.get("sparse_shards"):
            return list(self.meta["sparse_shards"])
        return ["sparse"] if (self.path / "sparse").is_dir() else ["sparse.safetensors"]

    @property
    def sparse_dir(self) -> Path:
        """The ``sparse/`` folder of a one-process checkpoint."""
        return self.path / "sparse"

    @property
    def sparse_source(self) -> Path:
        """What a one-process checkpoint's store saved (``EmbeddingStore.load`` reads it):
        the ``sparse/`` folder, or ``sparse.safetensors`` in older checkpoints."""
        return self.path / self.shards[0]

    @property
    def sparse_digests(self) -> dict[str, str]:
        """sha256 of the files in ``sparse/``, by name inside it."""
        return self.shard_digests("sparse")

    def shard_digests(self, shard: str) -> dict[str, str]:
        """{file in the shard's folder: sha256}, for a store loading (a tiered one
        adopting the slabs of) its shard."""
        prefix = f"{shard}/"
        return {k[len(prefix):]: v for k, v in self.meta["sha256"].items()
                if k.startswith(prefix)}

    def _dims(self) -> tuple[int, int]:
        """(row_dim, state_dim) of the stored rows, from the model directory's config."""
        _, config = read_model_meta(self.path.parents[1])
        row_dim = row_dim_for(config.model.name, config.model)
        return row_dim, SparseOptimizer(config.sparse_optimizer).state_dim(row_dim)

    def iter_sorted(self, chunk_rows: int = CHUNK_ROWS) -> Iterator[RowChunk]:
        """The stored rows in increasing key order, at most ``chunk_rows`` per chunk,
        whatever wrote them (either store, any number of torchrun ranks): exports and
        ``inspect`` read a checkpoint this way, never the whole table at once."""
        row_dim, state_dim = self._dims()
        yield from merge_sorted([iter_saved(self.path / name, chunk_rows, row_dim, state_dim)
                                 for name in self.shards], chunk_rows)

    def shard_arrays(self, shard: str) -> dict[str, np.ndarray]:
        """One shard as sorted-key arrays (``MemoryStore.to_arrays`` form); a tiered
        shard's rows are decoded into RAM, so this is one rank's share at most."""
        rows = arrays_file(self.path / shard)
        if rows is not None:
            return load_numpy(str(rows))
        return snapshot_arrays(self.path / shard, *self._dims())

    @functools.cached_property
    def sparse(self) -> dict[str, np.ndarray]:
        """The whole store as sorted-key arrays, every shard merged, read on first use
        (small tables, tests); restoring goes shard by shard (``restore_trainer``),
        exports and ``inspect`` stream ``iter_sorted``."""
        return merge_shards([self.shard_arrays(s) for s in self.shards])

    def rank_arrays(self, rank: int, world: int) -> dict[str, np.ndarray]:
        """The rows ``rank`` owns out of ``world`` as sorted-key arrays (tests, small
        tables; restoring streams ``rank_rows``)."""
        if world == self.world_size:
            return self.shard_arrays(self.shards[rank])
        chunks, extras = self.rank_rows(rank, world)
        taken = list(chunks)
        row_dim, state_dim = self._dims()
        empty = RowChunk(np.empty(0, np.int64), np.empty((0, row_dim), np.float32),
                         np.empty((0, state_dim), np.float32), np.empty(0, np.float32),
                         np.empty(0, np.float32), np.empty(0, np.int32))
        columns = [c.columns() for c in taken or [empty]]
        return {**{name: np.concatenate([c[name] for c in columns]) for name in columns[0]},
                **extras}

    def rank_rows(self, rank: int, world: int, chunk_rows: int = CHUNK_ROWS
                  ) -> tuple[Iterator[RowChunk], dict[str, np.ndarray]]:
        """The rows ``rank`` owns out of ``world`` as a key-ordered stream of chunks,
        each shard read ``chunk_rows`` at a time and filtered by ``shard_of`` (never a
        whole shard in RAM), and the store-wide arrays it keeps: its admission
        candidates, and the totals (``counters``, ``pruned``) on rank 0."""
        row_dim, state_dim = self._dims()

        def owned(shard: str) -> Iterator[RowChunk]:
            for chunk in iter_saved(self.path / shard, chunk_rows, row_dim, state_dim):
                keep = shard_of(chunk.keys, world) == rank
                yield RowChunk(*(column[keep] for column in chunk.columns().values()))

        parts = []
        for shard in self.shards:
            extras = saved_extras(self.path / shard)
            part = {}
            for name, values in extras.items():
                column = sparse_key_column(name)
                if name == SKETCH_ARRAY:  # every owner's counts are an upper bound
                    part[name] = values
                elif column is None:
                    part[name] = values if rank == 0 else np.zeros_like(values)
                else:
                    part[name] = values[shard_of(extras[column], world) == rank]
            parts.append(part)
        return merge_sorted([owned(s) for s in self.shards], chunk_rows), merge_shards(parts)


def sparse_key_column(name: str) -> str | None:
    """Which key array orders sparse array ``name``: rows by ``keys``, admission
    candidates by ``cand_keys``; None for store-wide totals (``counters``, ``pruned``,
    ``rejected``) and the admission sketch (summed when shards merge)."""
    if name in STORE_TOTALS or name == SKETCH_ARRAY:
        return None
    return "cand_keys" if name.startswith("cand_") else "keys"


def merge_shards(parts: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Sorted-key tables of disjoint key sets as one: rows and candidates merged by key,
    store-wide totals summed."""
    if len(parts) == 1:
        return parts[0]
    orders: dict[str, np.ndarray] = {
        col: np.argsort(np.concatenate([p[col] for p in parts]), kind="stable")
        for col in ("keys", "cand_keys") if col in parts[0]}
    merged: dict[str, np.ndarray] = {}
    for name in parts[0]:
        column = sparse_key_column(name)
        if column is None:
            merged[name] = np.sum([p[name] for p in parts], axis=0)
        else:
            merged[name] = np.concatenate([p[name] for p in parts])[orders[column]]
    return merged


def rank_arrays(path: Path, meta: dict, rank: int, world: int) -> dict[str, np.ndarray]:
    """The sparse rows ``rank`` owns out of ``world``, from the checkpoint at ``path``
    written by any number of ranks (or by a single process)."""
    ckpt = LoadedCheckpoint(path=Path(path), meta=meta, dense={}, dense_optimizer={})
    return ckpt.rank_arrays(rank, world)


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
        return _read(path, meta)
    raise CheckpointError("no loadable checkpoint: " + "; ".join(errors))


def _choose(model_dir: Path, name: str | None, ctx: DistContext) -> LoadedCheckpoint:
    """The checkpoint every rank loads: ``name`` or the newest one that verifies
    (``load_checkpoint``). On N ranks the checksums are split among the ranks (each
    hashes every N-th file, rather than rank 0 all while the others wait) and a
    checkpoint any rank finds corrupted is refused by all."""
    if ctx.world == 1:
        return load_checkpoint(model_dir, name)
    candidates = ctx.broadcast_object(
        [model_dir / "checkpoints" / name] if name is not None else list_checkpoints(model_dir))
    if not candidates:
        raise CheckpointError(f"{model_dir}: no committed checkpoint")
    errors = []
    for path in candidates:
        meta: dict | None = None
        problem: str | None = None
        try:
            meta = checkpoint_meta(path)
            _verify_files(path, meta, sorted(meta["sha256"])[ctx.rank::ctx.world])
        except CheckpointError as exc:
            problem = str(exc)
        problems = [p for p in ctx.all_gather_object(problem) if p]
        if problems or meta is None:
            log.warning("refusing checkpoint: %s", problems[0])
            errors.append(problems[0])
            continue
        return _read(path, meta)
    raise CheckpointError("no loadable checkpoint: " + "; ".join(errors))


def _read(path: Path, meta: dict) -> LoadedCheckpoint:
    return LoadedCheckpoint(
        path=path, meta=meta, dense=load_torch(str(path / "dense.safetensors")),
        dense_optimizer=torch.load(path / "dense_optimizer.pt", weights_only=True))


def restore_trainer(model_dir: str | Path, config: TrainConfig | None = None,
                    name: str | None = None, scratch_dir: str | Path | None = None,
                    ctx: DistContext | None = None,
                    dense_comm: DenseCommConfig | None = None,
                    prepare: Callable[[Any], None] | None = None):
    """A Trainer holding the newest good checkpoint of ``model_dir`` (written by any
    number of ranks); collective, holding this rank's keys, when ``ctx`` is one of N.
    Without ``config`` (scoring a saved model) a tiered store lives in ``scratch_dir``, a
    folder private to this process (else a temp folder), never in the training run's
    live one. ``prepare`` sees the new trainer before its rows are loaded (a search gives
    it a view of a shared key index there)."""
    from terarec.train.trainer import Trainer

    model_dir = Path(model_dir)
    schema, saved_config = read_model_meta(model_dir)
    if config is None:
        saved_config.store.disk_path = None if scratch_dir is None else str(scratch_dir)
    config = config or saved_config
    ctx = ctx or DistContext.single(resolve_device(config.device))
    ckpt = _choose(model_dir, name, ctx)
    if dense_comm is None and ctx.world > 1 and "dense_comm" in ckpt.meta:
        dense_comm = DenseCommConfig(**ckpt.meta["dense_comm"])
    trainer = Trainer(schema, config, ctx=ctx, dense_comm=dense_comm)
    if prepare is not None:
        prepare(trainer)
    trainer.model.load_state_dict(ckpt.dense)
    trainer.dense_optimizer.load_state_dict(ckpt.dense_optimizer)
    same_world = ckpt.world_size == ctx.world
    if same_world:  # this rank's own shard, whatever store saved it
        shard = ckpt.shards[ctx.rank]
        trainer.store.load(ckpt.path / shard, ckpt.shard_digests(shard))
    else:  # streamed: one chunk of each shard in RAM besides what the store keeps
        trainer.store.load_rows(*ckpt.rank_rows(ctx.rank, ctx.world))
    comm = ckpt.path / comm_file(ctx.rank, ctx.world)
    if same_world and trainer.dense_comm is not None and comm.exists():
        trainer.dense_comm.load_state_dict(torch.load(comm, weights_only=True))
    trainer.pass_id = int(ckpt.meta["pass_id"])
    trainer.history = list(ckpt.meta.get("history", []))
    trainer.inputs = ckpt.meta.get("inputs")
    torch.set_rng_state(torch.tensor(ckpt.meta["rng"]["torch"], dtype=torch.uint8))
    return trainer
