"""Pass staging: one pass's rows in one contiguous device tensor, samples remapped to it.

Before a pass, the unique keys of all its batches are pulled from the store into
``weights`` (row 0 is the zero row of unadmitted or unknown keys), and every batch's keys
are replaced by local row ids. Training steps are then plain embedding lookups over a
dense table, at ordinary PyTorch speed, whatever the size of the store behind it::

    pass keys:   [k7 k3 k7 k9 k3 k5]          (k5 not admitted yet)
    unique:      [k7 k3 k9 k5]  -> store.pull -> weights[1..3] = rows of k7 k3 k9
    local ids:   [ 1  2  1  3  2  0]          (batches carry these)

After the pass, rows 1.. are pushed back to the store with their optimizer state.

Variable-length rows (``RowBlock.widths``) arrive zero-padded to ``row_dim``; a column mask
keeps the gradient off the padding, so a short row stays short while it trains.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F

from terarec.embedding.index import unique_inverse
from terarec.embedding.optimizers import LazyL2, SparseOptimizer
from terarec.embedding.protocol import EmbeddingStore
from terarec.embedding.types import RowBlock
from terarec.types import Batch, KeyedIds

if TYPE_CHECKING:
    from terarec.embedding.device import DeviceRowCache


def occurrence_labels(batch: Batch) -> np.ndarray:
    """The label of the sample each key in ``batch.sparse.values`` belongs to (the first
    task's, ``label``, where a batch has several: it counts the keys' clicks)."""
    labels = batch.labels.numpy()
    if labels.ndim == 2:
        labels = np.ascontiguousarray(labels[:, 0])
    per_slot = np.tile(labels, batch.sparse.num_fields)
    if batch.sparse.one_per_slot:
        return per_slot
    return np.repeat(per_slot, batch.sparse.lengths.numpy())


def _with_zero_row(rows: np.ndarray, dim: int) -> torch.Tensor:
    """``rows`` below one zero row (local id 0), as one contiguous float32 tensor."""
    out = np.empty((len(rows) + 1, dim), np.float32)
    out[0] = 0.0
    out[1:] = rows
    return torch.from_numpy(out)


@dataclass
class PassPlan:
    """The key-only half of staging: needs no store, so it runs ahead, off the training
    thread, while the previous pass trains. ``inverse`` maps each key occurrence (batches
    concatenated) to its position in ``keys``."""

    batches: list[Batch]
    keys: np.ndarray
    inverse: np.ndarray
    show: np.ndarray | None
    click: np.ndarray | None

    @property
    def rows(self) -> int:
        return sum(len(b) for b in self.batches)

    @cached_property
    def all_admitted_ids(self) -> torch.Tensor:
        """Local ids when every key is admitted: position + 1 (row 0 is the zero row)."""
        return torch.from_numpy(self.inverse + 1)


def plan_pass(batches: list[Batch], counts: bool = True) -> PassPlan:
    """Unique keys of a pass, each occurrence's position among them, and (``counts``) each
    key's shows and clicks in the pass."""
    values = [b.sparse.values.numpy() for b in batches]
    all_keys = np.concatenate(values) if values else np.empty(0, np.int64)
    uniq, inverse = unique_inverse(all_keys)
    show = click = None
    if counts:
        show = np.bincount(inverse, minlength=len(uniq)).astype(np.float32)
        occ = (np.concatenate([occurrence_labels(b) for b in batches]) if batches
               else np.empty(0, np.float32))
        click = np.bincount(inverse, weights=occ, minlength=len(uniq)).astype(np.float32)
    return PassPlan(batches, uniq, inverse, show, click)


@dataclass
class StagingStats:
    keys: int
    unique_keys: int
    admitted_keys: int


class StagedRows:
    """What every working set holds at a pass end (one process's, or one rank's owned
    rows on N ranks), so that both write their trained rows back the same way."""

    keys: np.ndarray
    weights: torch.Tensor
    state: torch.Tensor | None
    optimizer: SparseOptimizer | None
    lazy_l2: LazyL2 | None
    batches: list[Batch]
    cache: DeviceRowCache | None
    pass_id: int
    pass_show: np.ndarray | None

    def write_back(self, store: EmbeddingStore) -> None:
        """Push trained rows and their optimizer state back to the store (or to the
        device row cache they came from)."""
        if self.optimizer is None or self.state is None:
            raise RuntimeError("only a training working set is written back")
        self.optimizer.catch_up(self.weights, self.state, self.lazy_l2, len(self.batches))
        if self.cache is not None:
            assert self.pass_show is not None
            self.cache.write_back(store, self.keys, self.weights, self.state, self.pass_show,
                                  self.pass_id)
            return
        store.push(self.keys, RowBlock(self.weights[1:].cpu().numpy(),
                                       self.state[1:].cpu().numpy()))


class WorkingSet(StagedRows):
    """The rows one pass trains (or scores) on, resident on ``device``."""

    def __init__(self, keys: np.ndarray, weights: torch.Tensor, state: torch.Tensor | None,
                 batches: list[Batch], optimizer: SparseOptimizer | None,
                 stats: StagingStats) -> None:
        self.keys = keys
        self.weights = weights
        self.state = state
        self.batches = batches
        self.optimizer = optimizer
        self.stats = stats
        # [rows, row_dim] 1/0 mask of the stored columns of variable-length rows, or None.
        self.column_mask: torch.Tensor | None = None
        self._scratch = (np.full(weights.shape[0], -1, np.int64)
                         if weights.device.type == "cpu" and optimizer is not None else None)
        # the every-step L2's bookkeeping, and the pass's step the trainer is at
        self.lazy_l2 = optimizer.lazy_l2(weights.shape[0], weights.device) if optimizer else None
        self.step = 0
        # A device row cache the rows came from and go back to (embedding/device.py),
        # with this pass's number and its keys' shows (the cache's LFU score).
        self.cache: DeviceRowCache | None = None
        self.pass_id = 0
        self.pass_show: np.ndarray | None = None

    @property
    def trainable(self) -> bool:
        return self.optimizer is not None

    @classmethod
    def stage(cls, store: EmbeddingStore, batches: list[Batch] | PassPlan, pass_id: int,
              device: torch.device | str = "cpu", train: bool = True,
              cache: DeviceRowCache | None = None) -> WorkingSet:
        """Pull the rows of every key in ``batches`` and remap the batches to local ids.

        ``batches`` may be a ``PassPlan`` made ahead of time (off the training thread).
        ``train=False`` reads rows without counting or admitting keys (evaluation,
        prediction): unknown keys score with the zero row. With a device ``cache``, the
        rows it holds come from it (they are newer than the store's) and training rows
        go back to it (``write_back``).
        """
        if cache is not None:
            cache.bind(store)
        plan = batches if isinstance(batches, PassPlan) else plan_pass(batches, counts=train)
        uniq = plan.keys
        if train:
            if plan.show is None or plan.click is None:
                raise ValueError("a training pass needs a plan made with counts=True")
            block, admitted = store.pull(uniq, plan.show, plan.click, pass_id)
            rows, state_rows = block.values, block.state
        else:
            rows, admitted = store.lookup(uniq)
            rows = rows[admitted]
            state_rows = None
        n_adm = int(admitted.sum())
        if n_adm == len(uniq):
            local_ids = plan.all_admitted_ids
        else:
            local = np.zeros(len(uniq), np.int64)
            local[admitted] = np.arange(1, n_adm + 1)
            local_ids = torch.from_numpy(local[plan.inverse])
        state = None
        weights = None
        if cache is not None and train:
            weights, state = cache.assemble(uniq[admitted], block, pass_id)
        elif state_rows is not None:
            state = _with_zero_row(state_rows, state_rows.shape[1]).to(device)
        if weights is None:
            weights = _with_zero_row(rows, store.row_dim).to(device)
            if cache is not None:
                cache.overlay(uniq[admitted], weights)
        column_mask = None
        if train and block.widths is not None:
            dim = store.row_dim
            widths = torch.from_numpy(np.concatenate([[dim], block.widths]).astype(np.int64))
            column_mask = (torch.arange(dim) < widths[:, None]).to(torch.float32).to(device)
        remapped, start = [], 0
        for b in plan.batches:
            n = b.sparse.values.numel()
            ids = local_ids[start:start + n]
            start += n
            remapped.append(Batch(b.dense, b.sparse.with_values(ids), b.labels).to(device))
        ws = cls(uniq[admitted], weights, state, remapped, store.optimizer if train else None,
                 StagingStats(len(plan.inverse), len(uniq), n_adm))
        ws.column_mask = column_mask
        if cache is not None and train:
            assert plan.show is not None
            ws.cache, ws.pass_id, ws.pass_show = cache, pass_id, plan.show[admitted]
        return ws

    def step_table(self, step: int) -> torch.Tensor:
        """The rows any step's remapped batch indexes: the whole pass's (on N ranks, a
        step's rows come from their owners: ``ShardedWorkingSet.step_table``)."""
        return self.weights

    def lookup(self, sparse: KeyedIds, mean_fields: torch.Tensor | None = None,
               anchor: torch.Tensor | None = None) -> torch.Tensor:
        """Pooled rows ``[B, F, row_dim]`` for a remapped batch.

        ``mean_fields``: bool ``[F]``, fields pooled by mean rather than sum. With an
        ``anchor`` (a scalar requiring grad) on a trainable set, the backward pass
        applies the sparse optimizer to the touched rows in place.
        """
        if anchor is not None and self.trainable and torch.is_grad_enabled():
            return _FusedLookup.apply(anchor, self, sparse, mean_fields)
        with torch.no_grad():
            return _pooled(self.weights, sparse, mean_fields)


def _pooled(weights: torch.Tensor, sparse: KeyedIds,
            mean_fields: torch.Tensor | None) -> torch.Tensor:
    b, f = sparse.batch_size, sparse.num_fields
    if sparse.one_per_slot:
        return weights.index_select(0, sparse.sample_major.view(-1)).view(b, f, -1)
    else:
        out = F.embedding_bag(sparse.values, weights, sparse.offsets, mode="sum",
                              include_last_offset=True)
        if mean_fields is not None:
            out = out / _mean_divisor(sparse, mean_fields).unsqueeze(1)
    return out.view(f, b, -1).transpose(0, 1)


def _mean_divisor(sparse: KeyedIds, mean_fields: torch.Tensor) -> torch.Tensor:
    """Per (field, sample) divisor: the bag length for mean fields, 1 for sum fields."""
    lengths = sparse.lengths.to(torch.float32).clamp_min(1.0)
    per_slot = mean_fields.to(lengths.device).repeat_interleave(sparse.batch_size)
    return torch.where(per_slot, lengths, torch.ones_like(lengths))


def occurrence_grads(grad: torch.Tensor, sparse: KeyedIds,
                     mean_fields: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradient of ``_pooled``'s output ``[batch, fields, dim]`` per key occurrence:
    (row id of each occurrence, its gradient row); rows repeat where keys do."""
    if sparse.one_per_slot:
        return sparse.sample_major.view(-1), grad.reshape(-1, grad.shape[2])
    per_slot = grad.transpose(0, 1).reshape(-1, grad.shape[2])
    if mean_fields is not None:
        per_slot = per_slot / _mean_divisor(sparse, mean_fields).unsqueeze(1)
    return sparse.values, per_slot.repeat_interleave(sparse.lengths, dim=0)


class _FusedLookup(torch.autograd.Function):
    """Embedding lookup whose backward is the sparse optimizer step (no dense grad of
    the table is ever formed, as in FBGEMM's fused table-batched embeddings)."""

    @staticmethod
    def forward(ctx, anchor: torch.Tensor, ws: WorkingSet, sparse: KeyedIds,
                mean_fields: torch.Tensor | None) -> torch.Tensor:
        ctx.ws, ctx.sparse, ctx.mean_fields = ws, sparse, mean_fields
        return _pooled(ws.weights, sparse, mean_fields)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ws: WorkingSet = ctx.ws
        rows, occ_grad = occurrence_grads(grad, ctx.sparse, ctx.mean_fields)
        assert ws.optimizer is not None and ws.state is not None
        if ws.column_mask is not None:
            occ_grad = occ_grad * ws.column_mask.index_select(0, rows)
        ws.optimizer.step(ws.weights, ws.state, rows, occ_grad, ws._scratch,
                          batch_rows=ctx.sparse.batch_size, lazy=ws.lazy_l2,
                          step_index=ws.step)
        return torch.zeros((), device=grad.device), None, None, None
