"""A search run as waves of trials, each wave one cohort in one pass loop.

::

    for each wave of K trials (``parallel``):
        ask K trials -> K configs (the base config with the suggested values)
        train.loop.run_passes(K trials)          data read, hashed and planned once per pass
            at every pass boundary: report each live trial's validation metric, then ask
            the pruner; a pruned trial stops and its rows are freed
        tell each trial its best value (or PRUNED)
    out/best/            the best trial as an ordinary model directory

Under torchrun every rank runs this with its ``DistContext``; rank 0 alone talks to
optuna and sends its decisions to the others.
"""

from __future__ import annotations

import contextlib
import math
import shutil
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from terarec.config import TrainConfig, parse_bytes, to_dict
from terarec.data.positions import InputFile
from terarec.distributed.context import DistContext, resolve_device
from terarec.io import LockedError, exclusive_lock, remove_atomic_leftovers
from terarec.train.cohort import (
    KeySides,
    apply_params,
    free_rows,
    in_ram,
    member_config,
    split_budget,
)
from terarec.train.defaults import evaluations_per_epoch
from terarec.train.loop import TrialRun, run_passes
from terarec.train.passes import Pass, iter_scoring_passes
from terarec.train.search.config import SearchConfig
from terarec.train.search.results import write_best, write_trial_files
from terarec.train.search.space import Space, check_batch_sizes, grid_space, suggest
from terarec.train.search.study import (
    LOCK_FILE,
    READER,
    LeftWave,
    SearchStudy,
    open_study,
    resumed_trials,
    sync_journal,
    tell,
)
from terarec.train.search.trials import (
    BestSoFar,
    Commits,
    SearchResult,
    SearchTrial,
    commit_pass,
    pass_seconds,
    trial_dir,
)
from terarec.train.selection import STOP_PRUNED, SelectionTracker
from terarec.train.trainer import Trainer
from terarec.types import Batch, FeatureSchema

OnBoundary = Callable[[list[SearchTrial]], None]


@contextlib.contextmanager
def search_directory_lock(out_dir: str | Path, ctx: DistContext) -> Iterator[None]:
    """One search per directory: rank 0 holds ``out_dir/.lock`` for the block (every rank
    fails with the holder named when another process has it). Its caller holds it through
    everything the search writes, the best trial's refit and results included: a second
    search released beside a refit rewrote ``best/`` under it."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as held:
        failure = None
        if ctx.is_main:  # one search per directory: the journal has one writer
            try:
                held.enter_context(exclusive_lock(out_dir / LOCK_FILE,
                                                  f"search directory {out_dir}"))
                remove_atomic_leftovers(out_dir)  # of a search killed mid-write
            except LockedError as exc:
                failure = str(exc)
        failure = ctx.broadcast_object(failure)
        if failure is not None:
            raise ValueError(failure)
        yield


def run_search(config: SearchConfig, schema: FeatureSchema,
               train: Sequence[str | Path | InputFile], valid: list[Batch],
               out_dir: str | Path, *, ctx: DistContext | None = None,
               on_boundary: OnBoundary | None = None, locked: bool = False) -> SearchResult:
    """Train ``config.trials`` trials on the ``train`` files, ``config.parallel`` at a
    time in one pass loop, select them on the ``valid`` batches, and write the best one
    to ``out_dir/best`` as an ordinary model directory.

    A trial is exactly ``terarec train`` with its values: same initial weights, same
    batches, same random stream. ``out_dir`` also holds every trial's directory and the
    study's journal, so a search stopped at any point continues with
    ``config.resume``: finished trials are kept, the interrupted wave continues from the
    last pass all its trials committed (with none, its trials run again with their
    values). One search uses a directory at a time.

    ``schema``: the features the trials train on, numeric statistics included (as
    ``train`` computes them from the training rows). ``valid``: the validation rows,
    read once and scored by every trial after each pass.

    ``ctx``: this rank's topology under torchrun (every rank calls this; each trial
    trains on all ranks, each keeping its key shard's rows); None trains in this
    process on ``config.base.device``. ``on_boundary`` sees the wave's trials after each
    pass's pruning. ``locked``: the caller holds ``search_directory_lock`` already.
    """
    if not valid:
        raise ValueError("search needs a validation set (--valid)")
    trials = config.trials
    space = config.search_space
    if config.sampler == "grid":  # each grid point once
        trials = min(trials, math.prod(len(v) for v in grid_space(space).values()))
    parallel = min(config.parallel or trials, trials)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    ctx = ctx if ctx is not None else DistContext.single(resolve_device(config.base.device))
    with contextlib.ExitStack() as held:
        if not locked:
            held.enter_context(search_directory_lock(out_dir, ctx))
        search = _Search(config, space, schema, out_dir, ctx, on_boundary)
        return search.run(train, valid, trials, parallel)


@dataclass
class _Search:
    """One search with its directory's lock held: what every wave shares."""

    config: SearchConfig
    space: Space
    schema: FeatureSchema
    out_dir: Path
    ctx: DistContext
    on_boundary: OnBoundary | None
    study: SearchStudy | None = None  # rank 0's
    overall: BestSoFar | None = None
    budget: int | None = None  # the base store's memory budget in bytes, split by trials

    def run(self, train: Sequence[str | Path | InputFile], valid_batches: list[Batch],
            trials: int, parallel: int) -> SearchResult:
        config, base, ctx = self.config, self.config.base, self.ctx
        if ctx.world > 1 and "batch_size" in self.space:
            check_batch_sizes(self.space["batch_size"], ctx.world)
        settings = {"space": self.space, "sampler": config.sampler,
                    "pruner": config.pruner, "select_by": config.select_by,
                    "patience": config.patience, "seed": config.seed,
                    "config": to_dict(base)}
        if config.first_rung > 1:  # searches saved before it existed pruned from pass 1
            settings["first_rung"] = config.first_rung
        self.study = open_study(self.out_dir, settings, config.resume) \
            if ctx.is_main else None
        overall = self.overall = BestSoFar(SelectionTracker(config.select_by, patience=None),
                                           every=config.checkpoint_every)
        done: list[SearchTrial] = []
        left: LeftWave | None = None
        if self.study is not None:
            if config.resume:
                done, left = resumed_trials(self.study, self.out_dir, base,
                                            config.select_by, config.patience, overall,
                                            ctx.world)
            else:
                for params in config.fixed:
                    self.study.study.enqueue_trial(dict(params))
        # Every rank takes the same checkpoint decisions: from the same best so far.
        tracker = overall.tracker
        tracker.best_value, tracker.best_pass, overall.trial, finished, left = \
            ctx.broadcast_object((tracker.best_value, tracker.best_pass, overall.trial,
                                  len(done), left))
        self.budget = parse_bytes(base.store.memory_budget) \
            if base.store.memory_budget else None
        # The validation set's keys are planned once for every trial and evaluation.
        valid = list(iter_scoring_passes(ctx, valid_batches, base.pass_rows))
        start = time.perf_counter()
        if left is not None:  # the wave a stopped search was training, from its last commit
            wave = self._continue(left)
            self._train(wave, train, valid, reader=left.reader)
            done.extend(wave)
            finished += len(wave)
        while finished < trials:
            k = min(parallel, trials - finished)
            # Built one after another, each trainer seeds torch itself: the weights of a
            # trial are those of the same configuration trained alone.
            keys = KeySides()  # one key index per admission/eviction setting of the wave
            wave = [self._ask(k, keys) for _ in range(k)]
            if ctx.is_main:  # which trial's sizes cut the wave's passes, for a resume
                for t in wave:
                    assert t.optuna_trial is not None
                    t.optuna_trial.set_user_attr(READER, wave[0].number)
            self._train(wave, train, valid)
            done.extend(wave)
            finished += k
        # The trial with the best validation value of all, pruned ones included (a pruned
        # trial's best pass is a whole model): the one whose checkpoint ``overall`` took
        # last.
        best = next((t for t in done if t.number == overall.trial), None)
        best_dir = self.out_dir / "best" if best is not None else None
        if ctx.is_main:
            if best is not None and (best.model_dir / "checkpoints").exists():
                write_best(best, self.out_dir, base)  # else out/best holds it (resumed)
            for t in done:  # only the best trial keeps its checkpoints (in out/best)
                # the pointers first: a kill in between never leaves LATEST naming a
                # checkpoint that is gone
                for pointer in ("BEST", "LATEST"):
                    (t.model_dir / pointer).unlink(missing_ok=True)
                shutil.rmtree(t.model_dir / "checkpoints", ignore_errors=True)
        ctx.barrier()
        return SearchResult(done, best, best_dir,
                            self.study.study if self.study is not None else None,
                            time.perf_counter() - start)

    def _new_run(self, trainer: Trainer, number: int, model_dir: Path,
                 selection: SelectionTracker) -> TrialRun:
        assert self.overall is not None
        return TrialRun(trainer, selection, commit_pass(model_dir, number, self.overall),
                        stop_on_divergence=True)

    def _per_epoch(self, trial: TrainConfig) -> int:
        """The evaluations an epoch of ``trial`` (its batch size, its pass length) has."""
        return evaluations_per_epoch(self.config.rows, trial.batch_size, trial.pass_rows)

    def _ask(self, live: int, keys: KeySides) -> SearchTrial:
        """The next trial (rank 0 asks optuna; every rank builds it), one of ``live``
        trials training together."""
        ctx, config = self.ctx, self.config
        trial = self.study.study.ask() if self.study is not None else None
        number, params = ctx.broadcast_object(
            (trial.number, suggest(trial, self.space)) if trial is not None else None)
        model_dir = trial_dir(self.out_dir, number)
        if ctx.is_main:
            shutil.rmtree(model_dir, ignore_errors=True)
        trial_config = member_config(config.base, params, model_dir, self.budget, live)
        trainer = Trainer(self.schema, trial_config, ctx=ctx)
        keys.attach(trainer)
        run = self._new_run(trainer, number, model_dir,
                            SelectionTracker(config.select_by, config.patience,
                                             per_epoch=self._per_epoch(trial_config)))
        return SearchTrial(number, params, trial_config, model_dir, trial, run)

    def _continue(self, left: LeftWave) -> list[SearchTrial]:
        """The trials of ``left`` restored from their checkpoint ``left.name``
        (collective), sharing one key index as the wave did, each with its optuna trial,
        selection and random stream as they were after that pass."""
        config, ctx = self.config, self.ctx
        keys = KeySides()
        by_number = {f.number: f for f in self.study.study.get_trials(deepcopy=False)} \
            if self.study is not None else {}
        wave = []
        for number, params in left.trials:
            model_dir = trial_dir(self.out_dir, number)
            trial_config = member_config(config.base, params, model_dir, self.budget,
                                         len(left.trials))
            trainer = Trainer.from_checkpoint(model_dir, trial_config, name=left.name, ctx=ctx,
                                      prepare=keys.attach)  # torch's RNG: the trial's
            selection = SelectionTracker.from_history(
                trainer.history, config.select_by, config.patience,
                per_epoch=self._per_epoch(trial_config))
            run = self._new_run(trainer, number, model_dir, selection)
            trial = self.study.trial(number) if self.study is not None else None
            told = max(by_number[number].intermediate_values, default=0) \
                if by_number else 0
            wave.append(SearchTrial(number, params, trial_config, model_dir, trial, run,
                                    seconds=sum(pass_seconds(r) for r in trainer.history),
                                    continued_from=left.name, reported=told))
        if ctx.is_main:
            print(f"continuing trial(s) {', '.join(str(t.number) for t in wave)} "
                  f"after {left.name}")
        return wave

    def _train(self, wave: list[SearchTrial], train: Sequence[str | Path | InputFile],
               valid: list[Pass], reader: dict[str, Any] | None = None) -> None:
        """Train a wave to its end. ``reader``: the values of the trial whose batch and
        pass sizes cut the wave's passes, when it is not in ``wave`` (a continued wave
        whose first trial had finished): a stopped stand-in with its configuration
        reads."""
        import optuna

        ctx, overall, study = self.ctx, self.overall, self.study
        assert overall is not None
        metric = f"valid_{self.config.select_by}"
        by_run = {id(t.run): t for t in wave}
        runs = [t.run for t in wave if t.run is not None]
        if reader is not None and runs:
            first = runs[0].trainer
            stand_in = TrialRun(Trainer(first.schema,
                                        in_ram(apply_params(first.config, reader)), ctx=ctx))
            free_rows(stand_in.trainer)
            stand_in.trainer.inputs = first.inputs
            stand_in.stop(STOP_PRUNED)
            runs.insert(0, stand_in)

        def finish(t: SearchTrial, pruned: bool = False) -> None:
            """A trial that trains no more: its files written, then optuna told (so a
            told trial always has its files), its rows freed, its checkpoints dropped
            unless it holds the best pass so far."""
            t.history = list(t.trainer.history)
            value = t.selection.best_value
            t.state = "pruned" if pruned else "complete" if value is not None else "failed"
            if study is not None:  # rank 0 writes the files and tells optuna
                assert t.optuna_trial is not None
                write_trial_files(t)
                state = optuna.trial.TrialState
                tell(study.study, t.optuna_trial.number,
                     value if value is not None and not pruned else None,
                     state=state.PRUNED if pruned else state.FAIL if value is None
                     else None)
            free_rows(t.trainer)
            overall.finish(t.number, t.model_dir, ctx.is_main)

        def boundary(live: list[TrialRun]) -> None:
            overall.commits.wait()  # the round's commits are durable before anything else
            trials = [by_run[id(r)] for r in live if id(r) in by_run]
            for t in trials:  # every live trial reports before any is pruned
                record = t.trainer.history[-1]
                t.seconds += pass_seconds(record)
                value = record.get(metric)
                step = len(t.trainer.history)
                if study is not None and value is not None and math.isfinite(value) \
                        and step > t.reported:  # a pass trained again was reported before
                    assert isinstance(t.optuna_trial, optuna.trial.Trial)
                    t.optuna_trial.report(value, step=step)
            # rank 0 asks the pruner; every rank stops the same trials
            prune = ctx.broadcast_object(
                {t.number for t in trials if t.run is not None and t.run.live
                 and t.number >= self.config.unpruned  # train's own runs go on
                 and isinstance(t.optuna_trial, optuna.trial.Trial)
                 and t.optuna_trial.should_prune()} if study is not None else None)
            for t in trials:
                assert t.run is not None
                if t.run.live and t.number in prune:
                    t.run.stop(STOP_PRUNED)
                    finish(t, pruned=True)
            for t in wave:  # patience ran out, it diverged, or its epochs ended (sat out)
                if t.state == "running" and t.run is not None and not t.run.live:
                    finish(t)
            # the memory budget re-split across the live trials
            split_budget([t.trainer for t in trials if t.state == "running"], self.budget)
            if study is not None:
                sync_journal(self.out_dir)
            if self.on_boundary is not None:
                self.on_boundary(wave)

        overall.commits = Commits(background=ctx.world == 1)
        try:
            run_passes(runs, train, valid, progress=self.config.progress and ctx.is_main,
                       on_boundary=boundary)
        except BaseException:
            overall.commits.close(raise_error=False)  # nothing is written once it stops
            raise
        overall.commits.close()
        for t in wave:
            if t.state == "running":
                finish(t)
        if study is not None:
            sync_journal(self.out_dir)
