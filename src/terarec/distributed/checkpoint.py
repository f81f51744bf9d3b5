"""Per-rank checkpoints committed by one manifest.

A distributed checkpoint has the single-process layout plus one sparse file per rank::

    checkpoints/pass-000004/
      dense.safetensors, dense_optimizer.pt     written by rank 0 (identical on all ranks)
      sparse-00000-of-00002.safetensors         the keys rank 0 owns
      sparse-00001-of-00002.safetensors         the keys rank 1 owns
      dense_comm-0000R-of-00002.pt              rank R's unsent DGC residuals (dgc only)
      meta.json                                 the manifest: world size, shard list,
                                                sha256 of every file; written last

Commit protocol: rank 0 creates a staging folder; every rank writes and fsyncs its files
into it; the checksums are gathered to rank 0 (nobody gets past that point before every
rank's files are durable); rank 0 writes the manifest, renames the folder into place and
updates ``LATEST``; a final barrier returns once the pass is committed. A rank killed at
any point leaves the previous checkpoint as the newest complete one. The model directory
must be on a filesystem every rank sees (one node, or NFS / a shared mount across nodes).

Restoring works for any number of ranks: with the same world size each rank reads its
own file; otherwise every rank reads all shards and keeps the keys it now owns.
``train.checkpoint.load_checkpoint`` / ``restore_trainer`` merge the shards into one
store, so export and scoring read a distributed model like any other.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors.numpy import load_file as load_numpy
from safetensors.numpy import save_file as save_numpy
from safetensors.torch import load_file as load_torch
from safetensors.torch import save_file as save_torch

from terarec.config import TrainConfig
from terarec.distributed.context import DistContext
from terarec.distributed.dense_comm import DenseCommConfig
from terarec.distributed.sharding import shard_of
from terarec.distributed.trainer import ShardedTrainer
from terarec.io import atomic_write_text, fsync_dir, sha256_file
from terarec.train.checkpoint import (
    CheckpointError,
    _fsync_file,
    _prune,
    list_checkpoints,
    load_sparse,
    read_model_meta,
    sparse_key_column,
    store_summary,
    verify_checkpoint,
    write_model_meta,
)


def shard_file(rank: int, world: int) -> str:
    return f"sparse-{rank:05d}-of-{world:05d}.safetensors"


def comm_file(rank: int, world: int) -> str:
    return f"dense_comm-{rank:05d}-of-{world:05d}.pt"


def _write(path: Path, files: dict[str, str]) -> None:
    _fsync_file(path)
    files[path.name] = sha256_file(path)


def save_sharded_checkpoint(model_dir: str | Path, trainer: ShardedTrainer,
                            extra: dict | None = None) -> Path:
    """Collective: commit every rank's state after its last pass as one checkpoint."""
    ctx = trainer.ctx
    model_dir = Path(model_dir)
    root = model_dir / "checkpoints"
    name = f"pass-{trainer.pass_id:06d}"
    staging = root / f".{name}.staging"
    if ctx.is_main:
        write_model_meta(model_dir, trainer.schema, trainer.config)
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    ctx.barrier()
    if not staging.is_dir():
        raise CheckpointError(f"rank {ctx.rank}: {staging} is not visible; the model "
                              "directory must be on a filesystem every rank sees")
    files: dict[str, str] = {}
    shard = staging / shard_file(ctx.rank, ctx.world)
    save_numpy(trainer.store.to_arrays(), str(shard))
    _write(shard, files)
    comm_state = trainer.dense_comm.state_dict()
    if comm_state:
        torch.save(comm_state, staging / comm_file(ctx.rank, ctx.world))
        _write(staging / comm_file(ctx.rank, ctx.world), files)
    if ctx.is_main:
        dense = {k: v.detach().cpu().contiguous() for k, v in trainer.model.state_dict().items()}
        save_torch(dense, str(staging / "dense.safetensors"))
        _write(staging / "dense.safetensors", files)
        torch.save(trainer.dense_optimizer.state_dict(), staging / "dense_optimizer.pt")
        _write(staging / "dense_optimizer.pt", files)
    # past here, every rank's files are durable
    every_rank = ctx.all_gather_object((files, store_summary(trainer.store)))
    final = root / name
    if ctx.is_main:
        digests = {k: v for part, _ in every_rank for k, v in part.items()}
        meta = {
            "pass_id": trainer.pass_id,
            "world_size": ctx.world,
            "sparse_shards": [shard_file(r, ctx.world) for r in range(ctx.world)],
            "dense_comm": trainer.dense_comm_config.as_dict(),
            "history": trainer.history,
            "rng": {"torch": torch.get_rng_state().tolist()},
            "sha256": digests,
            "stores": [summary for _, summary in every_rank],  # per rank: keys, tiers
            **(extra or {}),
        }
        with open(staging / "meta.json", "w") as fh:
            json.dump(meta, fh)
            fh.flush()
            os.fsync(fh.fileno())
        fsync_dir(staging)
        if final.exists():
            shutil.rmtree(final)
        os.replace(staging, final)
        fsync_dir(root)
        atomic_write_text(model_dir / "LATEST", name)
        _prune(root, keep=2)
    ctx.barrier()
    return final


def _choose(model_dir: Path, name: str | None) -> str:
    """Rank 0's pick: ``name`` or the newest checkpoint whose every file verifies."""
    candidates = [model_dir / "checkpoints" / name] if name else list_checkpoints(model_dir)
    errors = []
    for path in candidates:
        try:
            verify_checkpoint(path)
            return path.name
        except CheckpointError as exc:
            errors.append(str(exc))
    raise CheckpointError(f"{model_dir}: no loadable checkpoint"
                          + (": " + "; ".join(errors) if errors else ""))


def rank_arrays(path: Path, meta: dict, rank: int, world: int) -> dict[str, np.ndarray]:
    """The sparse rows ``rank`` owns out of ``world``, from a checkpoint written by any
    number of ranks (or by a single process)."""
    if meta.get("world_size") == world and meta.get("sparse_shards"):
        return load_numpy(str(path / shard_file(rank, world)))
    merged = load_sparse(path, meta)
    mine = {col: shard_of(merged[col], world) == rank
            for col in ("keys", "cand_keys") if col in merged}
    out = {}
    for name, values in merged.items():
        column = sparse_key_column(name)
        if column is None:  # store-wide totals stay with rank 0
            out[name] = values if rank == 0 else np.zeros_like(values)
        else:
            out[name] = values[mine[column]]
    return out


def restore_sharded_trainer(model_dir: str | Path, ctx: DistContext,
                            config: TrainConfig | None = None,
                            dense_comm: DenseCommConfig | None = None,
                            name: str | None = None) -> ShardedTrainer:
    """Collective: a ShardedTrainer holding this rank's part of the newest good checkpoint
    (all ranks load the same one, chosen by rank 0)."""
    model_dir = Path(model_dir)
    schema, saved_config = read_model_meta(model_dir)
    choice: str | Exception
    if ctx.is_main:
        try:
            choice = _choose(model_dir, name)
        except CheckpointError as exc:
            choice = exc
    else:
        choice = ""
    choice = ctx.broadcast_object(choice)
    if isinstance(choice, Exception):
        raise CheckpointError(str(choice))
    path = model_dir / "checkpoints" / choice
    with open(path / "meta.json") as fh:
        meta = json.load(fh)
    if dense_comm is None and "dense_comm" in meta:
        dense_comm = DenseCommConfig(**meta["dense_comm"])
    trainer = ShardedTrainer(schema, config or saved_config, ctx, dense_comm)
    trainer.model.load_state_dict(load_torch(str(path / "dense.safetensors")))
    trainer.dense_optimizer.load_state_dict(
        torch.load(path / "dense_optimizer.pt", weights_only=True))
    trainer.store.load_arrays(rank_arrays(path, meta, ctx.rank, ctx.world))
    comm = path / comm_file(ctx.rank, ctx.world)
    if meta.get("world_size") == ctx.world and comm.exists():
        trainer.dense_comm.load_state_dict(torch.load(comm, weights_only=True))
    trainer.pass_id = int(meta["pass_id"])
    trainer.history = list(meta.get("history", []))
    torch.set_rng_state(torch.tensor(meta["rng"]["torch"], dtype=torch.uint8))
    return trainer
