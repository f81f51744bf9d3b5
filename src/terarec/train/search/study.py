"""A search's persistence: its optuna study journaled in its directory, and the resume.

A search stopped or killed at any point is resumed from ``OUT/study.journal`` and
``OUT/search.json`` (the settings it was started with, which a resume must repeat):
finished trials are read back from their directories, the wave it was training
continues from the last pass all its trials committed, and a trial that cannot continue
is asked again with its values. Only optuna's public API is used; the journal is
optuna's format, written by ``_journal``.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from terarec.config import TrainConfig
from terarec.io import atomic_write_text
from terarec.modeldir import (
    LATEST_FILE,
    CheckpointError,
    clear_best,
    list_checkpoints,
    mark_best,
    verify_checkpoint,
)
from terarec.train.cohort import apply_params
from terarec.train.search.samplers import make_pruner, make_sampler
from terarec.train.search.trials import BestSoFar, SearchTrial, trial_dir
from terarec.train.selection import SelectionTracker, higher_is_better

if TYPE_CHECKING:
    from optuna import Study
    from optuna.storages import BaseStorage
    from optuna.storages.journal import BaseJournalBackend
    from optuna.trial import FrozenTrial, Trial, TrialState

log = logging.getLogger(__name__)

LOCK_FILE = ".lock"  # in the search directory: held by the one search using it
STUDY_FILE = "study.journal"  # optuna's journal: every trial asked, reported and told
SETTINGS_FILE = "search.json"  # what the search was started with
_INTERRUPTED = "interrupted"  # user attribute of a trial a stopped search left running
READER = "reader"  # user attribute: the trial whose batch and pass sizes cut its wave


@dataclass(frozen=True)
class SearchStudy:
    """A search's optuna study and the journal storage it was opened on. The storage's
    own methods (``optuna.storages.BaseStorage``) reach what the study's do not: the
    attributes of a trial the search did not ask itself (one marked interrupted, one
    queued again)."""

    study: Study
    storage: BaseStorage

    def trial_id(self, number: int) -> int:
        """The storage's id of trial ``number``."""
        study_id = self.storage.get_study_id_from_name(self.study.study_name)
        return self.storage.get_trial_id_from_study_id_trial_number(study_id, number)

    def trial(self, number: int) -> Trial:
        """Trial ``number``, running, to report to and tell (a continued wave's)."""
        import optuna

        return optuna.trial.Trial(self.study, self.trial_id(number))


def open_study(out_dir: Path, settings: dict[str, Any], resume: bool) -> SearchStudy:
    """The search's optuna study, journaled in ``out_dir/study.journal`` so that a
    search killed at any point can be resumed. A fresh search refuses a directory that
    holds one; a resumed one must have the settings it was started with."""
    import optuna
    from optuna.storages import JournalStorage

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    journal, saved = out_dir / STUDY_FILE, out_dir / SETTINGS_FILE
    settings = json.loads(json.dumps(settings))  # as it reads back (lists, not tuples)
    if resume:
        if not journal.exists() or not saved.exists():
            raise ValueError(f"{out_dir}: no search to resume (no {STUDY_FILE} / "
                             f"{SETTINGS_FILE}); run it without --resume first")
        before = json.loads(saved.read_text())
        for key, value in settings.items():
            if before.get(key) != value:
                raise ValueError(f"{saved}: the search was started with a different "
                                 f"{key} ({_diff(before.get(key), value)}); resume it "
                                 "with the settings it was started with")
    elif journal.exists():
        raise ValueError(f"{out_dir} holds a search ({STUDY_FILE}): pass --resume to "
                         "continue it, or choose another --out")
    else:
        atomic_write_text(saved, json.dumps(settings, indent=2))
    storage = JournalStorage(_journal(journal))
    direction: Literal["maximize", "minimize"] = \
        "maximize" if higher_is_better(settings["select_by"]) else "minimize"
    study = optuna.create_study(storage=storage, study_name="search",
                                load_if_exists=resume, direction=direction,
                                pruner=make_pruner(settings["pruner"],
                                                   settings.get("first_rung", 1)))
    # A sampler's random stream is not journaled: a resumed one continues from a seed of
    # its own, so that it does not draw again the values it drew before. The grid
    # sampler's seed orders its grid, which point numbers in the journal refer to.
    shift = len(study.trials) if settings["sampler"] != "grid" else 0
    study.sampler = make_sampler(settings["sampler"], settings["space"],
                                 settings["seed"] + shift)
    return SearchStudy(study, storage)


def _diff(before: Any, now: Any) -> str:
    """Where two settings differ: the first differing path (dotted) and both values."""
    if isinstance(before, dict) and isinstance(now, dict):
        for key in sorted(set(before) | set(now)):
            if before.get(key) != now.get(key):
                inner = _diff(before.get(key), now.get(key))
                return f"{key}.{inner}" if isinstance(before.get(key), dict) else \
                    f"{key}: {before.get(key)!r} then, {now.get(key)!r} now"
    return f"{before!r} then, {now!r} now"


def resumed_trials(journaled: SearchStudy, out_dir: Path, base: TrainConfig, select_by: str,
                    patience: int | None, overall: BestSoFar, world: int
                    ) -> tuple[list[SearchTrial], LeftWave | None]:
    """The trials a stopped search finished, read back from their directories, the best
    of them so far (``overall``), and the wave it left running, to be continued from the
    last pass all its trials committed (``_left_wave``). A running trial that cannot be
    continued (no such pass) is told FAIL (marked interrupted, left out of the results)
    and asked again with the same values."""
    import optuna

    study = journaled.study
    states = {optuna.trial.TrialState.COMPLETE: "complete",
              optuna.trial.TrialState.PRUNED: "pruned",
              optuna.trial.TrialState.FAIL: "failed"}
    done: list[SearchTrial] = []
    running = []
    for frozen in study.get_trials(deepcopy=False):
        model_dir = trial_dir(out_dir, frozen.number)
        if frozen.state == optuna.trial.TrialState.RUNNING:
            running.append(frozen)
            continue
        if frozen.state not in states or frozen.user_attrs.get(_INTERRUPTED):
            continue
        history = json.loads((model_dir / "history.json").read_text())
        metrics = json.loads((model_dir / "metrics.json").read_text())
        selection = SelectionTracker.from_history(history, select_by, patience)
        stop = history[-1].get("stop_reason") if history else None
        t = SearchTrial(frozen.number, dict(metrics.get("params", frozen.params)),
                        apply_params(base, frozen.params), model_dir, frozen, None,
                        state=states[frozen.state], seconds=float(metrics.get("seconds", 0)),
                        history=history, kept=(selection, stop))
        done.append(t)
        overall.finished[t.number] = model_dir
        # the best so far holds a BEST checkpoint, or, once a search ended, is out/best
        if (model_dir / "BEST").exists() or _best_dir_trial(out_dir) == t.number:
            overall.consider(t.number, selection)
    left = _left_wave(study, running, out_dir, world, select_by, patience, overall) \
        if running else None
    if left is None:
        for frozen in running:
            journaled.storage.set_trial_user_attr(journaled.trial_id(frozen.number),
                                                  _INTERRUPTED, True)
            tell(study, frozen.number, state=optuna.trial.TrialState.FAIL)
            _ask_again(journaled, frozen)
            shutil.rmtree(trial_dir(out_dir, frozen.number), ignore_errors=True)
    return done, left


@dataclass(frozen=True)
class LeftWave:
    """The trials a stopped search left running, to be continued from checkpoint
    ``name``, which each of them committed: (number, values) each, and the values of the
    trial whose batch and pass sizes cut the wave's passes when it is not one of them."""

    name: str
    trials: list[tuple[int, dict[str, Any]]]
    reader: dict[str, Any] | None


def _left_wave(study: Study, running: list[FrozenTrial], out_dir: Path, world: int, select_by: str,
               patience: int | None, overall: BestSoFar) -> LeftWave | None:
    """The wave ``running`` (optuna's RUNNING trials), continued from the newest pass
    every one of them committed at this world size, or None where there is none. The
    trials of a wave train the same passes in step, so a kill leaves each at that pass or
    one after it; checkpoints and ``BEST`` newer than it are dropped (training them again
    writes them again, the same), and the best so far takes in their best passes."""
    running = sorted(running, key=lambda f: f.number)
    common: set[str] | None = None
    for frozen in running:
        have = {p.name for p in list_checkpoints(trial_dir(out_dir, frozen.number))}
        common = have if common is None else common & have
    if not common or any(set(f.params) != set(f.distributions) for f in running):
        return None
    found = next(((n, metas) for n in sorted(common, reverse=True)
                  if (metas := _loadable(out_dir, running, n, world)) is not None), None)
    if found is None:
        return None
    name, metas = found
    for frozen, meta in zip(running, metas, strict=True):
        model_dir = trial_dir(out_dir, frozen.number)
        # the pointers before the newer checkpoints go: a kill in between leaves none
        # naming a checkpoint that is gone
        atomic_write_text(model_dir / LATEST_FILE, name)
        clear_best(model_dir)
        for newer in list_checkpoints(model_dir):
            if newer.name > name:
                shutil.rmtree(newer)
        selection = SelectionTracker.from_history(meta.get("history", []), select_by,
                                                  patience)
        best = f"pass-{selection.best_pass or 0:06d}"
        if selection.best_pass and (model_dir / "checkpoints" / best).is_dir():
            mark_best(model_dir, best)
            overall.consider(frozen.number, selection)
    reader_number = running[0].user_attrs.get(READER, running[0].number)
    reader = None
    if reader_number not in {f.number for f in running}:
        reader = dict(study.trials[reader_number].params)
    return LeftWave(name, [(f.number, dict(f.params)) for f in running], reader)


def _loadable(out_dir: Path, running: list[FrozenTrial], name: str, world: int
              ) -> list[dict] | None:
    """The metas of every trial's checkpoint ``name``, if each verifies (checksums) and
    was written at this world size with input positions to read on from; else None."""
    metas = []
    for frozen in running:
        try:
            meta = verify_checkpoint(trial_dir(out_dir, frozen.number) / "checkpoints" / name)
        except CheckpointError as exc:
            log.warning("search --resume: not continuing from %s: %s", name, exc)
            return None
        if int(meta.get("world_size", 1)) != world or not meta.get("inputs"):
            return None
        metas.append(meta)
    return metas


def _best_dir_trial(out_dir: Path) -> int | None:
    """The trial ``out/best`` was written from (by a search that ended), or None."""
    metrics = out_dir / "best" / "metrics.json"
    if not metrics.exists():
        return None
    return json.loads(metrics.read_text()).get("trial")


def _ask_again(journaled: SearchStudy, frozen: FrozenTrial) -> None:
    """Queue a trial with the values of the interrupted ``frozen``. A grid point goes
    with it (its ``grid_id``, which the grid counts as visited), and the grid sampler
    draws that point's values again, even those ``frozen`` was interrupted before it
    drew. A trial of another sampler interrupted before it drew all its values is simply
    replaced by the next one asked."""
    grid = {key: frozen.system_attrs[key] for key in ("grid_id", "search_space")
            if key in frozen.system_attrs}
    params = dict(frozen.params)
    if "grid_id" in grid:
        params = {}  # nothing fixed: the sampler reads the point's values from grid_id
    elif set(params) != set(frozen.distributions) or not params:
        return
    study = journaled.study
    study.enqueue_trial(params)
    waiting = journaled.trial_id(study.get_trials(deepcopy=False)[-1].number)
    for key, value in grid.items():
        journaled.storage.set_trial_system_attr(waiting, key, value)


def _journal(path: Path) -> BaseJournalBackend:
    """optuna's journal in one file, appended at every call but fsynced only by
    ``sync_journal`` (at pass boundaries): a search appends a few records per trial and
    pass, and an fsync each costs more than a small trial's pass. A kill -9 loses
    nothing written (the kernel has it); a power loss at most what followed the last
    boundary. No lock file: the search directory's lock (``LOCK_FILE``, held by rank 0
    for the whole search) makes this process the only writer, and a lock file would
    outlive a kill -9 and stall the resume. The format is optuna's journal file's: one
    JSON record a line; a last line a kill cut short is not a record."""
    from optuna.storages.journal import BaseJournalBackend

    class Journal(BaseJournalBackend):
        def __init__(self) -> None:
            self._path = path
            path.touch()
            self._read = (0, 0)  # records read so far, and the bytes they took

        def read_logs(self, log_number_from: int) -> list[dict[str, Any]]:
            number, offset = self._read if self._read[0] <= log_number_from else (0, 0)
            with open(self._path, "rb") as fh:
                fh.seek(offset)
                data = fh.read()
            logs = []
            for line in data.splitlines(keepends=True):
                if not line.endswith(b"\n"):
                    break
                if number >= log_number_from:
                    logs.append(json.loads(line))
                number, offset = number + 1, offset + len(line)
            self._read = (number, offset)
            return logs

        def append_logs(self, logs: list[dict[str, Any]]) -> None:
            text = "".join(json.dumps(log, separators=(",", ":")) + "\n" for log in logs)
            with open(self._path, "ab") as fh:
                fh.write(text.encode("utf-8"))

    return Journal()


def sync_journal(out_dir: Path) -> None:
    """Make the study's journal durable (``_journal``)."""
    with open(out_dir / STUDY_FILE, "rb") as fh:
        os.fsync(fh.fileno())


def tell(study: Study, trial: Trial | int, value: float | None = None,
         state: TrialState | None = None) -> None:
    """``study.tell``. The grid sampler calls ``study.stop()`` once its grid is used up,
    which optuna allows only inside ``optimize``; the trial is stored before that
    (optuna writes it in a ``finally``), so that one error is dropped."""
    try:
        study.tell(trial, value, state=state)
    except RuntimeError as exc:
        if "Study.stop" not in str(exc):
            raise
