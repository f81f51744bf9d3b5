"""Reading a committed checkpoint: its dense state dicts, and its sparse rows, whatever
wrote them (a memory or a tiered store, one process or N ranks), at any world size.

Restoring at the world size that wrote it, each rank reads its own shard (a tiered store
adopts its slab files); at another, each rank streams every shard and keeps the keys it
now owns (``shard_of``).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.numpy import load_file as load_numpy
from safetensors.torch import load_file as load_torch

from terarec.embedding.admission import SKETCH_ARRAY
from terarec.embedding.optimizers import SparseOptimizer
from terarec.embedding.store import CHUNK_ROWS, STORE_TOTALS, arrays_file, merge_sorted
from terarec.embedding.tiered import iter_saved, saved_extras, snapshot_arrays
from terarec.embedding.types import RowChunk
from terarec.kernels import shard_of
from terarec.modeldir.layout import (
    CHECKPOINTS_DIR,
    CheckpointError,
    list_checkpoints,
    read_model_meta,
)
from terarec.modeldir.manifest import checkpoint_meta, verify_checkpoint, verify_files
from terarec.modeldir.ranks import Ranks
from terarec.models import row_dim_for

log = logging.getLogger(__name__)


@dataclass
class LoadedCheckpoint:
    """A verified checkpoint: its manifest and dense state dicts in RAM, its sparse rows
    read on demand (a whole table never has to fit)."""

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
        (small tables, tests); restoring goes shard by shard (``Trainer.from_checkpoint``),
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
        candidates = [model_dir / CHECKPOINTS_DIR / name]
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


def choose_checkpoint(model_dir: str | Path, name: str | None, ranks: Ranks) -> LoadedCheckpoint:
    """The checkpoint every rank loads: ``name`` or the newest one that verifies
    (``load_checkpoint``). On N ranks the checksums are split among the ranks (each
    hashes every N-th file, rather than rank 0 all while the others wait) and a
    checkpoint any rank finds corrupted is refused by all."""
    if ranks.world == 1:
        return load_checkpoint(model_dir, name)
    model_dir = Path(model_dir)
    candidates = ranks.broadcast_object(
        [model_dir / CHECKPOINTS_DIR / name] if name is not None else list_checkpoints(model_dir))
    if not candidates:
        raise CheckpointError(f"{model_dir}: no committed checkpoint")
    errors = []
    for path in candidates:
        meta: dict | None = None
        problem: str | None = None
        try:
            meta = checkpoint_meta(path)
            verify_files(path, meta, sorted(meta["sha256"])[ranks.rank::ranks.world])
        except CheckpointError as exc:
            problem = str(exc)
        problems = [p for p in ranks.all_gather_object(problem) if p]
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
