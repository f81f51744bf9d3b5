"""The pass loop, for one process or one of N torchrun ranks: stage a pass's working
set, train its batches, write rows back.

One process (``DistContext.single``, the local fast path)::

    for each pass (N rows, read ahead in a thread):
        ws = WorkingSet.stage(store, batches)      unique keys -> store.pull -> device tensor
        for batch in ws.batches:                   plain lookups over ws.weights
            loss.backward()                        sparse optimizer runs inside backward
            dense_optimizer.step()
        ws.write_back(store); store.end_pass()     rows + optimizer state back, eviction

Rank r of N (``DistContext`` from torchrun): each rank reads its round-robin share of
every pass (``distributed.sharding``), owns one shard of the store, and trains one local
batch per global step::

    stage       ShardedWorkingSet.stage: keys to owners, owners pull rows (once a pass)
    per step    emb = ws.lookup(s, ...)                   rows from their owners
                loss = sum_bce(local) * world / global_rows
                loss.backward()                           DDP all-reduces dense grads; the
                                                          lookup's backward starts sending
                                                          table.grad / world to the owners
                dense_comm.step()                         while that exchange runs: the
                                                          optimizer's step (with dgc, on
                                                          the local gradient, then the
                                                          compressed update's exchange)
                ws.apply_gradients(s)                     owners apply the sparse optimizer
    pass end    owners write rows back to their own store

Scaling: a single process minimises the mean loss over the global batch. Rank r's local
loss is ``sum_bce_r * world / B``, so DDP's average over ranks gives the single-process
dense gradient, and dividing the row gradients by ``world`` gives the single-process row
gradient once the owner sums what every rank sent. Every figure of a ``PassResult`` is
summed over ranks (a no-op in one process), so history records read the same at any
world size.
"""

from __future__ import annotations

import inspect
import math
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from tqdm.auto import tqdm

from terarec.config import DenseCommConfig, TrainConfig, parse_bytes
from terarec.data.positions import Idle, PassInput, Positions
from terarec.data.readers import ReadStats
from terarec.distributed.context import DistContext, resolve_device
from terarec.distributed.dense_comm import DenseComm
from terarec.distributed.lookup import ShardedWorkingSet
from terarec.distributed.negatives import gather_positives
from terarec.distributed.sharding import iter_rank_pass_inputs, iter_rank_passes
from terarec.embedding.device import make_device_cache
from terarec.embedding.optimizers import SparseOptimizer, slot_l2
from terarec.embedding.protocol import EmbeddingStore
from terarec.embedding.store import MemoryStore
from terarec.embedding.tiered import TieredStore
from terarec.embedding.working_set import WorkingSet, _pooled
from terarec.finite import check_model_scores
from terarec.modeldir import choose_checkpoint, comm_file, read_model_meta
from terarec.models import build_model
from terarec.models.base import CTRModel
from terarec.models.dssm import DSSM
from terarec.models.registry import check_model_fits
from terarec.train.dense_optimizer import dense_optimizer
from terarec.train.dense_step import DenseStep
from terarec.train.loop import StreamOptions, TrialRun, run_passes
from terarec.train.metrics import evaluate_scores, evaluate_tasks, offset_shift
from terarec.train.passes import (
    Inputs,
    Pass,
    iter_file_batches,
    iter_input_passes,
    iter_scoring_passes,
    plan_for,
    shuffled_steps,
    stage_pass,
)
from terarec.train.selection import SelectionTracker
from terarec.types import Batch, FeatureSchema

# Rows of a pass ``Trainer.recalibrate`` fits the output bias on, at most: the click
# rate of 65,536 rows is known to within about 0.01 logit.
RECALIBRATE_ROWS = 65_536


@dataclass
class PassResult:
    pass_id: int
    rows: int
    train_loss: float
    staging_s: float
    train_s: float
    write_back_s: float
    samples_per_s: float
    unique_keys: int
    admitted_keys: int
    evicted_keys: int
    store_keys: int
    prefetch_wait_s: float = 0.0  # time the pass waited for the next pass's disk reads
    world_size: int = 1
    dense_bytes_per_step: float = 0.0   # per rank: DDP's gradient exchange
    sparse_bytes_per_step: float = 0.0  # per rank: keys, rows and row gradients sent
    new_keys: int = 0       # keys admitted in this pass (docs/admission.md)
    rejected_keys: int = 0  # the pass's keys admission left on the zero row

    def as_dict(self) -> dict:
        return asdict(self)


# Each rank keeps its own batch-norm statistics between steps (no broadcast in every
# forward); torch 2.13 renamed the switch and warns on the old name.
_NO_FORWARD_BUFFER_SYNC: dict[str, Any] = (
    {"forward_sync_buffers": False}
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
    else {"broadcast_buffers": False})


class TaskLoss:
    """Binary cross-entropy; for ``[B, T]`` logits (several labels), each task's weighted
    by its ``label_weights`` entry and summed over tasks, against the targets the model
    trains each task on (``CTRModel.task_targets``). A callable of its own, not a
    trainer method: the dense step holds it, and a reference back to the trainer would
    keep a dropped trainer (and its store folder's lock) alive until a garbage
    collection."""

    def __init__(self, model: CTRModel, task_weights: Sequence[float]) -> None:
        self.model = model
        self.task_weights = tuple(task_weights)

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor,
                 reduction: str = "mean") -> torch.Tensor:
        if logits.dim() == 1:
            return F.binary_cross_entropy_with_logits(logits, labels, reduction=reduction)
        weights = torch.tensor(self.task_weights, device=logits.device)
        per_row = (F.binary_cross_entropy_with_logits(
            logits, self.model.task_targets(labels), reduction="none") * weights).sum(1)
        return per_row.sum() if reduction == "sum" else per_row.mean()


class Trainer:
    """Owns the model, the store and the optimizers; trains pass by pass.

    ``ctx`` is the topology: alone by default; a torchrun rank's ``DistContext`` makes the
    store this rank's key shard and wraps the dense model in DistributedDataParallel with
    the ``dense_comm`` hook."""

    def __init__(self, schema: FeatureSchema, config: TrainConfig,
                 store: EmbeddingStore | None = None,
                 ctx: DistContext | None = None,
                 dense_comm: DenseCommConfig | None = None) -> None:
        self.schema = schema
        # The config keeps the user's device ("auto" stays "auto" in the saved model, so
        # one process can load it anywhere); a rank runs on the device it got.
        self.config = config
        self.ctx = ctx if ctx is not None else DistContext.single(resolve_device(config.device))
        self.dense_comm_config = dense_comm or DenseCommConfig()
        if self.ctx.world == 1 and self.dense_comm_config.mode != "none":
            raise ValueError(f"dense gradient exchange {self.dense_comm_config.mode!r} needs "
                             "several ranks: launch with torchrun --nproc_per_node N")
        if config.threads:
            torch.set_num_threads(config.threads)
        torch.manual_seed(config.seed)
        np.random.seed(config.seed)
        self.device = self.ctx.device
        check_model_fits(schema, config.model, config.batch_size, self.device)
        self.model = build_model(schema, config.model).to(self.device)
        if config.loss == "sampled_softmax" and not isinstance(self.model, DSSM):
            raise ValueError("loss 'sampled_softmax' needs model 'dssm' (two towers); got "
                             f"model {config.model.name!r}")
        self.sparse_optimizer = SparseOptimizer(config.sparse_optimizer)
        self.store = store if store is not None else make_store(
            self.model.row_dim, self.sparse_optimizer, rank_store_config(config, self.ctx))
        self.dense_optimizer = dense_optimizer(self.model, config)
        # The one-process step's forward + loss (+ their backward): autocast, compile.
        self._bce = TaskLoss(self.model, schema.task_weights)
        self.dense_step = DenseStep(self.model, self._bce, self.device,
                                    compile=config.compile, autocast=config.autocast,
                                    batch_size=config.batch_size)
        # Hot rows kept on the device across passes (embedding/device.py), or None.
        self.device_cache = make_device_cache(config.device_budget, self.store, self.device)
        # The fused lookup's backward needs a graph input that requires grad.
        self._anchor = torch.zeros((), requires_grad=True, device=self.device)
        # Per slot, the per-use L2 on bucketed numeric rows (``slot_l2``), or None.
        self._bucket_l2 = self.sparse_optimizer.bucket_l2_slots(schema, self.device)
        mean = [f.pooling == "mean" for f in schema.sparse_fields]
        self.mean_fields = torch.tensor(mean, device=self.device) if any(mean) else None
        self.pass_id = 0
        # Every input file's row position after the last pass (checkpoint meta
        # ``inputs``: ``data.positions.Positions.to_dict``); None before any pass.
        self.inputs: dict | None = None
        # (pass, the store's admitted total when that pass began): ``begin_pass``
        self._admitted_before: tuple[int, int] | None = None
        self.history: list[dict] = []
        self.stop_reason: str | None = None  # why the last ``fit`` ended
        self.ddp: torch.nn.Module = self.model
        self.dense_comm: DenseComm | None = None
        if self.ctx.world > 1:
            ids = [self.device.index] if self.device.type == "cuda" else None
            self.ddp = DistributedDataParallel(self.model, device_ids=ids,
                                               gradient_as_bucket_view=True,
                                               **_NO_FORWARD_BUFFER_SYNC)
            self.dense_comm = DenseComm(self.ddp, self.dense_comm_config, self.ctx.world,
                                        self.dense_optimizer)

    @classmethod
    def from_checkpoint(cls, model_dir: str | Path, config: TrainConfig | None = None, *,
                        name: str | None = None, scratch_dir: str | Path | None = None,
                        ctx: DistContext | None = None,
                        dense_comm: DenseCommConfig | None = None,
                        prepare: Callable[[Trainer], None] | None = None) -> Trainer:
        """A trainer holding checkpoint ``name`` of ``model_dir``, else its newest good
        one (written by any number of ranks); collective, holding this rank's keys, when
        ``ctx`` is one of N. Without ``config`` (scoring a saved model) a tiered store
        lives in ``scratch_dir``, a folder private to this process (else a temp folder),
        never in the training run's live one. ``prepare`` sees the new trainer before its
        rows are loaded (a search gives it a view of a shared key index there)."""
        model_dir = Path(model_dir)
        schema, saved_config = read_model_meta(model_dir)
        if config is None:
            saved_config.store.disk_path = None if scratch_dir is None else str(scratch_dir)
        config = config or saved_config
        ctx = ctx or DistContext.single(resolve_device(config.device))
        ckpt = choose_checkpoint(model_dir, name, ctx)
        if dense_comm is None and ctx.world > 1 and "dense_comm" in ckpt.meta:
            dense_comm = DenseCommConfig(**ckpt.meta["dense_comm"])
        trainer = cls(schema, config, ctx=ctx, dense_comm=dense_comm)
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

    def begin_pass(self) -> None:
        """Count the next pass's new keys from now. The pass loop calls it for every
        trial before any trains the pass: trials sharing a key index are admitted keys
        by whichever pulls first, so a trial that counted from its own turn saw none."""
        self._admitted_before = (self.pass_id, self.store.stats().admitted)

    @property
    def rank(self) -> int:
        return self.ctx.rank

    @property
    def reads_ahead(self) -> bool:
        """Whether ``train_pass`` uses the next pass (``upcoming``): a store with a disk
        tier or a device row cache reads its rows while this pass trains. Otherwise the
        pass loop need not wait for the next pass to be read before training this one."""
        return self.store.prefetches or self.device_cache is not None

    # -- one step / one pass ------------------------------------------------------------
    def _train_loss(self, ws: WorkingSet, batch: Batch, keyed: Batch) -> torch.Tensor:
        """The batch's mean loss: pointwise BCE, or the two-tower sampled softmax.
        ``keyed``: the batch before remapping; items are told apart by their keys, since
        every key without a row shares the zero row's local id."""
        emb = slot_l2(ws.lookup(batch.sparse, self.mean_fields, self._anchor),
                      self._bucket_l2, 1.0 / max(len(batch), 1))
        if self.config.loss == "sampled_softmax":
            model = cast(DSSM, self.model)
            return model.sampled_softmax_loss(batch.dense, emb, batch.labels,
                                              model.item_ids(keyed.sparse).to(self.device))
        return self.dense_step(batch.dense, emb, batch.labels)

    def train_pass(self, p: Pass, progress: tqdm | None = None,
                   upcoming: Pass | None = None) -> PassResult:
        """Stage, train and write back pass ``p`` (planned ahead by ``plan``, e.g. in the
        read-ahead thread, so that the key work is off the critical path); returns its
        figures. Collective on N ranks.

        ``upcoming``: the next pass, whose rows a store with a disk tier (or a device row
        cache) reads in a thread while this pass trains.
        """
        self.model.train()
        t0 = time.perf_counter()
        if self._admitted_before is None or self._admitted_before[0] != self.pass_id:
            self.begin_pass()
        ws = stage_pass(self.ctx, self.store, p, self.pass_id, train=True,
                        cache=self.device_cache)
        keys_next = upcoming.staged_keys if upcoming is not None else None
        prefetcher = _start_prefetch(self.store, keys_next)
        if self.device_cache is not None and keys_next is not None:
            self.device_cache.read_ahead(self.store, keys_next, ws.keys, after=prefetcher)
        t1 = time.perf_counter()
        # The one place the world size shows: alone, a step's backward runs the sparse
        # optimizer on the pass's table in place (the fused lookup) over the batch's mean
        # loss; a rank's step exchanges rows and row gradients with their owners and
        # scales a summed loss so that DDP's average is the single-process gradient
        # (``train.loop``). The two steps share no work worth a common body, and a
        # branch per step would cost every step of the local fast path.
        sparse_bytes = dense_bytes = 0.0
        if isinstance(ws, ShardedWorkingSet):
            loss_sum, sparse_bytes, dense_bytes = self._train_rank_steps(ws, progress)
        else:
            loss_sum = self._train_steps(ws, p.batches, progress)
        t2 = time.perf_counter()
        wait_s, evicted = self._close_pass(ws, prefetcher)
        t3 = time.perf_counter()
        return self._pass_result((t0, t1, t2, t3), loss_sum, sum(len(b) for b in p.batches),
                                 ws.stats.unique_keys, ws.stats.admitted_keys, evicted,
                                 wait_s, sparse_bytes=sparse_bytes, dense_bytes=dense_bytes)

    def _train_steps(self, ws: WorkingSet, keyed: list[Batch],
                     progress: tqdm | None) -> float:
        """Train one process's pass, step by step; its loss summed over rows."""
        losses = []
        for step, (batch, raw) in enumerate(zip(ws.batches, keyed, strict=True)):
            ws.step = step
            loss = self._train_loss(ws, batch, raw)
            self.dense_optimizer.zero_grad(set_to_none=True)
            loss.backward()
            self.dense_optimizer.step()
            losses.append(loss.detach())
            if progress is not None:
                progress.update(len(batch))
        weights = torch.tensor([len(b) for b in ws.batches], dtype=torch.float32)
        return float((torch.stack(losses).cpu() * weights).sum()) if losses else 0.0

    def _pass_result(self, times: tuple[float, float, float, float], loss_sum: float,
                     rows: int, unique_keys: int, admitted_keys: int, evicted: int,
                     wait_s: float, sparse_bytes: float = 0.0,
                     dense_bytes: float = 0.0) -> PassResult:
        """One pass's figures, summed over ranks (free alone), and the next pass number.
        ``samples_per_s``: global rows over the ranks' mean pass time."""
        t0, t1, t2, t3 = times
        world = self.ctx.world
        assert self._admitted_before is not None  # set when the pass began
        new_keys = self.store.stats().admitted - self._admitted_before[1]
        totals = self.ctx.all_sum([loss_sum, rows, unique_keys, admitted_keys, evicted,
                                   len(self.store), sparse_bytes, dense_bytes, t3 - t0,
                                   new_keys])
        rows = int(totals[1])
        busy = totals[8] / world
        result = PassResult(
            pass_id=self.pass_id, rows=rows, train_loss=float(totals[0] / max(rows, 1)),
            staging_s=t1 - t0, train_s=t2 - t1, write_back_s=t3 - t2,
            samples_per_s=float(rows / busy) if busy > 0 else 0.0,
            unique_keys=int(totals[2]), admitted_keys=int(totals[3]),
            evicted_keys=int(totals[4]), store_keys=int(totals[5]), prefetch_wait_s=wait_s,
            world_size=world, sparse_bytes_per_step=float(totals[6] / world),
            dense_bytes_per_step=float(totals[7] / world), new_keys=int(totals[9]),
            rejected_keys=int(totals[2]) - int(totals[3]))
        self.pass_id += 1
        return result

    def _rank_step_loss(self, ws: ShardedWorkingSet, step: int,
                        batch: Batch) -> tuple[torch.Tensor, int]:
        """The local batch's summed loss and the global count it is a mean over: BCE
        over the step's rows, or the sampled softmax over its clicked rows (0 for a step
        without clicks: its loss is a zero that keeps the graph). A rank with
        no rows this step still runs the model (DDP all-reduces on every rank), on one
        zero sample weighted 0."""
        rows = max(int(ws.global_sizes[step]), 1)
        if len(batch) == 0:
            ws.fetch(step)  # collective: the owners serve whoever asked
            dense = torch.zeros(1, batch.dense.shape[1], device=self.device)
            emb = torch.zeros(1, batch.sparse.num_fields, self.model.row_dim,
                              device=self.device)
            if self.config.loss == "sampled_softmax":
                return self._rank_softmax(dense, emb, torch.zeros(1, dtype=torch.int64,
                                                                  device=self.device),
                                          torch.zeros(0, dtype=torch.int64,
                                                      device=self.device))
            with self.dense_step.autocast():
                logits = self.ddp(dense, emb).float()
            return F.binary_cross_entropy_with_logits(logits, torch.zeros_like(logits),
                                                      reduction="sum") * 0.0, rows
        # (the lookup's backward divides by the world size what the loss's scaling,
        # ``world / rows``, does not reach here)
        emb = slot_l2(ws.lookup(step, batch.sparse, self.mean_fields, self._anchor),
                      self._bucket_l2, self.ctx.world / rows)
        if self.config.loss == "sampled_softmax":
            ids = cast(DSSM, self.model).item_ids(ws.keyed_batches[step].sparse).to(
                self.device)
            pos = torch.nonzero(batch.labels > 0.5).squeeze(1)
            return self._rank_softmax(batch.dense, emb, ids, pos)
        with self.dense_step.autocast():  # the one-process step's precision
            logits = self.ddp(batch.dense, emb)
        return self._bce(logits.float(), batch.labels, reduction="sum"), rows

    def _rank_softmax(self, dense: torch.Tensor, emb: torch.Tensor, ids: torch.Tensor,
                      pos: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Collective: the sampled softmax of this rank's clicked rows ``pos`` against
        every rank's clicked items (``distributed.negatives``), summed, and the step's
        clicked rows over all ranks. The towers run on one row even when ``pos`` is
        empty, weighted 0, so every rank's graph has the same collectives and every
        parameter a gradient."""
        model = cast(DSSM, self.model)
        take = pos if len(pos) else torch.zeros(1, dtype=torch.int64, device=self.device)
        vectors = self.ddp(dense.index_select(0, take), emb.index_select(0, take),
                           towers=True)
        user, item = vectors.chunk(2, dim=1)
        unused = 0.0 * vectors.sum()
        user, item = user[:len(pos)], item[:len(pos)]
        items, all_ids, first = gather_positives(self.ctx, item, ids.index_select(0, pos))
        if len(all_ids) == 0:  # no clicks on any rank this step: no dense step either
            return unused + 0.0 * emb.sum(), 0
        return model.in_batch_softmax(user, items, all_ids, first) + unused, len(all_ids)

    def _train_rank_steps(self, ws: ShardedWorkingSet, progress: tqdm | None
                          ) -> tuple[float, float, float]:
        """Collective: train this rank's share of one pass, one local batch per global
        step; (its loss summed over rows, sparse and dense bytes sent per step)."""
        ctx = self.ctx
        assert self.dense_comm is not None
        loss_sum = torch.zeros((), dtype=torch.float64)
        bytes_before = self.dense_comm.meter.bytes
        for step, batch in enumerate(ws.batches):
            loss, count = self._rank_step_loss(ws, step, batch)
            global_rows = max(int(ws.global_sizes[step]), 1)
            self.dense_optimizer.zero_grad(set_to_none=True)
            (loss * (ctx.world / max(count, 1))).backward()  # starts the row exchange
            if count:  # as one process, whose dense weights get no gradient then
                self.dense_comm.step()
            ws.apply_gradients(step)
            self.dense_comm.count_step()
            # per row, as one process records a batch's mean loss times its rows
            loss_sum += loss.detach().to(torch.float64).cpu() * (global_rows / max(count, 1))
            if progress is not None:
                progress.update(global_rows)
        self._average_norm_statistics()
        steps = max(len(ws.batches), 1)
        return (float(loss_sum), (ws.stats.staging_bytes + ws.step_bytes) / steps,
                (self.dense_comm.meter.bytes - bytes_before) / steps)

    def _average_norm_statistics(self) -> None:
        """Collective: the batch-norm running statistics averaged over ranks at a pass
        end. Between steps each rank keeps its own (no broadcast in every forward);
        averaged, every rank scores with, and checkpoints hold, the same model."""
        stats = [t for m in self.model.modules() if isinstance(m, torch.nn.BatchNorm1d)
                 for t in (m.running_mean, m.running_var) if t is not None]
        if not stats:
            return
        flat = torch.cat([t.reshape(-1) for t in stats]).to(self.ctx.comm_device)
        dist.all_reduce(flat)
        flat /= self.ctx.world
        for t, part in zip(stats, flat.split([t.numel() for t in stats]), strict=True):
            t.copy_(part.view_as(t))

    def _close_pass(self, ws, prefetcher: _Prefetcher | None) -> tuple[float, int]:
        """Wait for the next pass's read-ahead (the store is the pass's own again before
        write-back), write the pass's rows back and apply eviction: (wait s, evicted)."""
        start = time.perf_counter()
        if prefetcher is not None:
            prefetcher.join()
        wait_s = time.perf_counter() - start
        ws.write_back(self.store)
        evicted = self.store.end_pass(self.pass_id)
        if self.device_cache is not None:
            self.device_cache.end_pass(self.store, evicted)
        return wait_s, evicted

    def sync_store(self) -> None:
        """Bring the store up to date with rows newer on the device (before anything
        reads the store as a whole: checkpoints, exports)."""
        if self.device_cache is not None:
            self.device_cache.sync(self.store)

    @torch.no_grad()
    def recalibrate(self, p: Pass) -> float | None:
        """Collective on N ranks: after a pass, shift the model's output bias
        (``logit_offset``) so that its mean prediction on the pass's rows (evenly spread
        steps, ``RECALIBRATE_ROWS`` at most) equals their click rate; returns the shift
        (None where nothing is shifted: ``--no-recalibrate``, the sampled softmax, a
        model without an output bias).

        Why: the keys present in every row (numeric buckets, small-vocabulary fields)
        each step along the batch's mean residual, so together they move the model's
        offset by many times one key's step, and a pass ends wherever the last batches
        left it (0.2-0.3 logit on synthetic data). Validation loss then swings from pass
        to pass and patience stops on the swing (docs/models.md). The fit uses training
        rows only; every rank solves the same gathered rows, so N ranks shift alike."""
        offset = self.model.logit_offset()
        if not self.config.recalibrate or offset is None \
                or self.config.loss != "bce":
            return None
        local = p.batches
        if not local:
            return None
        wanted = max(1, math.ceil(RECALIBRATE_ROWS / self.config.batch_size))
        steps = np.unique(np.linspace(0, len(local) - 1, min(len(local), wanted))
                          .round().astype(np.int64))
        chosen = [local[int(i)] for i in steps]
        probs = self.predict_batches(chosen)
        labels, probs = self._all_scores(_labels(chosen), probs)
        shift = offset_shift(labels, probs)
        offset.add_(shift)
        return shift

    @torch.no_grad()
    def predict_batches(self, batches: list[Batch]) -> np.ndarray:
        """Click probabilities for in-memory batches (global keys); the store is unchanged.
        Collective on N ranks: each passes its own batches (one per step, as in
        training), whose rows come from their owners."""
        if not batches and self.ctx.world == 1:  # ranks join the exchange even so
            return np.empty(0, np.float32)
        return self.predict_pass(self.plan(batches, counts=False))

    @torch.no_grad()
    def predict_pass(self, p: Pass) -> np.ndarray:
        """Click probabilities for this process's rows of pass ``p`` (collective on N
        ranks, where each step's rows come from their owners)."""
        self.model.eval()
        ws = stage_pass(self.ctx, self.store, p, self.pass_id, train=False,
                        cache=self.device_cache)
        out = []
        for step, batch in enumerate(ws.batches):
            table = ws.step_table(step)  # collective on N ranks, even for an empty batch
            if len(batch):
                emb = _pooled(table, batch.sparse, self.mean_fields)
                out.append(torch.sigmoid(self.model(batch.dense, emb)).cpu())
        return torch.cat(out).numpy() if out else np.empty(0, np.float32)

    def predict_stream(self, batches: Iterable[Batch]
                       ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """(probabilities, labels) chunk by chunk, one pass's worth of rows at a time. On
        N ranks, collective: the same batches on every rank, each rank scoring (and
        yielding) its round-robin share."""
        for p in iter_scoring_passes(self.ctx, batches, self.config.pass_rows):
            yield self.predict_pass(p), _labels(p.batches)

    def scoring_passes(self, paths: Sequence[str | Path], stats: ReadStats | None = None
                       ) -> list[Pass]:
        """A validation set, read and planned once to be scored after every pass
        (``evaluate_passes``). On N ranks (collective): this rank's share only, parsed by
        this rank alone (local batches, as training deals them), its key requests
        exchanged with the owners; ``stats`` gets every rank's counts."""
        cfg = self.config
        ctx = self.ctx
        if ctx.world == 1:
            return list(iter_scoring_passes(ctx, iter_file_batches(
                paths, self.schema, cfg.batch_size, on_bad_row=cfg.on_bad_row,
                stats=stats), cfg.pass_rows))
        return [self.plan(group, counts=False)
                for group in iter_rank_passes(paths, self.schema, cfg.batch_size,
                                              cfg.pass_rows, ctx.rank, ctx.world,
                                              on_bad_row=cfg.on_bad_row, stats=stats,
                                              ctx=ctx)]

    def evaluate(self, batches: Iterable[Batch]) -> dict[str, float]:
        """AUC, logloss, rows and scoring samples/s (reading included) over ``batches``."""
        start = time.perf_counter()
        return self._metrics(self.predict_stream(batches), start)

    def evaluate_passes(self, passes: Iterable[Pass]) -> dict[str, float]:
        """``evaluate`` over passes planned once (``scoring_passes``), e.g. a validation
        set scored after every pass or by every trial of a search."""
        start = time.perf_counter()
        return self._metrics(((self.predict_pass(p), _labels(p.batches)) for p in passes),
                             start)

    def _metrics(self, scored: Iterator[tuple[np.ndarray, np.ndarray]],
                 start: float) -> dict[str, float]:
        probs, labels = [], []
        for p, y in scored:
            probs.append(p)
            labels.append(y)
        seconds = time.perf_counter() - start
        all_labels, all_probs = self._all_scores(
            np.concatenate(labels) if labels else np.empty(0, np.float32),
            np.concatenate(probs) if probs else np.empty(0, np.float32))
        if not len(all_labels):
            raise ValueError("no rows to evaluate")
        check_model_scores(all_probs, f"pass {self.pass_id} model")  # same on every rank
        metrics = self.score_metrics(all_labels, all_probs)
        metrics["rows"] = int(len(all_labels))
        metrics["samples_per_s"] = metrics["rows"] / seconds if seconds > 0 else 0.0
        return metrics

    def score_metrics(self, labels: np.ndarray, probs: np.ndarray) -> dict[str, float]:
        """AUC, logloss, click rate and mean prediction; with several labels, each task's
        (``auc_<task>`` ...) against its training target, and their ``label_weights``
        mean as ``auc`` and ``logloss``."""
        if labels.ndim == 1:
            return evaluate_scores(labels, probs)
        targets = self.model.task_targets(torch.from_numpy(labels)).numpy()
        return evaluate_tasks(targets, probs, self.schema.task_names,
                              self.schema.task_weights)

    def _all_scores(self, labels: np.ndarray,
                    probs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The (labels, probabilities) metrics are computed over: every rank's, so that
        ``evaluate`` gives the same metrics on every rank."""
        if self.ctx.world == 1:
            return labels, probs
        parts = self.ctx.all_gather_object((labels, probs))
        return (np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]))

    # -- whole runs ---------------------------------------------------------------------
    def iter_passes(self, train_paths: Inputs, stats: ReadStats | None = None,
                    first: int = 0, skip: int = 0, positions: Positions | None = None,
                    per_file: bool = False) -> Iterator[tuple[Pass | None, PassInput] | Idle]:
        """The passes ``fit`` trains, numbered from ``first``, planned in the read-ahead
        thread, each with what it consumed (``PassInput``), from each file's row in
        ``positions`` on (a resumed run); passes below ``skip`` (resuming a checkpoint
        that has no positions) are not planned. On N ranks: this rank's share of every
        pass, its requests exchanged with the owners (``plan``). ``per_file``: a pass
        also ends at each file's end; IDLE markers in ``train_paths`` pass through."""
        cfg = self.config
        positions = positions if positions is not None else Positions()
        if self.ctx.world > 1:
            passes = iter_rank_pass_inputs(
                train_paths, self.schema, cfg.batch_size, cfg.pass_rows, self.ctx.rank,
                self.ctx.world, positions, per_file=per_file, on_bad_row=cfg.on_bad_row,
                stats=stats, ctx=self.ctx)
        else:
            passes = iter_input_passes(train_paths, self.schema, cfg.batch_size,
                                       cfg.pass_rows, positions, per_file=per_file,
                                       on_bad_row=cfg.on_bad_row, stats=stats)
        if cfg.shuffle:
            passes = shuffled_steps(passes, cfg.seed)
        return _plans(passes, first, skip, lambda group: self.plan(group, ahead=True))

    def plan(self, batches: list[Batch], *, counts: bool = True, ahead: bool = False) -> Pass:
        """This process's ``batches`` as a ``Pass`` (``counts``: for training). On N ranks,
        collective: its requests are exchanged with the owners, in the planning group
        when ``ahead`` (call that from one thread only, the read-ahead one, in pass order
        on every rank), else in the row exchange group."""
        group = self.ctx.plan_group if ahead else None
        return plan_for(self.ctx, batches, counts=counts, group=group)

    def fit(self, train_paths: Inputs,
            valid_batches: Sequence[Pass] | None = None,
            *, progress: bool = True, stats=None, on_pass_end=None,
            skip_passes: int = 0, selection: SelectionTracker | None = None,
            stream: StreamOptions | None = None) -> list[dict]:
        """Train up to ``config.epochs`` epochs over ``train_paths`` pass by pass; after
        each pass, score ``valid_batches`` (if any) and append a history record. With a
        ``selection`` tracker, records say which pass was ``best`` and training stops when
        its patience runs out; ``stop_reason`` says why training ended.

        A resumed trainer reads on from each file's row position its checkpoint recorded
        (``inputs``); ``skip_passes`` (passes already trained) is for checkpoints without
        positions: those passes are read, not trained. ``stream``: reading a stream of
        files (``train --follow``). This is the K = 1 case of ``train.loop.run_passes``.
        """
        run = TrialRun(self, selection, on_pass_end)
        run_passes([run], train_paths, valid_batches,
                   progress=progress and self.ctx.is_main, stats=stats,
                   skip_passes=skip_passes, stream=stream)
        self.stop_reason = run.stop_reason
        return self.history


def _labels(batches: list[Batch]) -> np.ndarray:
    return (torch.cat([b.labels for b in batches]).numpy() if batches
            else np.empty(0, np.float32))


def _plans(passes: Iterator[tuple[list[Batch], PassInput] | Idle], first: int, skip: int,
           plan: Callable[[list[Batch]], Pass]
           ) -> Iterator[tuple[Pass | None, PassInput] | Idle]:
    """Plan each pass numbered ``first``, ``first + 1``, ... (IDLE markers are not
    passes); passes below ``skip`` (already trained, when resuming) are read, not
    planned (None)."""
    number = first
    for item in passes:
        if isinstance(item, Idle):
            yield item
            continue
        group, info = item
        yield (plan(group) if number >= skip else None), info
        number += 1


def make_store(row_dim: int, optimizer: SparseOptimizer,
               config: TrainConfig) -> EmbeddingStore:
    """The tiered store when a memory budget or a disk path is configured, else all in RAM."""
    if config.store.tiered:
        return TieredStore(row_dim, optimizer, config.store, seed=config.seed)
    return MemoryStore(row_dim, optimizer, config.store, seed=config.seed)


def rank_store_config(config: TrainConfig, ctx: DistContext) -> TrainConfig:
    """On N ranks, each rank's tiered store gets its own disk folder under the store's,
    and its share of a capacity target (the shard hash deals keys out evenly)."""
    if ctx.world == 1:
        return config
    store = config.store
    if store.disk_path:
        store = replace(store, disk_path=str(Path(store.disk_path) / f"rank-{ctx.rank:05d}"))
    if store.max_keys is not None:
        store = replace(store, max_keys=max(1, store.max_keys // ctx.world))
    if store.max_store_bytes is not None:
        store = replace(store, max_store_bytes=max(
            1, parse_bytes(store.max_store_bytes) // ctx.world))
    return config if store is config.store else replace(config, store=store)


class _Prefetcher(threading.Thread):
    """Reads the next pass's rows from the disk tier; errors re-raised on join."""

    def __init__(self, store: EmbeddingStore, keys: np.ndarray) -> None:
        super().__init__(name="terarec-store-prefetch", daemon=True)
        self.store, self.keys = store, keys
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.store.prefetch(self.keys)
        except BaseException as exc:  # handed to the trainer thread
            self.error = exc

    def join(self, timeout: float | None = None) -> None:
        super().join(timeout)
        if self.error is not None:
            raise self.error


def _start_prefetch(store: EmbeddingStore, keys: np.ndarray | None) -> _Prefetcher | None:
    """Start reading the rows of ``keys`` (the next pass's) into RAM, where the store has
    a disk tier to read them from."""
    if keys is None or not len(keys) or not store.prefetches:
        return None
    thread = _Prefetcher(store, keys)
    thread.start()
    return thread
