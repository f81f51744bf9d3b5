"""A search's trials: their state, the best pass so far, and their checkpoints.

Every live trial commits a checkpoint at every ``every`` passes, as ``train`` does, and
at each pass that leads the whole search when reached; a trial that trains no more
keeps its checkpoints only while it holds the search's best pass (``BestSoFar``).
Commits are written on a background thread while the other trials train (``Commits``).
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from terarec.config import TrainConfig
from terarec.modeldir import LATEST_FILE, mark_best, save_checkpoint
from terarec.train.loop import TrialRun, diverged
from terarec.train.selection import SelectionTracker
from terarec.train.trainer import Trainer

if TYPE_CHECKING:
    from optuna import Study
    from optuna.trial import FrozenTrial, Trial


@dataclass
class SearchTrial:
    """One trial: its values, configuration, state, curve and optuna handle. A trial
    that finished before a resumed search started has no ``run``: its selection and
    stop reason were read back from its directory (``kept``)."""

    number: int
    params: dict[str, Any]
    config: TrainConfig
    model_dir: Path
    optuna_trial: Trial | FrozenTrial | None  # None on ranks other than 0
    run: TrialRun | None
    state: str = "running"  # running, complete, pruned, failed
    seconds: float = 0.0  # its own training and evaluation time
    history: list[dict] = field(default_factory=list)
    kept: tuple[SelectionTracker, str | None] | None = None
    continued_from: str | None = None  # the checkpoint a resumed search continued it from
    reported: int = 0  # passes optuna was told of (before a stop: they are trained again)

    @property
    def selection(self) -> SelectionTracker:
        if self.kept is not None:
            return self.kept[0]
        assert self.run is not None and self.run.selection is not None
        return self.run.selection

    @property
    def stop_reason(self) -> str | None:
        if self.kept is not None:
            return self.kept[1]
        assert self.run is not None
        return self.run.stop_reason

    @property
    def trainer(self) -> Trainer:
        assert self.run is not None, "a trial restored from disk has no trainer"
        return self.run.trainer

    def row(self) -> dict[str, Any]:
        """Its line in the results table."""
        sel = self.selection
        best = next((h for h in self.history if h["pass_id"] + 1 == sel.best_pass), {})
        return {"trial": self.number, "state": self.state, "value": sel.best_value,
                "select_by": sel.select_by, "best_pass": sel.best_pass,
                "passes": len(self.history), "stop_reason": self.stop_reason,
                "valid_auc": best.get("valid_auc"), "valid_logloss": best.get("valid_logloss"),
                "seconds": round(self.seconds, 3),
                **{f"params.{k}": v for k, v in self.params.items()}}


@dataclass
class SearchResult:
    """What a search found: every trial, the best one (by its best validation value,
    pruned trials included) and the model directory it was written to."""

    trials: list[SearchTrial]
    best: SearchTrial | None
    best_dir: Path | None  # OUT/best: an ordinary model directory
    study: Study | None  # optuna's study (None on ranks other than 0)
    seconds: float

    @property
    def best_params(self) -> dict[str, Any] | None:
        """The best trial's values, by dotted config path."""
        return dict(self.best.params) if self.best is not None else None

    @property
    def best_value(self) -> float | None:
        """The best trial's best validation value (its ``select_by`` metric)."""
        return self.best.selection.best_value if self.best is not None else None

    def rows(self) -> list[dict[str, Any]]:
        """The trials table: one row per trial, in trial order."""
        return [t.row() for t in self.trials]


def trial_dir(out_dir: Path, number: int) -> Path:
    """A trial's model directory."""
    return out_dir / "trials" / f"trial-{number:03d}"


def pass_seconds(record: dict) -> float:
    """A trial's own time in one pass: staging, training and writing back its rows."""
    return record["staging_s"] + record["train_s"] + record["write_back_s"]


@dataclass
class BestSoFar:
    """The best pass of any trial so far and which trial holds it. A trial that trains
    no more (``finished``) keeps its checkpoints only while it holds that pass: the pass
    the search ends up choosing was the best so far when it was reached, so no later
    pass of a trial it does not name is ever needed."""

    tracker: SelectionTracker
    trial: int | None = None
    finished: dict[int, Path] = field(default_factory=dict)
    every: int = 1  # live trials commit every N passes (``commit_pass``)
    commits: Commits = field(default_factory=lambda: Commits(background=False))

    def lead(self, number: int, value: float, best_pass: int, is_main: bool) -> Path | None:
        """Trial ``number`` holds the best pass now. Returns the directory of the trial
        that held it, finished, whose checkpoints are to go once ``number``'s pass is
        committed (None: nothing to drop)."""
        before, self.trial = self.trial, number
        self.tracker.update(value, best_pass)
        if is_main and before is not None and before != number and before in self.finished:
            return self.finished[before]
        return None

    def consider(self, number: int, selection: SelectionTracker) -> None:
        """A resumed search: trial ``number``'s best pass, held on disk, leads if better."""
        value = selection.best_value
        if value is not None and self.tracker.is_better(value):
            self.tracker.update(value, selection.best_pass or 0)
            self.trial = number

    def finish(self, number: int, model_dir: Path, is_main: bool) -> None:
        """Trial ``number`` trains no more."""
        self.finished[number] = model_dir
        if is_main and number != self.trial:
            drop_checkpoints(model_dir)


def drop_checkpoints(model_dir: Path) -> None:
    """The pointers first, then the checkpoints: killed in between, a trial never has a
    ``LATEST`` naming a checkpoint that is gone."""
    for pointer in ("BEST", LATEST_FILE):
        (model_dir / pointer).unlink(missing_ok=True)
    shutil.rmtree(model_dir / "checkpoints", ignore_errors=True)


def commit_pass(model_dir: Path, number: int, overall: BestSoFar
                 ) -> Callable[[Trainer, dict], None]:
    """The pass-end hook of a trial: commit a checkpoint (collective on N ranks), as
    ``train`` does, so a stopped search continues the trial from it (every
    ``overall.every`` passes, the same passes for every trial, the last of which pruning
    keeps); and a pass that leads the whole search so far, which it marks ``BEST``. A
    diverged pass is not committed (the pass loop has stopped its trial)."""

    def hook(trainer: Trainer, record: dict) -> None:
        if diverged(record):  # its run stopped (``TrialRun.stop_on_divergence``)
            return
        value = record[overall.tracker.key]
        leads = bool(record.get("best")) and overall.tracker.is_better(value)
        every = overall.every
        if trainer.pass_id % every and not leads:
            return
        last = trainer.pass_id // every * every
        pinned = f"pass-{last:06d}" if last else None
        # What the trial's own state cannot tell later is taken now: torch's random
        # state (the next trial's pass replaces it) and the lead (the next trial's pass
        # compares against it). The rest waits, unchanged, until the trial's next pass.
        rng = torch.get_rng_state().tolist()
        is_main = trainer.ctx.is_main
        best = bool(record.get("best"))
        dropped = overall.lead(number, value, int(record["pass_id"]) + 1, is_main) \
            if leads else None

        def write() -> None:
            name = save_checkpoint(model_dir, trainer, pinned=pinned, rng=rng).name
            if best and is_main:
                mark_best(model_dir, name)
            if dropped is not None:  # the former leader's pass, once this one is durable
                drop_checkpoints(dropped)

        overall.commits.submit(write)

    return hook


class Commits:
    """The trials' checkpoint commits, written on one background thread in one process.

    In a pass round a trial's state is idle from its pass end until its next pass while
    the other trials train theirs, so its commit is written meanwhile (on the synthetic
    search benchmark the commits were a fifth of the time). Whatever reads or changes
    what a commit reads waits for them first (``wait``): the pass boundary (pruning
    frees rows, the journal records committed passes; the next round's first pull
    changes the shared key index) and the end of a wave. On N ranks a commit is
    collective, so it is written in place (``background=False``)."""

    def __init__(self, background: bool) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="terarec-commit") \
            if background else None
        self._pending: list[Future[None]] = []
        self._failed = False

    def submit(self, write: Callable[[], None]) -> None:
        if self._pool is None:
            write()
        else:
            self._pending.append(self._pool.submit(self._after_the_others, write))

    def _after_the_others(self, write: Callable[[], None]) -> None:
        """Write, unless a commit queued before failed (the search stops with its
        error: nothing after it is written)."""
        if self._failed:
            return
        try:
            write()
        except BaseException:
            self._failed = True
            raise

    def wait(self, raise_error: bool = True) -> None:
        """Block until every submitted commit is written; raise the first one's error
        (``raise_error=False``: the caller is already raising its own)."""
        pending, self._pending = self._pending, []
        errors = [e for e in (f.exception() for f in pending) if e is not None]
        if errors and raise_error:
            raise errors[0]

    def close(self, raise_error: bool = True) -> None:
        """``wait``, then end the thread."""
        try:
            self.wait(raise_error)
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
