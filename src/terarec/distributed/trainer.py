"""``ShardedTrainer``: the pass loop of ``Trainer`` over N torchrun ranks.

Each rank reads its round-robin share of every pass (see ``sharding``), owns one shard of
the store, and trains one local batch per global step::

    stage       ShardedWorkingSet.stage: keys to owners, owners pull rows (once a pass)
    per step    emb = ws.lookup(s, ...)                   rows from their owners
                loss = sum_bce(local) * world / global_rows
                loss.backward()                           DDP all-reduces dense grads; the
                                                          lookup's backward starts sending
                                                          table.grad / world to the owners
                dense_optimizer.step()                    while that exchange runs
                ws.apply_gradients(s)                     owners apply the sparse optimizer
    pass end    owners write rows back to their own store

Scaling: a single process minimises the mean loss over the global batch. Rank r's local
loss is ``sum_bce_r * world / B``, so DDP's average over ranks gives the single-process
dense gradient, and dividing the row gradients by ``world`` gives the single-process row
gradient once the owner sums what every rank sent.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from tqdm.auto import tqdm

from terarec.config import TrainConfig
from terarec.data.readers import ReadStats
from terarec.distributed.context import DistContext
from terarec.distributed.dense_comm import DenseComm, DenseCommConfig
from terarec.distributed.lookup import (
    ShardedPassPlan,
    ShardedWorkingSet,
    exchange_plan,
    plan_rank_pass,
)
from terarec.distributed.sharding import deal_batches, iter_rank_passes
from terarec.embedding.protocol import EmbeddingStore
from terarec.embedding.working_set import _pooled
from terarec.train.passes import group_passes
from terarec.train.trainer import PassResult, Trainer, _start_prefetch
from terarec.types import Batch, FeatureSchema


@dataclass
class ShardedPassResult(PassResult):
    """``PassResult`` (global figures: rows, loss, keys summed over ranks) plus traffic."""

    world_size: int = 1
    dense_bytes_per_step: float = 0.0
    sparse_bytes_per_step: float = 0.0


class ShardedTrainer(Trainer):
    """A ``Trainer`` whose store holds this rank's key shard and whose dense model is
    wrapped in DistributedDataParallel with the chosen communication hook."""

    def __init__(self, schema: FeatureSchema, config: TrainConfig, ctx: DistContext,
                 dense_comm: DenseCommConfig | None = None,
                 store: EmbeddingStore | None = None) -> None:
        # The config keeps the user's device ("auto" stays "auto" in the saved model, so
        # one process can load it anywhere); the rank itself runs on the device it got.
        super().__init__(schema, _rank_store_config(config, ctx.rank), store)
        self.config = config
        self.ctx = ctx
        self.device = ctx.device
        self.model.to(ctx.device)
        if self.mean_fields is not None:
            self.mean_fields = self.mean_fields.to(ctx.device)
        self._anchor = torch.zeros((), requires_grad=True, device=ctx.device)
        self.dense_comm_config = dense_comm or DenseCommConfig()
        ids = [ctx.device.index] if ctx.device.type == "cuda" else None
        self.ddp = DistributedDataParallel(self.model, device_ids=ids, broadcast_buffers=False,
                                           gradient_as_bucket_view=True)
        self.dense_comm = DenseComm(self.ddp, self.dense_comm_config, ctx.world)

    @property
    def rank(self) -> int:
        return self.ctx.rank

    # -- training -----------------------------------------------------------------------
    def _step_loss(self, ws: ShardedWorkingSet, step: int, batch: Batch) -> torch.Tensor:
        """Summed BCE of a local batch. A rank with no rows this step still runs the
        model (DDP all-reduces on every rank), on one zero sample weighted 0."""
        if len(batch) == 0:
            ws.fetch(step)  # collective: the owners serve whoever asked
            dense = torch.zeros(1, batch.dense.shape[1], device=self.device)
            emb = torch.zeros(1, batch.sparse.num_fields, self.model.row_dim,
                              device=self.device)
            logits = self.ddp(dense, emb)
            return F.binary_cross_entropy_with_logits(logits, torch.zeros_like(logits),
                                                      reduction="sum") * 0.0
        emb = ws.lookup(step, batch.sparse, self.mean_fields, self._anchor)
        logits = self.ddp(batch.dense, emb)
        return F.binary_cross_entropy_with_logits(logits, batch.labels, reduction="sum")

    def iter_passes(self, train_paths: list[str | Path], stats: ReadStats | None = None,
                    first: int = 0, skip: int = 0) -> Iterator[list[Batch] | ShardedPassPlan]:
        """This rank's share of every pass, planned in the read-ahead thread: the requests
        (``plan_rank_pass``) and their exchange with the owners (``exchange_plan``, in the
        context's own planning group); passes below ``skip`` (already trained, when
        resuming) are not planned."""
        cfg = self.config
        world = self.ctx.world
        groups = iter_rank_passes(train_paths, self.schema, cfg.batch_size, cfg.pass_rows,
                                  self.ctx.rank, world, on_bad_row=cfg.on_bad_row, stats=stats,
                                  ctx=self.ctx)
        return (self.plan(g) if number >= skip else g for number, g in enumerate(groups, first))

    def plan(self, batches: list[Batch]) -> ShardedPassPlan:
        """Collective in the planning group: this rank's share of a training pass, planned
        and exchanged with the owners. Call it from one thread only (the read-ahead one),
        in pass order on every rank."""
        ctx = self.ctx
        return exchange_plan(ctx, plan_rank_pass(batches, ctx.world), group=ctx.plan_group)

    def train_pass(self, batches: list[Batch] | ShardedPassPlan, progress: tqdm | None = None,
                   upcoming: list[Batch] | ShardedPassPlan | None = None) -> PassResult:
        """Collective: stage, train and write back this rank's share of one pass.

        ``upcoming``: the next pass; once planned (``plan``, whose key exchange told this
        rank which keys it will serve), a store with a disk tier reads their rows into
        RAM in a thread while this pass trains."""
        self.model.train()
        ctx = self.ctx
        t0 = time.perf_counter()
        ws = ShardedWorkingSet.stage(ctx, self.store, batches, self.pass_id, train=True)
        prefetcher = _start_prefetch(
            self.store, upcoming.owned if isinstance(upcoming, ShardedPassPlan) else None)
        t1 = time.perf_counter()
        loss_sum = torch.zeros((), dtype=torch.float64)
        bytes_before = self.dense_comm.meter.bytes
        for step, batch in enumerate(ws.batches):
            bce = self._step_loss(ws, step, batch)
            global_rows = max(int(ws.global_sizes[step]), 1)
            self.dense_optimizer.zero_grad(set_to_none=True)
            (bce * (ctx.world / global_rows)).backward()  # starts the row gradients' exchange
            self.dense_optimizer.step()
            ws.apply_gradients(step)
            self.dense_comm.count_step()
            loss_sum += bce.detach().to(torch.float64).cpu()
            if progress is not None:
                progress.update(global_rows)
        t2 = time.perf_counter()
        wait_s, evicted = self._close_pass(ws, prefetcher)
        t3 = time.perf_counter()
        steps = max(len(ws.batches), 1)
        local_rows = sum(len(b) for b in ws.batches)
        totals = ctx.all_sum([float(loss_sum), local_rows, ws.stats.unique_keys,
                              ws.stats.admitted_keys, evicted, len(self.store),
                              (ws.stats.staging_bytes + ws.step_bytes) / steps,
                              (self.dense_comm.meter.bytes - bytes_before) / steps,
                              t3 - t0])
        rows = int(totals[1])
        result = ShardedPassResult(
            pass_id=self.pass_id, rows=rows, train_loss=float(totals[0] / max(rows, 1)),
            staging_s=t1 - t0, train_s=t2 - t1, write_back_s=t3 - t2,
            samples_per_s=float(rows / (totals[8] / ctx.world)), unique_keys=int(totals[2]),
            admitted_keys=int(totals[3]), evicted_keys=int(totals[4]),
            store_keys=int(totals[5]), prefetch_wait_s=wait_s, world_size=ctx.world,
            dense_bytes_per_step=float(totals[7] / ctx.world),
            sparse_bytes_per_step=float(totals[6] / ctx.world))
        self.pass_id += 1
        return result

    # -- scoring ------------------------------------------------------------------------
    @torch.no_grad()
    def predict_batches(self, batches: list[Batch]) -> np.ndarray:
        """Collective: probabilities for this rank's batches (one per step, as in
        training); rows come from their owners, the store is unchanged."""
        self.model.eval()
        ws = ShardedWorkingSet.stage(self.ctx, self.store, batches, self.pass_id, train=False)
        out = []
        for step, batch in enumerate(ws.batches):
            table = ws.fetch(step)
            if len(batch):
                emb = _pooled(table, batch.sparse, self.mean_fields)
                out.append(torch.sigmoid(self.model(batch.dense, emb)).cpu())
        return torch.cat(out).numpy() if out else np.empty(0, np.float32)

    def predict_stream(self, batches: Iterable[Batch]) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Collective over the same global batches on every rank: each rank scores its
        round-robin share and yields (probabilities, labels) for it."""
        for group in group_passes(batches, self.config.pass_rows):
            mine = deal_batches(group, self.ctx.rank, self.ctx.world)
            labels = (torch.cat([b.labels for b in mine]).numpy() if mine
                      else np.empty(0, np.float32))
            yield self.predict_batches(mine), labels

    def _all_scores(self, labels: np.ndarray,
                    probs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Collective: every rank's (labels, probabilities), so ``evaluate`` gives the same
        metrics on every rank."""
        parts = self.ctx.all_gather_object((labels, probs))
        return (np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]))

    def fit(self, train_paths: list[str | Path], valid_batches: list[Batch] | None = None,
            *, progress: bool = True, stats: ReadStats | None = None, on_pass_end=None,
            skip_passes: int = 0, selection=None) -> list[dict]:
        """Collective ``Trainer.fit``; only rank 0 shows a progress bar. Evaluations are
        gathered, so every rank's ``selection`` takes the same stop decision."""
        return super().fit(train_paths, valid_batches, progress=progress and self.ctx.is_main,
                           stats=stats, on_pass_end=on_pass_end, skip_passes=skip_passes,
                           selection=selection)


def _rank_store_config(config: TrainConfig, rank: int) -> TrainConfig:
    """Each rank's tiered store gets its own disk folder under ``--store-dir``."""
    if not config.store.disk_path:
        return config
    folder = str(Path(config.store.disk_path) / f"rank-{rank:05d}")
    return replace(config, store=replace(config.store, disk_path=folder))
