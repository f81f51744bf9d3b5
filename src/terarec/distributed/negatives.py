"""In-batch negatives across ranks: every rank's clicked items, gathered with gradients.

One process scores each clicked row of a global batch against every clicked item of
that batch (``DSSM.in_batch_softmax``). On N ranks a rank holds only its local batch, so
it gathers the item vectors and ids of every rank's clicked rows, in rank order (which
is row order: rank r trains local batch r of the step), and scores its own rows against
all of them. The gathered vectors keep their graph: each rank's loss sends gradients to
the item tower of every rank, summed by the backward's all-reduce, so N ranks train the
model one process trains::

    sizes      all_gather  [P_0, ..., P_{N-1}]   clicked rows per rank
    ids        all_gather  padded to max P       (int64, no gradient)
    items      all_gather  padded to max P       backward: all_reduce, own slice kept
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from terarec.distributed.context import DistContext


class _GatherRows(torch.autograd.Function):
    """``all_gather`` of equal-shaped row blocks, concatenated. The backward sums every
    rank's gradient of the whole result and keeps this rank's block: an all-reduce,
    since gloo has no reduce-scatter."""

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, rank: int, world: int) -> torch.Tensor:
        parts = [torch.empty_like(rows) for _ in range(world)]
        dist.all_gather(parts, rows.contiguous())
        ctx.block = (rank * rows.shape[0], (rank + 1) * rows.shape[0])
        return torch.cat(parts)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        total = grads[0].contiguous().clone()
        dist.all_reduce(total)
        lo, hi = ctx.block
        return total[lo:hi], None, None


def gather_positives(ctx: DistContext, items: torch.Tensor, ids: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Every rank's clicked item vectors ``[P, K]`` (with gradients) and item ids
    ``[P]``, in rank order, and where this rank's rows start among them. Collective;
    alone, the inputs as they are."""
    if ctx.world == 1:
        return items, ids, 0
    sizes_t = torch.tensor([len(ids)], dtype=torch.int64, device=ids.device)
    parts = [torch.empty_like(sizes_t) for _ in range(ctx.world)]
    dist.all_gather(parts, sizes_t)
    sizes = [int(p.item()) for p in parts]
    width = max(sizes)
    first = sum(sizes[:ctx.rank])
    if width == 0:  # no clicks on any rank this step: every rank returns here
        return items[:0], ids[:0], first
    pad = width - len(ids)
    padded_ids = torch.cat([ids, ids.new_zeros(pad)])
    id_parts = [torch.empty_like(padded_ids) for _ in range(ctx.world)]
    dist.all_gather(id_parts, padded_ids)
    padded = torch.cat([items, items.new_zeros(pad, items.shape[1])])
    gathered = _GatherRows.apply(padded, ctx.rank, ctx.world)
    keep = torch.cat([torch.arange(q * width, q * width + n, device=ids.device)
                      for q, n in enumerate(sizes)])
    return gathered.index_select(0, keep), torch.cat(id_parts).index_select(0, keep), first
