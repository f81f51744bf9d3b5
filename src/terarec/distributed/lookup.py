"""Sharded pass staging and per-step row exchange (TorchRec's input_dist / output_dist).

Every rank is both a *requester* (it trains its local batches) and an *owner* (it holds
the rows of the keys it owns, ``shard_of(key) == rank``). At pass start, once::

    requester: unique keys of its local batches ──all_to_all──> owners
               (+ show/click counts, so admission sees the whole pass's counts)
    owner:     union of requested keys -> store.pull -> weights (row 0 = zero row)
    requester: for every step, the *positions* (int32, in its key request) of the keys
               that step needs ──all_to_all──> owners, which turn them into rows once

so the steps carry no keys and owners do no hash lookups while training: each step is
two exchanges of float rows instead of three (keys, rows, gradients). Per step s::

    forward   owner gathers weights[rows(s)]  ──all_to_all──> requester's step table
    backward  requester's table.grad / world  ──all_to_all──> owner: sparse optimizer

The requester's step table holds one row per distinct key of its batch, ordered by owner
then request position; its batch is remapped to ids into that table::

    batch keys (2 ranks):   [k5 k8 k5 k2]       owner(k5)=0 owner(k8)=1 owner(k2)=0
    request to owner 0:     [k5 k2]  positions [0 1];  to owner 1: [k8]  position [0]
    step table rows:        [k5 k2 | k8]        batch ids: [0 2 0 1]

A rank with an empty batch (or no keys for some owner) still joins every exchange with
zero-length splits, which gloo and NCCL both accept.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from terarec.distributed.context import DistContext
from terarec.distributed.sharding import shard_of
from terarec.embedding.index import unique_inverse
from terarec.embedding.store import MemoryStore, RowBlock
from terarec.embedding.working_set import occurrence_labels
from terarec.types import Batch


def exchange(ctx: DistContext, tensor: torch.Tensor, send_counts: np.ndarray | list[int],
             recv_counts: np.ndarray | list[int]) -> torch.Tensor:
    """``all_to_all_single`` along dim 0: ``send_counts[r]`` rows go to rank ``r``,
    ``recv_counts[r]`` rows come from it (in rank order)."""
    send = [int(c) for c in send_counts]
    recv = [int(c) for c in recv_counts]
    tensor = tensor.to(ctx.comm_device).contiguous()
    out = torch.empty((sum(recv),) + tuple(tensor.shape[1:]), dtype=tensor.dtype,
                      device=tensor.device)
    dist.all_to_all_single(out, tensor, output_split_sizes=recv, input_split_sizes=send,
                           group=ctx.sparse_group)
    return out


def _starts(counts: np.ndarray) -> np.ndarray:
    out = np.zeros(len(counts) + 1, np.int64)
    np.cumsum(counts, out=out[1:])
    return out


@dataclass
class ShardedStats:
    keys: int           # key occurrences in this rank's batches
    unique_keys: int    # keys this rank owns that the pass touches (summed over ranks:
    admitted_keys: int  # the single-process figures)
    staging_bytes: int  # bytes this rank sent to other ranks while staging


class ShardedWorkingSet:
    """One pass's rows, split by owner; ``batches`` are this rank's, remapped per step."""

    def __init__(self, ctx: DistContext, keys: np.ndarray, weights: torch.Tensor,
                 state: torch.Tensor | None, store: MemoryStore, train: bool,
                 batches: list[Batch], global_sizes: np.ndarray, serve_rows: torch.Tensor,
                 serve_offsets: np.ndarray, serve_splits: np.ndarray,
                 request_splits: np.ndarray, stats: ShardedStats) -> None:
        self.ctx = ctx
        self.keys = keys
        self.weights = weights
        self.state = state
        self.optimizer = store.optimizer if train else None
        self.batches = batches
        self.global_sizes = global_sizes
        self._serve_rows = serve_rows
        self._serve_offsets = serve_offsets
        self._serve_splits = serve_splits
        self._request_splits = request_splits
        self.stats = stats
        self.step_bytes = 0
        self.column_mask: torch.Tensor | None = None
        self._scratch = (np.full(weights.shape[0], -1, np.int64)
                         if weights.device.type == "cpu" and train else None)

    # -- pass start ---------------------------------------------------------------------
    @classmethod
    def stage(cls, ctx: DistContext, store: MemoryStore, batches: list[Batch], pass_id: int,
              train: bool = True) -> ShardedWorkingSet:
        """Collective: every rank calls it with its own batches (one per global step)."""
        world, me = ctx.world, ctx.rank
        sizes = ctx.all_gather_object([len(b) for b in batches])
        if len({len(s) for s in sizes}) != 1:
            raise RuntimeError(f"pass {pass_id}: ranks read different numbers of steps "
                               f"{[len(s) for s in sizes]}; do all ranks see the same input?")
        global_sizes = np.asarray(sizes, np.int64).reshape(world, -1).sum(axis=0)
        n_steps = len(batches)
        sent = 0

        # Requester: unique keys of the whole pass, grouped by owner.
        values = [b.sparse.values.numpy() for b in batches]
        all_keys = np.concatenate(values) if values else np.empty(0, np.int64)
        uniq, inverse = unique_inverse(all_keys)
        owner = shard_of(uniq, world)
        order = np.argsort(owner, kind="stable")
        key_counts = np.bincount(owner, minlength=world)
        key_starts = _starts(key_counts)
        send_pos = np.empty(len(uniq), np.int64)
        send_pos[order] = np.arange(len(uniq))
        occ_pos = send_pos[inverse]

        # Requester: per step, the distinct keys it needs, as positions in its request.
        request_splits = np.zeros((n_steps, world), np.int64)
        ids_by_owner: list[list[np.ndarray]] = [[] for _ in range(world)]
        remapped, cursor = [], 0
        for s, (batch, v) in enumerate(zip(batches, values, strict=True)):
            pos = occ_pos[cursor:cursor + len(v)]
            cursor += len(v)
            step_pos, step_ids = np.unique(pos, return_inverse=True)  # sorted: owner-major
            bounds = np.searchsorted(step_pos, key_starts)
            request_splits[s] = np.diff(bounds)
            for o in range(world):
                ids_by_owner[o].append(step_pos[bounds[o]:bounds[o + 1]] - key_starts[o])
            ids = torch.from_numpy(step_ids.reshape(-1).astype(np.int64))
            remapped.append(Batch(batch.dense, batch.sparse.with_values(ids),
                                  batch.labels).to(ctx.device))

        # One exchange of every count the pass needs: keys per owner, ids per step.
        header = np.concatenate([key_counts[:, None], request_splits.T], axis=1)
        recv_header = exchange(ctx, torch.from_numpy(header), [1] * world,
                               [1] * world).cpu().numpy().reshape(world, 1 + n_steps)
        recv_key_counts, serve_by_source = recv_header[:, 0], recv_header[:, 1:]
        off_rank = np.arange(world) != me

        recv_keys = exchange(ctx, torch.from_numpy(uniq[order]), key_counts,
                             recv_key_counts).cpu().numpy()
        sent += 8 * int(key_counts[off_rank].sum())
        # Positions are below the number of keys sent to one owner: int32 halves the bytes.
        if key_counts.max(initial=0) >= 2**31:
            raise ValueError(f"pass {pass_id}: over 2^31 keys for one owner; use more passes")
        ids_send = np.concatenate([np.concatenate(p) if p else np.empty(0, np.int64)
                                   for p in ids_by_owner]).astype(np.int32)
        recv_ids = exchange(ctx, torch.from_numpy(ids_send), request_splits.sum(axis=0),
                            serve_by_source.sum(axis=1)).cpu().numpy().astype(np.int64)
        sent += 4 * int(request_splits.sum(axis=0)[off_rank].sum())

        # Owner: the union of what every rank asked for, pulled once.
        owned, owned_inv = unique_inverse(recv_keys)
        dim = store.row_dim
        if train:
            show = np.bincount(inverse, minlength=len(uniq)).astype(np.float32)
            occ = (np.concatenate([occurrence_labels(b) for b in batches])
                   if batches else np.empty(0, np.float32))
            click = np.bincount(inverse, weights=occ, minlength=len(uniq)).astype(np.float32)
            counts = np.stack([show, click], axis=1)[order]
            recv_counts = exchange(ctx, torch.from_numpy(counts), key_counts,
                                   recv_key_counts).cpu().numpy()
            sent += 8 * int(key_counts[off_rank].sum())
            owned_show = np.bincount(owned_inv, weights=recv_counts[:, 0],
                                     minlength=len(owned)).astype(np.float32)
            owned_click = np.bincount(owned_inv, weights=recv_counts[:, 1],
                                      minlength=len(owned)).astype(np.float32)
            block, admitted = store.pull(owned, owned_show, owned_click, pass_id)
            rows, state_rows, widths = block.values, block.state, block.widths
        else:
            rows, admitted = store.lookup(owned)
            rows, state_rows, widths = rows[admitted], None, None
        n_adm = int(admitted.sum())
        local = np.zeros(len(owned), np.int64)
        local[admitted] = np.arange(1, n_adm + 1)
        weights = torch.zeros(n_adm + 1, dim, dtype=torch.float32)
        weights[1:] = torch.from_numpy(rows)
        state = None
        if state_rows is not None:
            state = torch.zeros(n_adm + 1, state_rows.shape[1], dtype=torch.float32)
            state[1:] = torch.from_numpy(state_rows)
            state = state.to(ctx.device)
        column_mask = None
        if widths is not None:  # variable-length rows: gradients stay off the zero padding
            full = np.concatenate([[dim], widths]).astype(np.int64)
            column_mask = (torch.arange(dim) < torch.from_numpy(full)[:, None]).to(
                torch.float32).to(ctx.device)

        # Owner: requested positions -> working-set rows, regrouped step-major.
        row_of_request = local[owned_inv]
        source = np.repeat(np.arange(world), serve_by_source.sum(axis=1))
        step = np.concatenate([np.repeat(np.arange(n_steps), serve_by_source[r])
                               for r in range(world)]) if n_steps else np.empty(0, np.int64)
        served = row_of_request[_starts(recv_key_counts)[source] + recv_ids]
        served = served[np.lexsort((source, step))]
        serve_offsets = _starts(serve_by_source.sum(axis=0))

        stats = ShardedStats(keys=len(all_keys), unique_keys=len(owned), admitted_keys=n_adm,
                             staging_bytes=sent)
        ws = cls(ctx, owned[admitted], weights.to(ctx.device), state, store, train,
                 remapped, global_sizes, torch.from_numpy(served).to(ctx.device),
                 serve_offsets, serve_by_source.T.copy(), request_splits, stats)
        ws.column_mask = column_mask
        return ws

    # -- per step -----------------------------------------------------------------------
    def _rows(self, step: int) -> torch.Tensor:
        return self._serve_rows[self._serve_offsets[step]:self._serve_offsets[step + 1]]

    def _off_rank(self, splits: np.ndarray) -> int:
        return int(splits.sum() - splits[self.ctx.rank])

    def fetch(self, step: int) -> torch.Tensor:
        """Collective: the step table ``[distinct keys of my batch, row_dim]``."""
        served = self.weights.index_select(0, self._rows(step))
        self.step_bytes += 4 * self.weights.shape[1] * self._off_rank(self._serve_splits[step])
        table = exchange(self.ctx, served, self._serve_splits[step], self._request_splits[step])
        return table.to(self.weights.device)

    def push_gradients(self, step: int, grad: torch.Tensor) -> None:
        """Collective: send the step table's gradient to the owners, which apply the
        sparse optimizer to their rows (gradients of one row from several ranks are
        summed first, as a single process sums a key's occurrences)."""
        if self.optimizer is None or self.state is None:
            raise RuntimeError("push_gradients on a working set staged with train=False")
        self.step_bytes += 4 * grad.shape[1] * self._off_rank(self._request_splits[step])
        received = exchange(self.ctx, grad, self._request_splits[step],
                            self._serve_splits[step]).to(self.weights.device)
        rows = self._rows(step)
        if self.column_mask is not None:
            received = received * self.column_mask.index_select(0, rows)
        self.optimizer.step(self.weights, self.state, rows, received, self._scratch)

    # -- pass end -----------------------------------------------------------------------
    def write_back(self, store: MemoryStore) -> None:
        if self.state is None:
            raise RuntimeError("only a training working set is written back")
        store.push(self.keys, RowBlock(self.weights[1:].cpu().numpy(),
                                       self.state[1:].cpu().numpy()))
