"""One ``terarec train`` run, in one process or as one of N torchrun ranks.

The topology (``DistContext``) is the only difference between the two: alone, every
collective below is free; on N ranks every rank runs this same function, reads its
share of each pass, owns one shard of the store, commits its shard of every checkpoint
with the others (``save_checkpoint``), and only rank 0 writes metrics. A worker group
restarted by torchrun (``--max-restarts``) resumes from the last committed pass on its
own.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from terarec.config import TrainConfig, parse_bytes
from terarec.data.readers import ReadStats
from terarec.distributed.context import DistContext, restart_count
from terarec.distributed.dense_comm import DenseCommConfig
from terarec.export.writer import IncrementalExporter
from terarec.finite import check_finite_loss
from terarec.io import atomic_write_text
from terarec.train.checkpoint import (
    best_checkpoint,
    clear_best,
    list_checkpoints,
    mark_best,
    restore_trainer,
    save_checkpoint,
)
from terarec.train.passes import iter_file_batches
from terarec.train.selection import SelectionTracker
from terarec.train.trainer import Trainer
from terarec.types import FeatureSchema


@dataclass
class TrainRun:
    """What to train on and where the model directory is."""

    train: list[Path]
    out: Path
    valid: list[Path] = field(default_factory=list)
    resume: bool = False
    checkpoint_every: int = 1  # commit a checkpoint every N passes
    progress: bool = True


def train_model(run: TrainRun, config: TrainConfig, schema: Callable[[], FeatureSchema],
                ctx: DistContext, *, dense_comm: DenseCommConfig | None = None,
                exporter: Callable[[Trainer], IncrementalExporter | None] | None = None,
                on_commit: Callable[[Trainer], None] | None = None,
                selection: SelectionTracker | None = None) -> tuple[dict, ReadStats]:
    """Train (or resume) ``run`` and write the model directory; returns (metrics, read
    statistics), the same on every rank. ``schema`` is asked for only when starting
    afresh; ``exporter`` makes the run's version writer; ``on_commit`` is called on every
    rank after each committed checkpoint; ``selection`` marks the best pass (``BEST``,
    which is what metrics score) and stops training when its patience runs out."""
    if config.store.memory_budget is not None:
        parse_bytes(config.store.memory_budget)  # a bad size fails here, not mid-run
        if config.store.disk_path is None:
            config.store.disk_path = str(run.out / "store")
    # No try/finally around the run: a rank that fails must exit rather than wait in a
    # collective for peers; torchrun then stops them.
    resume = run.resume or restart_count() > 0
    if resume and list_checkpoints(run.out):
        trainer = restore_trainer(run.out, config, ctx=ctx, dense_comm=dense_comm)
        if ctx.is_main:
            where = f"rank 0/{ctx.world}: " if ctx.world > 1 else ""
            print(f"{where}resuming {run.out} after pass {trainer.pass_id}")
        if selection is not None:  # continue with the best value and patience it had
            selection = SelectionTracker.from_history(trainer.history, selection.select_by,
                                                      selection.patience)
    else:
        earlier = list_checkpoints(run.out)
        if earlier:  # a fresh run's pass-000001 would be pruned below their numbers
            raise ValueError(f"{run.out} holds checkpoints of an earlier run (newest "
                             f"{earlier[0].name}): pass --resume to continue it, or "
                             "choose another --out")
        if ctx.is_main:
            clear_best(run.out)
        trainer = Trainer(schema(), config, ctx=ctx, dense_comm=dense_comm)
    stats, valid_stats = ReadStats(), ReadStats()
    valid = list(iter_file_batches(run.valid, trainer.schema, config.batch_size,
                                   on_bad_row=config.on_bad_row, stats=valid_stats))
    if run.valid and not valid:
        raise ValueError(_no_rows("validation", run.valid, valid_stats))
    versions = exporter(trainer) if exporter is not None else None
    every = max(1, run.checkpoint_every)

    def commit(t: Trainer) -> None:
        save_checkpoint(run.out, t)
        if on_commit is not None:
            on_commit(t)

    def on_pass_end(t: Trainer, record: dict) -> None:
        check_finite_loss(record["train_loss"], f"pass {t.pass_id}")  # the same on every rank
        # Every rank holds the same (gathered) metrics, so all take this branch together.
        if t.pass_id % every == 0 or record.get("best"):
            commit(t)
            if record.get("best") and ctx.is_main:
                mark_best(run.out, f"pass-{t.pass_id:06d}")
        if versions is not None:
            versions.on_pass_end(t, record)

    start = time.perf_counter()
    history = trainer.fit(run.train, valid, progress=run.progress, stats=stats,
                          on_pass_end=on_pass_end, skip_passes=trainer.pass_id,
                          selection=selection)
    seconds = time.perf_counter() - start
    if trainer.pass_id == 0:  # nothing trained: no checkpoint of an untrained model
        raise ValueError(_no_rows("training", run.train, stats))
    stats.skipped += valid_stats.skipped  # the run's count: training and validation rows
    stats.examples = (valid_stats.examples + stats.examples)[:stats.max_examples]
    if not history or trainer.pass_id % every:
        commit(trainer)
    if versions is not None:
        versions.finish(trainer)
    latest = f"pass-{trainer.pass_id:06d}"
    evaluated = ctx.broadcast_object(best_checkpoint(run.out) or latest)
    # The best pass is scored from its checkpoint, in a store of its own (a tiered one in
    # a scratch folder: the live store's folder stays the training run's).
    scorer = trainer if evaluated == latest or not valid else restore_trainer(
        run.out, name=evaluated, ctx=ctx, dense_comm=dense_comm)
    metrics = _run_metrics(scorer, trainer, valid, run, history, seconds, stats)
    metrics.update(checkpoint=evaluated, stop_reason=trainer.stop_reason)
    if selection is not None:
        metrics.update(selection.summary())
    if ctx.is_main:
        atomic_write_text(run.out / "metrics.json", json.dumps(metrics, indent=2))
        records = [*trainer.history[:-1], {**trainer.history[-1],
                                           "stop_reason": trainer.stop_reason}] \
            if trainer.history else []
        atomic_write_text(run.out / "history.json", json.dumps(records, indent=2))
    return metrics, stats


def _no_rows(what: str, paths: list[Path], stats: ReadStats) -> str:
    files = ", ".join(str(p) for p in paths)
    if stats.skipped:
        return (f"no {what} rows in {files}: all {stats.skipped} rows read were bad and "
                f"skipped (--on-bad-row skip); first: {stats.examples[0]}")
    return f"no {what} rows in {files}: the files hold no data rows"


def _run_metrics(scorer: Trainer, trainer: Trainer, valid: list, run: TrainRun,
                 history: list[dict], seconds: float, stats: ReadStats) -> dict:
    """Scores on the validation rows (the training rows without them) and the run's
    figures (``scorer``: the trainer or the best pass restored). ``samples_per_s``: rows
    trained over the passes' time (each pass's own
    figure already takes the ranks' mean), reading and scoring not included."""
    config = trainer.config
    source = valid or iter_file_batches(run.train, trainer.schema, config.batch_size,
                                        on_bad_row=config.on_bad_row)
    metrics: dict[str, Any] = dict(scorer.evaluate(source))
    metrics["evaluated_on"] = "valid" if valid else "train"
    metrics.pop("samples_per_s")  # scoring throughput; training throughput below
    rows = sum(h["rows"] for h in history)
    busy = sum(h["rows"] / h["samples_per_s"] for h in history if h["samples_per_s"])
    steps = [h for h in history if h.get("dense_bytes_per_step") is not None]
    ctx = trainer.ctx
    st = trainer.store.stats()
    keys, value_bytes, pruned = (int(x) for x in ctx.all_sum(
        [st.keys, trainer.store.value_bytes, st.pruned]))
    metrics.update(
        eval_rows=metrics.pop("rows"), rows=rows, passes=trainer.pass_id,
        samples_per_s=rows / busy if busy else 0.0, wall_seconds=seconds,
        skipped_rows=stats.skipped, store_keys=keys, model=config.model.name,
        store_value_bytes=value_bytes, store_bytes_per_key=value_bytes / max(keys, 1),
        store_precision=config.store.precision, pruned_keys=pruned,
        world_size=ctx.world, dense_comm=trainer.dense_comm_config.mode,
        dense_bytes_per_step=(sum(h["dense_bytes_per_step"] for h in steps) / len(steps)
                              if steps else 0.0),
        sparse_bytes_per_step=(sum(h["sparse_bytes_per_step"] for h in steps) / len(steps)
                               if steps else 0.0))
    return metrics
