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
then first occurrence; its batch is remapped to ids into that table::

    batch keys (2 ranks):   [k5 k8 k5 k2]       owner(k5)=0 owner(k8)=1 owner(k2)=0
    request to owner 0:     [k5 k2]  positions [0 1];  to owner 1: [k8]  position [0]
    step table rows:        [k5 k2 | k8]        batch ids: [0 2 0 1]

A rank with an empty batch (or no keys for some owner) still joins every exchange with
zero-length splits, which gloo and NCCL both accept.

The requester's side of staging (``plan_rank_pass``, from the pass's local ``PassPlan``)
is local work, so a rank's ``Trainer`` makes it in the read-ahead thread, as one process
plans its pass there (``train.passes.plan_for``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numba
import numpy as np
import torch
import torch.distributed as dist

from terarec.distributed.context import DistContext
from terarec.distributed.link import link_from_env
from terarec.embedding.device import DeviceRowCache
from terarec.embedding.index import unique_inverse
from terarec.embedding.protocol import EmbeddingStore
from terarec.embedding.working_set import (
    PassPlan,
    StagedRows,
    _pooled,
    occurrence_grads,
)
from terarec.kernels import shard_of
from terarec.types import Batch, KeyedIds


def exchange(ctx: DistContext, tensor: torch.Tensor, send_counts: np.ndarray | list[int],
             recv_counts: np.ndarray | list[int], async_op: bool = False,
             group: dist.ProcessGroup | None = None):
    """``all_to_all_single`` along dim 0 in ``group`` (default: the row exchange group):
    ``send_counts[r]`` rows go to rank ``r``, ``recv_counts[r]`` rows come from it (in
    rank order). With ``async_op``: (the output, filled once the returned work's
    ``wait()`` returns, and that work). Under an emulated link (``distributed.link``)
    it first waits what this rank's outgoing rows would take on it."""
    send = [int(c) for c in send_counts]
    recv = [int(c) for c in recv_counts]
    tensor = tensor.to(ctx.comm_device).contiguous()
    if ctx.world == 1:  # nothing to exchange: a copy, as the collective would give
        out = tensor.clone()
        return (out, _Done()) if async_op else out
    out = torch.empty((sum(recv),) + tuple(tensor.shape[1:]), dtype=tensor.dtype,
                      device=tensor.device)
    link = link_from_env()
    if link is not None:  # an emulated slower network: what leaves this rank
        row_bytes = tensor[0].numel() * tensor.element_size() if len(tensor) else 0
        link.pay((sum(send) - send[ctx.rank]) * row_bytes)
    work = dist.all_to_all_single(out, tensor, output_split_sizes=recv,
                                  input_split_sizes=send, group=group or ctx.sparse_group,
                                  async_op=async_op)
    return (out, work) if async_op else out


class _Done:
    """The finished work of an exchange that had nothing to send."""

    def wait(self) -> bool:
        return True


@numba.njit(nogil=True, cache=True)
def _sum_rows(rows, grads, n_rows, world):
    """``out[r] = sum of grads[i] where rows[i] == r``, divided by ``world``."""
    out = np.zeros((n_rows, grads.shape[1]), np.float32)
    for i in range(rows.shape[0]):
        r = rows[i]
        for d in range(grads.shape[1]):
            out[r, d] += grads[i, d]
    for r in range(n_rows):
        for d in range(grads.shape[1]):
            out[r, d] /= world
    return out


class _ShardedLookup(torch.autograd.Function):
    """Pooled lookup into a step table fetched from the owners. The backward forms the
    table's gradient (occurrences of a key summed, divided by the world size: see
    ``train.trainer``) and starts sending it to the owners; the anchor, a scalar that
    requires grad, puts the function in the graph as in ``WorkingSet``'s fused lookup."""

    @staticmethod
    def forward(ctx, anchor: torch.Tensor, ws: ShardedWorkingSet, step: int,
                table: torch.Tensor, sparse: KeyedIds,
                mean_fields: torch.Tensor | None) -> torch.Tensor:
        ctx.ws, ctx.step, ctx.sparse, ctx.mean_fields = ws, step, sparse, mean_fields
        ctx.table = table
        return _pooled(table, sparse, mean_fields)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        rows, occ_grad = occurrence_grads(grad, ctx.sparse, ctx.mean_fields)
        ws: ShardedWorkingSet = ctx.ws
        table: torch.Tensor = ctx.table
        world = ws.ctx.world
        if grad.device.type == "cpu":  # torch's CPU index_add_ is several times slower
            table_grad = torch.from_numpy(_sum_rows(
                rows.numpy(), np.ascontiguousarray(occ_grad.detach().numpy()),
                table.shape[0], world))
        else:
            table_grad = torch.zeros(table.shape, dtype=grad.dtype, device=grad.device)
            table_grad.index_add_(0, rows, occ_grad).div_(world)
        l2 = ws.l2_per_occurrence(ctx.step)
        if l2:  # this rank's occurrences of each row; the owner sums over ranks
            counts = torch.bincount(rows, minlength=table.shape[0]).to(table_grad.dtype)
            table_grad += (l2 * counts).unsqueeze(1) * table
        ws._send_gradients(ctx.step, table_grad)
        return torch.zeros((), device=grad.device), None, None, None, None, None


def _starts(counts: np.ndarray) -> np.ndarray:
    out = np.zeros(len(counts) + 1, np.int64)
    np.cumsum(counts, out=out[1:])
    return out


@numba.njit(nogil=True, cache=True)
def _step_requests(occ_pos, step_starts, pos_owner, world):
    """Per step, the distinct positions its key occurrences need, grouped by owner (in
    order of first occurrence within an owner), in two passes over the occurrences:

    splits[s, o]   distinct positions of step s owned by rank o
    ids[i]         occurrence i's row in its step table (owner-major)
    requests       the positions, owner-major then step-major: what each owner is sent
    """
    n_steps = step_starts.shape[0] - 1
    mark = np.full(pos_owner.shape[0], -1, np.int64)  # rank of a position within its owner
    splits = np.zeros((n_steps, world), np.int64)
    ids = np.empty(occ_pos.shape[0], np.int64)
    distinct = np.empty(occ_pos.shape[0], np.int64)  # step-major, first occurrence order
    distinct_start = np.zeros(n_steps + 1, np.int64)
    row_start = np.empty(world, np.int64)
    n = 0
    for s in range(n_steps):
        for i in range(step_starts[s], step_starts[s + 1]):
            p = occ_pos[i]
            if mark[p] < 0:
                o = pos_owner[p]
                mark[p] = splits[s, o]
                splits[s, o] += 1
                distinct[n] = p
                n += 1
        acc = 0
        for o in range(world):
            row_start[o] = acc
            acc += splits[s, o]
        for i in range(step_starts[s], step_starts[s + 1]):
            p = occ_pos[i]
            ids[i] = row_start[pos_owner[p]] + mark[p]
        distinct_start[s + 1] = n
        for j in range(distinct_start[s], n):
            mark[distinct[j]] = -1
    # each (owner, step) block's start in the owner-major request list
    block = np.empty((world, n_steps), np.int64)
    total = 0
    for o in range(world):
        for s in range(n_steps):
            block[o, s] = total
            total += splits[s, o]
    requests = np.empty(total, np.int64)
    fill = np.empty(world, np.int64)
    for s in range(n_steps):
        for o in range(world):
            fill[o] = block[o, s]
        for j in range(distinct_start[s], distinct_start[s + 1]):
            p = distinct[j]
            o = pos_owner[p]
            requests[fill[o]] = p
            fill[o] += 1
    return splits, ids, requests


@dataclass
class RankPassPlan:
    """The requester's half of staging: local work only (no store, no collective), so it
    runs ahead in the read-ahead thread while the previous pass trains.

    ``keys`` are the pass's unique keys grouped by owner (``key_counts`` per owner), with
    their shows and clicks in ``counts``; per step, ``request_splits[s, o]`` distinct keys
    go to owner ``o``, as positions ``request_ids`` (int32, owner-major, each relative to
    that owner's keys), and ``remapped`` are the batches with keys replaced by rows of
    their step table."""

    world: int
    batches: list[Batch]
    remapped: list[Batch]
    keys: np.ndarray
    key_counts: np.ndarray
    counts: np.ndarray | None
    request_splits: np.ndarray
    request_ids: np.ndarray
    occurrences: int


def plan_rank_pass(plan: PassPlan, world: int) -> RankPassPlan:
    """Plan this rank's share of a pass for ``ShardedWorkingSet.stage``, from its local
    plan (unique keys, occurrences, and shows and clicks when ``plan`` has them)."""
    batches = plan.batches
    uniq, inverse = plan.keys, plan.inverse
    owner = shard_of(uniq, world)
    # A stable sort of small integers is a radix sort: O(n).
    order = np.argsort(owner.astype(np.int16 if world < 2**15 else np.int64), kind="stable")
    key_counts = np.bincount(owner, minlength=world).astype(np.int64)
    key_starts = _starts(key_counts)
    send_pos = np.empty(len(uniq), np.int64)
    send_pos[order] = np.arange(len(uniq))
    step_starts = _starts(np.array([b.sparse.values.numel() for b in batches], np.int64))
    splits, ids, requests = _step_requests(send_pos[inverse], step_starts,
                                           owner[order], world)
    if key_counts.max(initial=0) >= 2**31:
        raise ValueError("over 2^31 keys for one owner in one pass; use shorter passes")
    # Positions are below the number of keys sent to one owner: int32 halves the bytes.
    request_owner = np.repeat(np.arange(world), splits.sum(axis=0))
    request_ids = (requests - key_starts[request_owner]).astype(np.int32)
    remapped = [Batch(b.dense, b.sparse.with_values(torch.from_numpy(ids[a:z])), b.labels)
                for b, a, z in zip(batches, step_starts[:-1], step_starts[1:], strict=True)]
    show_click = None
    if plan.show is not None and plan.click is not None:
        show_click = np.stack([plan.show, plan.click], axis=1)[order]
    return RankPassPlan(world=world, batches=batches, remapped=remapped, keys=uniq[order],
                        key_counts=key_counts, counts=show_click, request_splits=splits,
                        request_ids=request_ids, occurrences=len(inverse))


@dataclass
class ShardedPassPlan:
    """A pass after its key exchange: ``rank`` (this rank's requests) and the owner's half,
    the union of keys every rank asked this rank for, with their summed shows and clicks
    (None when scoring). Made in the read-ahead thread over its own process group, so a
    pass starts with only the owner's pull on the critical path."""

    rank: RankPassPlan
    global_sizes: np.ndarray          # rows of each global step
    serve_by_source: np.ndarray       # [world, steps] rows each rank asked for per step
    owned: np.ndarray                 # unique keys asked of this rank
    owned_show: np.ndarray | None
    owned_click: np.ndarray | None
    request_owned: np.ndarray         # per served row (step-major, then source): its key
    staging_bytes: int                # bytes sent to other ranks by the exchange


def exchange_plan(ctx: DistContext, plan: RankPassPlan,
                  group: dist.ProcessGroup | None = None) -> ShardedPassPlan:
    """Collective (in ``group``): send this rank's requests to the owners and receive the
    requests of every rank for the keys it owns. ``plan.counts`` (shows and clicks) go
    along when the plan has them (training)."""
    world, me = ctx.world, ctx.rank
    if plan.world != world:
        raise ValueError(f"a pass planned for {plan.world} ranks, run on {world}")
    n_steps = len(plan.batches)
    steps = exchange(ctx, torch.tensor([n_steps] * world), [1] * world, [1] * world,
                     group=group).cpu().numpy()
    if (steps != n_steps).any():
        raise RuntimeError(f"ranks read different numbers of steps {steps.tolist()}; do all "
                           "ranks see the same input?")
    key_counts, request_splits = plan.key_counts, plan.request_splits
    sizes = np.array([len(b) for b in plan.batches], np.int64)
    # One exchange of every count the pass needs: keys per owner, ids and rows per step.
    header = np.concatenate([key_counts[:, None], request_splits.T,
                             np.broadcast_to(sizes, (world, n_steps))], axis=1)
    recv_header = exchange(ctx, torch.from_numpy(np.ascontiguousarray(header)), [1] * world,
                           [1] * world, group=group).cpu().numpy().reshape(world, 1 + 2 * n_steps)
    recv_key_counts = recv_header[:, 0]
    serve_by_source = recv_header[:, 1:1 + n_steps]
    global_sizes = recv_header[:, 1 + n_steps:].sum(axis=0)
    off_rank = np.arange(world) != me

    recv_keys = exchange(ctx, torch.from_numpy(plan.keys), key_counts, recv_key_counts,
                         group=group).cpu().numpy()
    sent = 8 * int(key_counts[off_rank].sum())
    recv_ids = exchange(ctx, torch.from_numpy(plan.request_ids), request_splits.sum(axis=0),
                        serve_by_source.sum(axis=1), group=group).cpu().numpy().astype(np.int64)
    sent += 4 * int(request_splits.sum(axis=0)[off_rank].sum())
    owned, owned_inv = unique_inverse(recv_keys)
    owned_show = owned_click = None
    if plan.counts is not None:
        recv_counts = exchange(ctx, torch.from_numpy(plan.counts), key_counts,
                               recv_key_counts, group=group).cpu().numpy()
        sent += 8 * int(key_counts[off_rank].sum())
        owned_show = np.bincount(owned_inv, weights=recv_counts[:, 0],
                                 minlength=len(owned)).astype(np.float32)
        owned_click = np.bincount(owned_inv, weights=recv_counts[:, 1],
                                  minlength=len(owned)).astype(np.float32)
    # Requested positions -> keys of ``owned``, regrouped step-major (then by source).
    source = np.repeat(np.arange(world), serve_by_source.sum(axis=1))
    step = np.concatenate([np.repeat(np.arange(n_steps), serve_by_source[r])
                           for r in range(world)]) if n_steps else np.empty(0, np.int64)
    request_owned = owned_inv[_starts(recv_key_counts)[source] + recv_ids]
    request_owned = request_owned[np.lexsort((source, step))]
    return ShardedPassPlan(rank=plan, global_sizes=global_sizes,
                           serve_by_source=serve_by_source, owned=owned,
                           owned_show=owned_show, owned_click=owned_click,
                           request_owned=request_owned, staging_bytes=sent)


@dataclass
class ShardedStats:
    keys: int           # key occurrences in this rank's batches
    unique_keys: int    # keys this rank owns that the pass touches (summed over ranks:
    admitted_keys: int  # the single-process figures)
    staging_bytes: int  # bytes this rank sent to other ranks while staging


class ShardedWorkingSet(StagedRows):
    """One pass's rows, split by owner; ``batches`` are this rank's, remapped per step."""

    def __init__(self, ctx: DistContext, keys: np.ndarray, weights: torch.Tensor,
                 state: torch.Tensor | None, store: EmbeddingStore, train: bool,
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
        self._in_flight: tuple | None = None  # gradients being sent (step, ...)
        self.column_mask: torch.Tensor | None = None
        # this rank's batches with their global keys (``batches`` hold step-table ids):
        # what names an item the same way on every rank
        self.keyed_batches: list[Batch] = batches
        # the device row cache the trained rows go back to (``stage(cache=)``), or None
        self.cache: DeviceRowCache | None = None
        self.pass_id = 0
        self.pass_show: np.ndarray | None = None
        self._scratch = (np.full(weights.shape[0], -1, np.int64)
                         if weights.device.type == "cpu" and train else None)
        self.lazy_l2 = (self.optimizer.lazy_l2(weights.shape[0], weights.device)
                        if self.optimizer is not None else None)

    # -- pass start ---------------------------------------------------------------------
    @classmethod
    def stage(cls, ctx: DistContext, store: EmbeddingStore, plan: ShardedPassPlan,
              pass_id: int, train: bool = True,
              cache: DeviceRowCache | None = None) -> ShardedWorkingSet:
        """Collective: every rank calls it with the plan of its own batches (one per global
        step), made ahead (``plan_rank_pass``, then ``exchange_plan``). With a
        device ``cache`` (``--device-budget``), the owner's rows it holds come from it, as
        in one process (``WorkingSet.stage``), and trained rows go back to it."""
        if cache is not None:
            cache.bind(store)
        if train and plan.owned_show is None:
            raise ValueError(f"pass {pass_id}: a training pass needs a plan with counts")
        serve_by_source = plan.serve_by_source
        remapped = [b.to(ctx.device) for b in plan.rank.remapped]

        # Owner: the union of what every rank asked for, pulled once.
        owned = plan.owned
        dim = store.row_dim
        if train:
            assert plan.owned_show is not None and plan.owned_click is not None
            block, admitted = store.pull(owned, plan.owned_show, plan.owned_click, pass_id)
            rows, state_rows, widths = block.values, block.state, block.widths
        else:
            rows, admitted = store.lookup(owned)
            rows, state_rows, widths = rows[admitted], None, None
        n_adm = int(admitted.sum())
        local = np.zeros(len(owned), np.int64)
        local[admitted] = np.arange(1, n_adm + 1)
        state = None
        if cache is not None and train:
            weights, state = cache.assemble(owned[admitted], block, pass_id)
        else:
            weights = torch.zeros(n_adm + 1, dim, dtype=torch.float32)
            weights[1:] = torch.from_numpy(rows)
            weights = weights.to(ctx.device)
            if cache is not None:
                cache.overlay(owned[admitted], weights)
            if state_rows is not None:
                state = torch.zeros(n_adm + 1, state_rows.shape[1], dtype=torch.float32)
                state[1:] = torch.from_numpy(state_rows)
                state = state.to(ctx.device)
        column_mask = None
        if widths is not None:  # variable-length rows: gradients stay off the zero padding
            full = np.concatenate([[dim], widths]).astype(np.int64)
            column_mask = (torch.arange(dim) < torch.from_numpy(full)[:, None]).to(
                torch.float32).to(ctx.device)

        # Owner: requested keys -> working-set rows (step-major, then by source).
        served = local[plan.request_owned]
        serve_offsets = _starts(serve_by_source.sum(axis=0))

        stats = ShardedStats(keys=plan.rank.occurrences, unique_keys=len(owned),
                             admitted_keys=n_adm, staging_bytes=plan.staging_bytes)
        ws = cls(ctx, owned[admitted], weights, state, store, train,
                 remapped, plan.global_sizes, torch.from_numpy(served).to(ctx.device),
                 serve_offsets, serve_by_source.T.copy(), plan.rank.request_splits, stats)
        ws.column_mask = column_mask
        ws.keyed_batches = plan.rank.batches
        if cache is not None and train:
            assert plan.owned_show is not None
            ws.cache, ws.pass_id, ws.pass_show = cache, pass_id, plan.owned_show[admitted]
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

    def step_table(self, step: int) -> torch.Tensor:
        """Collective: the rows step ``step``'s remapped batch indexes (``fetch``); scoring
        pools them as one process pools ``WorkingSet.step_table``."""
        return self.fetch(step)

    def lookup(self, step: int, sparse: KeyedIds, mean_fields: torch.Tensor | None,
               anchor: torch.Tensor) -> torch.Tensor:
        """Collective: step ``step``'s pooled embeddings ``[batch, fields, row_dim]``. Its
        backward sends the step table's gradient to the owners without waiting for it;
        ``apply_gradients`` completes the step."""
        return _ShardedLookup.apply(anchor, self, step, self.fetch(step), sparse, mean_fields)

    def l2_per_occurrence(self, step: int) -> float:
        """``embedding_l2``'s coefficient per key occurrence at global step ``step``: a
        single process's, whose batch is the step's rows on all ranks."""
        if self.optimizer is None:
            return 0.0
        return self.optimizer.l2_per_occurrence(max(int(self.global_sizes[step]), 1))

    def _send_gradients(self, step: int, grad: torch.Tensor) -> None:
        """Start the exchange of the step table's gradient (already divided by the world
        size) to the owners; it runs while DDP's all-reduce and the dense step finish."""
        self.step_bytes += 4 * grad.shape[1] * self._off_rank(self._request_splits[step])
        received, work = exchange(self.ctx, grad, self._request_splits[step],
                                  self._serve_splits[step], async_op=True)
        self._in_flight = (step, received, work, grad)  # the send buffer must outlive it

    def apply_gradients(self, step: int) -> None:
        """Collective: finish step ``step``'s gradient exchange (sending zeros if this
        rank's loss never reached the table, e.g. an empty batch); the owners apply the
        sparse optimizer to their rows (gradients of one row from several ranks are
        summed, as a single process sums a key's occurrences)."""
        if self.optimizer is None or self.state is None:
            raise RuntimeError("apply_gradients on a working set staged with train=False")
        if self._in_flight is None or self._in_flight[0] != step:
            rows = int(self._request_splits[step].sum())
            self._send_gradients(step, torch.zeros(rows, self.weights.shape[1],
                                                   device=self.weights.device))
        assert self._in_flight is not None  # set by _send_gradients
        _, received, work, _ = self._in_flight
        work.wait()
        self._in_flight = None
        received = received.to(self.weights.device)
        step_rows = self._rows(step)
        if self.column_mask is not None:
            received = received * self.column_mask.index_select(0, step_rows)
        # the embedding_l2 term is in ``received`` already (added by each requester)
        self.optimizer.step(self.weights, self.state, step_rows, received, self._scratch,
                            occurrence_l2=False, lazy=self.lazy_l2, step_index=step)
