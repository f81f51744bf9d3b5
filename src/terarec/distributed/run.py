"""``terarec train`` under torchrun: the same command, one process per rank.

``cli/train.py`` hands over here when torchrun's variables are set. Differences from the
single-process run: every rank reads its share, checkpoints are committed by all ranks
together, only rank 0 writes metrics and prints, and a worker group restarted by
torchrun (``--max-restarts``) resumes from the last committed pass on its own.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

from terarec.cli.common import (
    config_from_args,
    report_skipped,
    selection_from_args,
    train_schema_from_args,
)
from terarec.data.readers import ReadStats
from terarec.distributed.checkpoint import restore_sharded_trainer, save_sharded_checkpoint
from terarec.distributed.context import init_distributed, restart_count
from terarec.distributed.dense_comm import DENSE_COMMS, DenseCommConfig
from terarec.distributed.trainer import ShardedTrainer
from terarec.io import atomic_write_text
from terarec.train.checkpoint import best_checkpoint, clear_best, list_checkpoints, mark_best
from terarec.train.passes import iter_file_batches
from terarec.train.selection import SelectionTracker


def add_distributed_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("distributed (under torchrun)")
    g.add_argument("--dense-comm", choices=DENSE_COMMS, default="none",
                   help="dense gradient exchange: none (all-reduce), fp16, or dgc "
                        "(Deep Gradient Compression)")
    g.add_argument("--dgc-ratio", type=float, default=0.001,
                   help="DGC: share of gradient entries sent per step (default 0.001)")
    g.add_argument("--dgc-momentum", type=float, default=0.5,
                   help="DGC: momentum of the local momentum correction (default 0.5: "
                        "the dense optimizer adds its own)")
    g.add_argument("--dgc-warmup-steps", type=int, default=100,
                   help="DGC: steps over which sparsity rises from 75%% to its target")


def _reject_single_process_args(args: argparse.Namespace) -> None:
    """Options of the single-process run that the ranks do not implement yet."""
    for flag, value in (("--features", getattr(args, "features", None)),
                        ("--export-to", getattr(args, "export_to", None))):
        if value:
            raise ValueError(f"{flag} is not available under torchrun yet: train, then run "
                             "the single-process command on the model directory")


def reject_distributed_args(args: argparse.Namespace) -> None:
    """A single process has no dense gradients to exchange: say so instead of ignoring."""
    if args.dense_comm != "none":
        raise ValueError(f"--dense-comm {args.dense_comm} needs several ranks: launch with "
                         "torchrun --nproc_per_node N -m terarec train ...")


def dense_comm_from_args(args: argparse.Namespace) -> DenseCommConfig:
    return DenseCommConfig(mode=args.dense_comm, dgc_ratio=args.dgc_ratio,
                           dgc_momentum=args.dgc_momentum,
                           dgc_warmup_steps=args.dgc_warmup_steps)


def train_main(args: argparse.Namespace,
               on_commit: Callable[[ShardedTrainer], None] | None = None) -> int:
    """Run ``terarec train`` as one rank. ``on_commit`` is called on every rank after
    each committed checkpoint."""
    _reject_single_process_args(args)
    config = config_from_args(args)
    if config.sparse_optimizer.embedding_l2:  # the sharded lookup has no batch size to scale by
        raise ValueError("--embedding-l2 is not supported under torchrun yet; use "
                         "--sparse-weight-decay")
    comm = dense_comm_from_args(args)
    ctx = init_distributed(config.device)
    # No try/finally around the run: a rank that fails must exit rather than wait in
    # destroy_process_group for peers stuck in a collective; torchrun then stops them.
    selection = selection_from_args(args, config)
    resume = args.resume or restart_count() > 0
    if resume and list_checkpoints(args.out):
        trainer = restore_sharded_trainer(args.out, ctx, config, comm)
        if ctx.is_main:
            print(f"rank 0/{ctx.world}: resuming {args.out} after pass {trainer.pass_id}")
        if selection is not None:
            selection = SelectionTracker.from_history(trainer.history, args.select_by,
                                                      args.patience)
    else:
        if ctx.is_main:
            clear_best(args.out)
        trainer = ShardedTrainer(train_schema_from_args(args), config, ctx, comm)
    schema = trainer.schema
    stats = ReadStats()
    valid = list(iter_file_batches(args.valid, schema, config.batch_size,
                                   on_bad_row=config.on_bad_row, stats=stats))

    def commit(t: ShardedTrainer) -> None:
        save_sharded_checkpoint(args.out, t)
        if on_commit is not None:
            on_commit(t)

    def on_pass_end(t: ShardedTrainer, record: dict) -> None:
        # Every rank holds the same (gathered) metrics, so all take this branch together.
        if t.pass_id % max(1, args.checkpoint_every) == 0 or record.get("best"):
            commit(t)
            if record.get("best") and ctx.is_main:
                mark_best(args.out, f"pass-{t.pass_id:06d}")

    start = time.perf_counter()
    history = trainer.fit(args.train, valid, progress=not args.no_progress, stats=stats,
                          on_pass_end=on_pass_end, skip_passes=trainer.pass_id,
                          selection=selection)
    seconds = time.perf_counter() - start
    if not history or trainer.pass_id % max(1, args.checkpoint_every):
        commit(trainer)
    latest = f"pass-{trainer.pass_id:06d}"
    evaluated = ctx.broadcast_object(best_checkpoint(args.out) or latest)
    scorer = trainer if evaluated == latest or not valid else restore_sharded_trainer(
        args.out, ctx, config, comm, name=evaluated)
    eval_source = valid or iter_file_batches(args.train, schema, config.batch_size,
                                             on_bad_row=config.on_bad_row)
    metrics = scorer.evaluate(eval_source)
    metrics["evaluated_on"] = "valid" if valid else "train"
    rows = sum(h["rows"] for h in history)
    busy = sum(h["rows"] / h["samples_per_s"] for h in history if h["samples_per_s"])
    steps = [h for h in history if h.get("dense_bytes_per_step") is not None]
    metrics.update(
        eval_rows=metrics.pop("rows"), rows=rows, passes=trainer.pass_id,
        samples_per_s=rows / busy if busy else 0.0, wall_seconds=seconds,
        skipped_rows=stats.skipped, store_keys=int(ctx.all_sum([len(trainer.store)])[0]),
        model=config.model.name, world_size=ctx.world, dense_comm=comm.mode,
        checkpoint=evaluated, stop_reason=trainer.stop_reason,
        dense_bytes_per_step=(sum(h["dense_bytes_per_step"] for h in steps) / len(steps)
                              if steps else 0.0),
        sparse_bytes_per_step=(sum(h["sparse_bytes_per_step"] for h in steps) / len(steps)
                               if steps else 0.0))
    if selection is not None:
        metrics.update(selection.summary())
    if ctx.is_main:
        atomic_write_text(args.out / "metrics.json", json.dumps(metrics, indent=2))
        records = [*trainer.history[:-1], {**trainer.history[-1],
                                           "stop_reason": trainer.stop_reason}] \
            if trainer.history else []
        atomic_write_text(args.out / "history.json", json.dumps(records, indent=2))
        report_skipped(stats)
        print(json.dumps({k: metrics[k] for k in ("auc", "logloss", "rows",
                                                  "samples_per_s", "world_size")}))
        print(f"model written to {args.out}")
    ctx.close()
    return 0
