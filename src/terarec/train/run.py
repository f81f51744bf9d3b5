"""One ``terarec train`` run, in one process or as one of N torchrun ranks.

The topology (``DistContext``) is the only difference between the two: alone, every
collective below is free; on N ranks every rank runs this same function, reads its
share of each pass, owns one shard of the store, commits its shard of every checkpoint
with the others (``save_checkpoint``), and only rank 0 writes metrics. A worker group
restarted by torchrun (``--max-restarts``) resumes from the last committed pass on its
own.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from terarec.config import DenseCommConfig, TrainConfig, parse_bytes
from terarec.data.positions import InputFile, Positions
from terarec.data.readers import ReadStats
from terarec.distributed.context import DistContext, restart_count
from terarec.export.writer import IncrementalExporter
from terarec.finite import check_finite_loss
from terarec.io import atomic_write_text, finite_json
from terarec.modeldir import (
    best_checkpoint,
    clear_best,
    list_checkpoints,
    mark_best,
    pass_name,
    save_checkpoint,
)
from terarec.train.follow import (
    CACHE_DIR,
    METRICS_FILE,
    FollowOptions,
    FollowSource,
    FollowStop,
    StopSignal,
    follow_inputs,
    write_prometheus,
)
from terarec.train.loop import StreamOptions
from terarec.train.passes import Pass, iter_file_batches
from terarec.train.progressive import progressive_summary
from terarec.train.selection import SelectionTracker, refit_epochs
from terarec.train.trainer import Trainer
from terarec.types import FeatureSchema


def process_seconds() -> float | None:
    """Wall seconds since this process started (interpreter start-up and imports
    included), from ``/proc``; None where there is none."""
    try:
        with open("/proc/self/stat") as fh:
            started = int(fh.read().rsplit(")", 1)[1].split()[19])  # field 22: start time
        with open("/proc/uptime") as fh:
            uptime = float(fh.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return max(uptime - started / os.sysconf("SC_CLK_TCK"), 0.0)


class PhaseClock:
    """Wall seconds per phase of a run (``metrics.json``'s ``phase_seconds``): where the
    time goes besides the passes themselves (start-up, statistics, validation,
    checkpoints, final scoring), which decides how well a whole run scales with ranks."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        started = process_seconds()
        if started is not None:
            self.seconds["start"] = started

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - t0)

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds

    def rounded(self) -> dict[str, float]:
        return {k: round(v, 3) for k, v in self.seconds.items()}


@dataclass
class TrainRun:
    """What to train on and where the model directory is."""

    train: list[Path | InputFile]  # InputFile: a copy named by the file it was made from
    out: Path
    valid: list[Path] = field(default_factory=list)
    resume: bool = False
    checkpoint_every: int = 1  # commit a checkpoint every N passes
    progress: bool = True
    follow: FollowOptions | None = None  # train a folder's files as they land
    # Once selection has picked the best epoch count, train a fresh model that long on
    # train + valid and make it the run's model (``refit``).
    refit: bool = False
    # What was decided before training (a value chosen by validation): metrics.json keeps it.
    notes: dict[str, Any] = field(default_factory=dict)


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
    clock = PhaseClock()
    setup = time.perf_counter()
    if config.store.memory_budget is not None:
        parse_bytes(config.store.memory_budget)  # a bad size fails here, not mid-run
        if config.store.disk_path is None:
            config.store.disk_path = str(run.out / "store")
    # No try/finally around the run: a rank that fails must exit rather than wait in a
    # collective for peers; torchrun then stops them.
    resume = run.resume or restart_count() > 0
    if resume and list_checkpoints(run.out):
        trainer = Trainer.from_checkpoint(run.out, config, ctx=ctx, dense_comm=dense_comm)
        if ctx.is_main:
            where = f"rank 0/{ctx.world}: " if ctx.world > 1 else ""
            print(f"{where}resuming {run.out} after pass {trainer.pass_id}")
        if selection is not None:  # continue with the best value and patience it had
            selection = SelectionTracker.from_history(trainer.history, selection.select_by,
                                                      selection.patience,
                                                      task=selection.task,
                                                      per_epoch=selection.per_epoch)
    else:
        earlier = list_checkpoints(run.out)
        if earlier:  # a fresh run's pass-000001 would be pruned below their numbers
            raise ValueError(f"{run.out} holds checkpoints of an earlier run (newest "
                             f"{earlier[0].name}): pass --resume to continue it, or "
                             "choose another --out")
        if ctx.is_main:
            clear_best(run.out)
        trainer = Trainer(schema(), config, ctx=ctx, dense_comm=dense_comm)
    clock.add("setup", time.perf_counter() - setup)
    stats, valid_stats = ReadStats(), ReadStats()
    with clock.phase("read_valid"):  # on N ranks, each reads and plans its share once
        valid = trainer.scoring_passes(run.valid, valid_stats)
    if run.valid and not valid_stats.rows:  # (summed over the ranks)
        raise ValueError(_no_rows("validation", run.valid, valid_stats))
    versions = exporter(trainer) if exporter is not None else None
    every = max(1, run.checkpoint_every)

    def commit(t: Trainer) -> None:
        with clock.phase("checkpoint"):
            save_checkpoint(run.out, t)
        if on_commit is not None:
            on_commit(t)

    def on_pass_end(t: Trainer, record: dict) -> None:
        check_finite_loss(record["train_loss"], f"pass {t.pass_id}")  # the same on every rank
        # Every rank holds the same (gathered) metrics, so all take this branch together.
        if t.pass_id % every == 0 or record.get("best"):
            commit(t)
            if record.get("best") and ctx.is_main:
                mark_best(run.out, pass_name(t.pass_id))
        if versions is not None:
            with clock.phase("export"):
                versions.on_pass_end(t, record)
        if following is not None and ctx.is_main:
            following.on_pass_end(t)

    following = _Following(run, trainer, versions) if run.follow is not None else None
    trained_before = len(trainer.history)
    # Bad rows skipped before a resume: the checkpoint's marks hold them, this run's read
    # counts only the rows after them.
    skipped_before = sum(m.skipped for m in Positions.from_dict(trainer.inputs).files.values())
    start = time.perf_counter()
    try:
        history = trainer.fit(following.inputs if following else run.train, valid,
                              progress=run.progress, stats=stats, on_pass_end=on_pass_end,
                              skip_passes=trainer.pass_id, selection=selection,
                              stream=following.stream if following else None)
    finally:
        if following is not None:
            following.close()
    seconds = time.perf_counter() - start
    clock.add("evaluate", sum(h.get("eval_s", 0.0) for h in history[trained_before:]))
    clock.add("train", seconds - sum(clock.seconds.get(k, 0.0)
                                     for k in ("evaluate", "checkpoint", "export")))
    if trainer.pass_id == 0:  # nothing trained: no checkpoint of an untrained model
        if following is not None:
            raise ValueError(f"--follow {following.source}: stopped "
                             f"({following.stop.reason}) before any file was trained")
        raise ValueError(_no_rows("training", run.train, stats))
    # the run's count: training and validation rows
    stats.skipped += valid_stats.skipped + skipped_before
    stats.examples = (valid_stats.examples + stats.examples)[:stats.max_examples]
    if not history or trainer.pass_id % every:
        commit(trainer)
    if versions is not None:
        with clock.phase("export"):
            versions.finish(trainer)
    final = time.perf_counter()
    latest = pass_name(trainer.pass_id)
    evaluated = ctx.broadcast_object(best_checkpoint(run.out) or latest)
    # The best pass is scored from its checkpoint, in a store of its own (a tiered one in
    # a scratch folder: the live store's folder stays the training run's).
    scorer = trainer if evaluated == latest or not valid else Trainer.from_checkpoint(
        run.out, name=evaluated, ctx=ctx, dense_comm=dense_comm)
    metrics = _run_metrics(scorer, trainer, valid, run, history, seconds, stats)
    clock.add("final_score", time.perf_counter() - final)
    metrics.update(checkpoint=evaluated, stop_reason=trainer.stop_reason,
                   phase_seconds=clock.rounded())
    if following is not None:
        metrics.update(stop_reason=following.stop.reason or trainer.stop_reason,
                       **progressive_summary(trainer.history),
                       files_trained=Positions.from_dict(trainer.inputs).done_files)
    if selection is not None:
        metrics.update(selection.summary())
        selected = scorer  # the model BEST names
        if run.refit and valid and following is None:
            # Its checkpoints are committed: the training store makes way for the refit's
            # (a tiered store's folder and its share of the memory budget).
            trainer.store.close()
            with clock.phase("refit"):
                metrics["refit"], refit = refit_model(
                    run, trainer.schema, trainer.config, trainer.history,
                    selection.best_pass, ctx, dense_comm)
            if refit is not None:
                selected = refit
                metrics.update(selected_checkpoint=evaluated,
                               checkpoint=metrics["refit"]["checkpoint"])
        if versions is not None and selected is not trainer and following is None:
            # The live versions followed the passes; the last one published is the model
            # eval and predict score, so that serving ends on it too.
            with clock.phase("export"):
                metrics["selected_version"] = versions.export(selected, full=True).name
        metrics["phase_seconds"] = clock.rounded()
    metrics.update(run.notes)
    if ctx.is_main:
        atomic_write_text(run.out / "metrics.json", finite_json(metrics, indent=2))
        records = [*trainer.history[:-1], {**trainer.history[-1],
                                           "stop_reason": trainer.stop_reason}] \
            if trainer.history else []
        atomic_write_text(run.out / "history.json", finite_json(records, indent=2))
    return metrics, stats


def refit_model(run: TrainRun, schema: FeatureSchema, config: TrainConfig,
                history: list[dict], best_pass: int | None, ctx: DistContext,
                dense_comm: DenseCommConfig | None = None) -> tuple[dict, Trainer | None]:
    """Train a fresh model (``schema``, ``config`` and its seed, as the selection run had
    them) on ``run``'s training and validation rows for as many epochs as the selected
    pass had trained (``refit_epochs`` of the run's ``history``), commit it after the
    checkpoints in ``run.out`` and mark it ``BEST``: the model eval, export and serve then
    use. On small data the validation rows are a real share of what there is to learn
    from; validation has done its job once it has picked the epoch count. Collective on
    N ranks. Returns what metrics.json says under ``refit`` (``skipped`` with a reason
    when the selection gives no epoch count) and the refit model (None when skipped)."""
    epochs = refit_epochs(history, best_pass)
    if epochs is None:
        return {"skipped": "no whole-epoch best pass to refit to"}, None
    model = Trainer(schema, replace(config, epochs=epochs), ctx=ctx, dense_comm=dense_comm)
    done = list_checkpoints(run.out)  # the refit's checkpoint comes after them
    model.pass_id = int(done[0].name.split("-")[1]) if done else 0
    trained = model.fit([*run.train, *run.valid], None, progress=run.progress,
                        stats=ReadStats())
    for record in trained:
        check_finite_loss(record["train_loss"], f"refit pass {record['pass_id']}")
    save_checkpoint(run.out, model)
    name = pass_name(model.pass_id)
    if ctx.is_main:
        mark_best(run.out, name)
    return {"epochs": epochs, "rows": sum(h["rows"] for h in trained),
            "train_loss": trained[-1]["train_loss"] if trained else None,
            "checkpoint": name}, model


def _no_rows(what: str, paths: Sequence[Path | InputFile], stats: ReadStats) -> str:
    files = ", ".join(p.key if isinstance(p, InputFile) else str(p) for p in paths)
    if stats.skipped:
        return (f"no {what} rows in {files}: all {stats.skipped} rows read were bad and "
                f"skipped (--on-bad-row skip); first: {stats.examples[0]}")
    return f"no {what} rows in {files}: the files hold no data rows"


def _run_metrics(scorer: Trainer, trainer: Trainer, valid: list[Pass], run: TrainRun,
                 history: list[dict], seconds: float, stats: ReadStats) -> dict:
    """Scores on the validation rows (the training rows without them) and the run's
    figures (``scorer``: the trainer or the best pass restored). ``samples_per_s``: rows
    trained over the passes' time (each pass's own
    figure already takes the ranks' mean), reading and scoring not included."""
    config = trainer.config
    if valid or run.follow is None:
        metrics: dict[str, Any] = dict(
            scorer.evaluate_passes(valid) if valid
            else scorer.evaluate(iter_file_batches(run.train, trainer.schema,
                                                   config.batch_size,
                                                   on_bad_row=config.on_bad_row)))
        metrics["evaluated_on"] = "valid" if valid else "train"
        metrics.pop("samples_per_s")  # scoring throughput; training throughput below
    else:  # a followed stream: each file was scored before it was trained
        summary = progressive_summary(trainer.history)
        metrics = {"auc": summary["progressive_auc"], "logloss": summary["progressive_logloss"],
                   "rows": sum(h.get("file_rows", 0) for h in trainer.history),
                   "evaluated_on": "progressive"}
        metrics.update({k[len("progressive_"):]: v for k, v in summary.items()  # per task
                        if k.startswith(("progressive_auc_", "progressive_logloss_"))})
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
                               if steps else 0.0),
        # ``epochs`` is an upper bound (patience may stop first): both are said
        epochs_trained=max((int(h.get("epoch", 0)) + 1 for h in history), default=0),
        epochs_limit=config.epochs)
    return metrics


class _Following:
    """A ``--follow`` run's parts: the stream of landed files, the stop rule (SIGTERM,
    ``--stop-after``, ``--stop-idle``), exports on the clock while idle, and history and
    Prometheus figures rewritten after every pass."""

    def __init__(self, run: TrainRun, trainer: Trainer,
                 versions: IncrementalExporter | None) -> None:
        assert run.follow is not None
        self.run, self.trainer = run, trainer
        self.source = run.follow.source
        self.stop_event = threading.Event()
        self.signal = StopSignal()
        self.stop = FollowStop(run.follow, trainer, self.signal)
        source = FollowSource(run.follow, run.out / CACHE_DIR)
        self.inputs = follow_inputs(source, trainer.ctx, Positions.from_dict(trainer.inputs),
                                    run.follow.poll_s, self.stop_event)

        def on_idle(runs: list) -> None:
            if versions is not None:  # a delta due on the clock goes out while idle
                versions.on_pass_end(trainer)

        self.stream = StreamOptions(per_file=True, progressive=True, lookahead=False,
                                    on_idle=on_idle, should_stop=self.stop)

    def on_pass_end(self, trainer: Trainer) -> None:
        """Rank 0, after the pass's checkpoint: history and metrics for watchers."""
        atomic_write_text(self.run.out / "history.json",
                          finite_json(trainer.history, indent=2))
        write_prometheus(self.run.out / METRICS_FILE, trainer)

    def close(self) -> None:
        self.stop_event.set()
        self.signal.close()
