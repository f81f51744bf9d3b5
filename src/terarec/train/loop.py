"""The pass loop, for one model or K trained side by side on the same passes.

::

    for each epoch, for each pass (read, parsed, hashed and planned ONCE, read ahead):
        for each live trial:                     its own store, rows, optimizer state,
            trainer.train_pass(plan)             dense network and RNG stream
            trainer.recalibrate(plan)            its output bias fitted to the pass's rows
            evaluate on the validation set       (shared batches), selection tracker
            on_pass_end(trainer, record)         checkpoint, BEST, export deltas
        on_boundary(live trials)                 a search reports to optuna and prunes

``Trainer.fit`` is this loop with K = 1; ``terarec search`` (``train.search``) runs it
with K trials. What the trials share is everything up to the ``Pass``: reading,
parsing, hashing, cutting into batches and passes, the unique keys of the pass, each
occurrence's position among them and per-key shows/clicks. A trial whose batch size
differs from the first trial's gets the pass re-batched and re-planned (once per distinct
batch size and pass). A search's trials also share one key index (``embedding.shared``):
each trial's store is a view holding only its own rows and optimizer state.

Each trial's torch RNG state (CPU, and CUDA on a GPU) is swapped in around its passes,
so a trial draws exactly the random numbers (dropout, ...) it would draw trained alone:
K trials with the seeds of K separate runs end with the same weights.
"""

from __future__ import annotations

import logging
import math
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from tqdm.auto import tqdm

from terarec.data.positions import Idle, PassInput, Positions
from terarec.distributed.context import DistContext
from terarec.distributed.sharding import redeal
from terarec.finite import NonFiniteError
from terarec.train.passes import Inputs, Pass, in_file_order, plan_for, prefetch, shuffled
from terarec.train.progressive import ProgressiveScorer
from terarec.train.selection import (
    STOP_DIVERGED,
    STOP_END_OF_DATA,
    STOP_EPOCHS,
    STOP_PATIENCE,
    SelectionTracker,
)
from terarec.types import Batch

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from terarec.train.trainer import Trainer


@dataclass(frozen=True)
class RngState:
    """The torch random streams a trial draws from: the CPU generator, and on a GPU that
    device's CUDA generator too (dropout there draws from it), so a trial swapped in and
    out of the pass loop draws what it would alone on either device."""

    cpu: torch.Tensor
    cuda: torch.Tensor | None = None

    @classmethod
    def capture(cls, device: torch.device) -> RngState:
        cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
        return cls(torch.get_rng_state(), cuda)

    def restore(self, device: torch.device) -> None:
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state(self.cuda, device)


@dataclass
class TrialRun:
    """One model in the pass loop: its trainer, its selection and its pass-end hook.

    Create it right after its trainer, so ``rng`` is the trainer's own random stream.
    ``stop_reason`` is None while it trains (see ``train.selection`` for the reasons).
    """

    trainer: Trainer
    selection: SelectionTracker | None = None
    on_pass_end: Callable[[Trainer, dict], None] | None = None
    stop_reason: str | None = None
    rng: RngState | None = None  # the trainer's streams when None: taken now
    steps: int = 0  # optimizer steps so far
    # A search trial whose loss or validation scores go non-finite stops (``diverged``)
    # and the others train on; a single run raises instead.
    stop_on_divergence: bool = False
    scorer: ProgressiveScorer = field(default_factory=ProgressiveScorer)

    def __post_init__(self) -> None:
        if self.rng is None:
            self.rng = RngState.capture(self.trainer.device)
        if self.trainer.history:
            self.steps = int(self.trainer.history[-1].get("steps", 0))
        if self.selection is not None and self.selection.exhausted:
            # Resumed after its stopping evaluation was committed (killed before the
            # run finished): training on would give another model than the run's.
            self.stop(STOP_PATIENCE)

    @property
    def live(self) -> bool:
        return self.stop_reason is None

    def stop(self, reason: str) -> None:
        if self.stop_reason is None:
            self.stop_reason = reason


def rebatch(batches: Sequence[Batch], batch_size: int) -> list[Batch]:
    """The same rows, in the same order, cut into batches of ``batch_size``."""
    whole = Batch.concat(list(batches))
    return [whole.slice(i, min(i + batch_size, len(whole)))
            for i in range(0, len(whole), batch_size)]


class _PlanCache:
    """One pass's plan per batch size: the reader's plan, re-batched and re-planned for
    other batch sizes (once each). On N ranks the reader's share of the pass is dealt
    again (``redeal``, collective: every rank's trials ask in the same order) and each
    rank's working set plans it. With ``--shuffle`` (``seed`` not None) the pass is put
    back in file order before it is re-cut, and the new batches are shuffled as a run
    with that batch size shuffles them, so a trial still trains what its run would."""

    def __init__(self, plan: Pass, batch_size: int, ctx: DistContext, info: PassInput,
                 seed: int | None = None) -> None:
        self.plan, self.batch_size, self.ctx = plan, batch_size, ctx
        self.info, self.seed = info, seed
        self._by_size: dict[int, Pass] = {}

    def for_batch_size(self, batch_size: int) -> Pass:
        if batch_size == self.batch_size:
            return self.plan
        if batch_size not in self._by_size:
            batches = self.plan.batches
            if self.seed is not None:
                batches = in_file_order(batches, self.seed, self.info)
            if self.ctx.world > 1:  # the whole pass, cut anew and dealt again (collective)
                cut = redeal(self.ctx, batches, batch_size)
            else:
                cut = rebatch(batches, batch_size)
            if self.seed is not None:
                cut = shuffled(cut, self.seed, self.info)
            self._by_size[batch_size] = plan_for(self.ctx, cut)
        return self._by_size[batch_size]


@dataclass
class StreamOptions:
    """How the pass loop reads a stream of files (``train --follow``) rather than a fixed
    list: passes end at file ends, each pass is scored before it is trained
    (progressive validation), the next pass is not waited for, and the loop calls
    ``on_idle`` while no new file has landed and stops once ``should_stop`` says so
    (both called on every rank at the same points: they may be collective)."""

    per_file: bool = False
    progressive: bool = False
    lookahead: bool = True
    on_idle: Callable[[list[TrialRun]], None] | None = None
    should_stop: Callable[[], bool] | None = None


def with_next(items: Iterator) -> Iterator[tuple]:
    """Each pass with the one after it (None for the last): the read-ahead pass is what
    the store prefetches while the current one trains."""
    current = next(items, None)
    while current is not None:
        following = next(items, None)
        yield current, following
        current = following


def run_passes(runs: Sequence[TrialRun], train_paths: Inputs,
               valid_batches: Sequence[Pass] | None = None,
               *,
               progress: bool = True,
               stats=None, skip_passes: int = 0,
               on_boundary: Callable[[list[TrialRun]], None] | None = None,
               stream: StreamOptions | None = None) -> None:
    """Train every run pass by pass until each has stopped (patience, its epochs, a
    pruning ``on_boundary``). The first run's trainer reads the data (its batch size and
    pass size cut the stream) from the input positions its checkpoint recorded
    (``trainer.inputs``); with none, ``skip_passes`` passes are read, not trained (a
    checkpoint from before positions were recorded)."""
    if not runs:
        raise ValueError("run_passes needs at least one trial")
    reader = runs[0].trainer
    stream = stream or StreamOptions()
    start = Positions.from_dict(reader.inputs) if reader.inputs else None
    skip = 0 if start is not None else skip_passes
    epochs = max(r.trainer.config.epochs for r in runs)
    # A pass waits for the next one to be read only where its training uses it.
    lookahead = stream.lookahead and any(r.trainer.reads_ahead for r in runs)
    # Made once the first pass has been read: a file that fails its header check (read
    # in the loop when resuming) must not leave an empty bar printed above the error.
    bar: tqdm | None = None
    seen = 0
    try:
        first_epoch = start.epoch if start is not None else 0
        for epoch in range(first_epoch, epochs):
            for run in runs:
                if run.live and epoch >= run.trainer.config.epochs:
                    run.stop(STOP_EPOCHS if run.selection is not None else STOP_END_OF_DATA)
            if not any(r.live for r in runs):
                break
            positions = start if start is not None and start.epoch == epoch \
                else Positions(epoch=epoch)
            # Bad rows are counted (and reported) once, in this run's first epoch's read.
            passes = prefetch(reader.iter_passes(
                train_paths, stats if epoch == first_epoch else None, seen, skip, positions,
                per_file=stream.per_file))
            pairs = with_next(passes) if lookahead else ((p, None) for p in passes)
            for item, upcoming in pairs:
                if isinstance(item, Idle):
                    if item.positions is not None:  # files of no rows, trained as such
                        for run in runs:
                            run.trainer.inputs = item.positions.to_dict()
                    if stream.on_idle is not None:
                        stream.on_idle([r for r in runs if r.live])
                    if stream.should_stop is not None and stream.should_stop():
                        break
                    continue
                plan, info = item
                seen += 1
                if seen <= skip:
                    continue
                assert plan is not None  # planned from ``skip`` on
                if bar is None:
                    # a bar only on a terminal: in a log file it was one 30 kB line
                    bar = tqdm(unit=" rows", unit_scale=True,
                               disable=not progress or not sys.stderr.isatty(),
                               dynamic_ncols=True,
                               desc="train" if len(runs) == 1 else f"train x{len(runs)}")
                plans = _PlanCache(plan, reader.config.batch_size, reader.ctx, info,
                                   reader.config.seed if reader.config.shuffle else None)
                live = [r for r in runs if r.live]
                ahead = upcoming[0] if isinstance(upcoming, tuple) else None
                for run in live:  # before the first pulls the keys they may share
                    run.trainer.begin_pass()
                for run in live:
                    _train_one(run, plans, ahead, valid_batches, epoch, bar, info,
                               stream.progressive)
                if on_boundary is not None:
                    on_boundary(live)
                if not any(r.live for r in runs):
                    break
                if stream.should_stop is not None and stream.should_stop():
                    break
            else:
                continue
            break  # stopped inside the epoch
    finally:
        if bar is not None:
            bar.close()
    for run in runs:
        run.stop(STOP_EPOCHS if run.selection is not None else STOP_END_OF_DATA)


def _train_one(run: TrialRun, plans: _PlanCache, upcoming,
               valid: Sequence[Pass] | None,
               epoch: int, bar: tqdm, info: PassInput, progressive: bool = False) -> None:
    """One pass of one trial: score it first (``progressive``), train (in its own RNG
    stream), evaluate, select, hook."""
    trainer = run.trainer
    plan = plans.for_batch_size(trainer.config.batch_size)
    scored = run.scorer.score(trainer, plan, info) if progressive else {}
    assert run.rng is not None  # set in __post_init__
    run.rng.restore(trainer.device)
    result = trainer.train_pass(plan, bar, upcoming)
    shift = trainer.recalibrate(plan)
    run.rng = RngState.capture(trainer.device)
    run.steps += plan.steps
    trainer.inputs = info.positions.to_dict()
    record = {"epoch": epoch, "steps": run.steps, **result.as_dict(),
              "files": [Path(f).name for f in info.files], **scored}
    if shift is not None:
        record["offset_shift"] = shift
    if valid:
        start = time.perf_counter()
        try:
            metrics = trainer.evaluate_passes(valid)
        except NonFiniteError:  # its scores are not finite (the same on every rank)
            if not run.stop_on_divergence:
                raise
            metrics = {"auc": math.nan, "logloss": math.nan}
        record.update(valid_auc=metrics["auc"], valid_logloss=metrics["logloss"],
                      eval_s=time.perf_counter() - start)
        record.update({f"valid_{k}": v for k, v in metrics.items()  # several labels
                       if k.startswith(("auc_", "logloss_"))})
    if run.selection is not None and run.selection.observe(record).stop:
        run.stop(STOP_PATIENCE)
    if run.stop_on_divergence and diverged(record):
        run.stop(STOP_DIVERGED)
    trainer.history.append(record)
    shown = {"loss": f"{result.train_loss:.4f}"}
    if "valid_auc" in record:  # a run without --valid (a refit) has no AUC to show
        shown["auc"] = f"{record['valid_auc']:.4f}"
    bar.set_postfix(shown)
    if bar.disable and trainer.ctx.is_main:  # no bar: one line per pass for the log
        log.info("pass %d (epoch %d, %s): %d rows, loss %s%s", trainer.pass_id, epoch + 1,
                 ", ".join(record["files"]) or "stream", result.rows, shown["loss"],
                 f", valid auc {shown['auc']}" if "auc" in shown else "")
    if run.on_pass_end is not None:
        run.on_pass_end(trainer, record)


def diverged(record: dict) -> bool:
    """A pass whose training loss or validation loss is not finite: every later weight
    is poisoned (the same verdict on every rank: their figures are gathered)."""
    return not all(math.isfinite(record.get(k, 0.0)) for k in ("train_loss", "valid_logloss"))
