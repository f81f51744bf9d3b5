"""Committing a checkpoint atomically at a pass boundary, by one process or by all the
ranks of a torchrun job together.

Rank 0 makes a hidden staging folder; every rank writes and fsyncs its files into it; the
checksums are gathered to rank 0 (nobody gets past that point before every rank's files
are durable); rank 0 writes the manifest, renames the folder into place and replaces
``LATEST``; a final barrier returns once the pass is committed. A crash (of any rank) at
any point leaves the previous checkpoint intact and loadable. Each key's values and
optimizer state are taken from the same moment (the store between passes). Alone, every
collective is free. On several nodes the model directory must be on a filesystem every
rank sees.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors.torch import save_file as save_torch

from terarec.config import TrainConfig
from terarec.embedding.protocol import EmbeddingStore
from terarec.finite import check_trainer_finite
from terarec.io import NotWritableError, atomic_write_text, fsync_dir, sha256_file
from terarec.modeldir.layout import (
    CHECKPOINTS_DIR,
    KEEP_CHECKPOINTS,
    LATEST_FILE,
    META_FILE,
    CheckpointError,
    comm_file,
    pass_name,
    prune_checkpoints,
    shard_name,
    write_model_meta,
)
from terarec.modeldir.ranks import Ranks
from terarec.types import FeatureSchema


class _StateDict(Protocol):
    def state_dict(self) -> dict[str, Any]: ...


class _AsDict(Protocol):
    def as_dict(self) -> dict: ...


class TrainingState(Protocol):
    """What a checkpoint holds of a trainer (``terarec.train.Trainer`` is one), read
    after its last pass."""

    @property
    def ctx(self) -> Ranks: ...

    @property
    def schema(self) -> FeatureSchema: ...

    @property
    def config(self) -> TrainConfig: ...

    @property
    def store(self) -> EmbeddingStore: ...

    @property
    def model(self) -> torch.nn.Module: ...

    @property
    def dense_optimizer(self) -> _StateDict: ...

    @property
    def dense_comm(self) -> _StateDict | None: ...

    @property
    def dense_comm_config(self) -> _AsDict: ...

    @property
    def pass_id(self) -> int: ...

    @property
    def history(self) -> list[dict]: ...

    @property
    def inputs(self) -> dict | None: ...

    def sync_store(self) -> None: ...


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _durable(path: Path, files: dict[str, str], rel: str | None = None) -> None:
    _fsync_file(path)
    files[rel or path.name] = sha256_file(path)


def save_checkpoint(model_dir: str | Path, trainer: TrainingState, extra: dict | None = None,
                    pinned: str | None = None, rng: list[int] | None = None) -> Path:
    """Commit the trainer's state after its last pass as a new checkpoint; collective
    when the trainer is one of N ranks. ``pinned``: a checkpoint the pruning of older
    ones keeps (besides ``BEST``). ``rng``: torch's random state to record, taken when
    the pass ended (a commit written later, on another thread, cannot read it then)."""
    trainer.sync_store()  # rows newer on the device go into the checkpoint
    check_trainer_finite(trainer)  # a diverged model never replaces a good checkpoint
    ctx = trainer.ctx
    model_dir = Path(model_dir)
    root = model_dir / CHECKPOINTS_DIR
    name = pass_name(trainer.pass_id)
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
        prune_checkpoints(root, keep=KEEP_CHECKPOINTS, pinned=pinned)
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


def _write_rank_files(staging: Path, trainer: TrainingState
                      ) -> tuple[dict[str, str], str, dict[str, str]]:
    """This rank's sparse shard (and DGC residuals; the dense files on rank 0), fsynced:
    ({file: sha256}, shard name, {file in the shard: sha256})."""
    ctx = trainer.ctx
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


def _commit(staging: Path, final: Path, trainer: TrainingState, every_rank: list,
            extra: dict | None, rng: list[int] | None = None) -> None:
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
        **({"inputs": trainer.inputs} if trainer.inputs else {}),
        **({"sparse_shards": [shard_name(r, world) for r in range(world)],
            "stores": summaries,  # per rank: keys, tiers
            "dense_comm": trainer.dense_comm_config.as_dict()} if world > 1 else {}),
        **(extra or {}),
    }
    with open(staging / META_FILE, "w") as fh:
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
