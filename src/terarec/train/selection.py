"""Model selection on a validation set: which evaluation was best, and when to stop.

The pass loop hands every evaluation to a :class:`SelectionTracker`; the tracker says
whether it improved on the best so far and whether training should stop (``patience``
epochs' worth of evaluations in a row without improvement). The tracker holds no tensors
and decides from the metric values alone, so ranks that gathered the same metrics decide
the same.

A tracker is rebuilt from a run's history (:meth:`SelectionTracker.from_history`), so a
resumed run continues with the best value and the patience count it had.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

SelectBy = Literal["auc", "logloss"]
SELECT_BY: tuple[str, ...] = ("auc", "logloss")
DEFAULT_PATIENCE = 2
# With a validation set and no --epochs, training runs until patience stops it, or this
# many epochs plus the patience.
DEFAULT_MAX_EPOCHS = 10

# Why a run stopped (``stop_reason`` in metrics.json / history.json).
STOP_PATIENCE = "patience"  # ``patience`` epochs of evaluations without improvement
STOP_EPOCHS = "epochs_exhausted"  # the epoch upper bound was reached
STOP_END_OF_DATA = "end_of_data"  # no validation set: the configured epochs were read
STOP_PRUNED = "pruned"  # a search pruned the trial
STOP_DIVERGED = "diverged"  # a search trial's loss or validation metric went non-finite


def metric_key(select_by: str, task: str | None = None) -> str:
    """History key of the selected metric: ``valid_auc`` / ``valid_logloss`` (with
    several labels, their weighted mean), or one task's, ``valid_auc_<task>``."""
    if select_by not in SELECT_BY:
        raise ValueError(f"select-by {select_by!r}: expected one of {', '.join(SELECT_BY)}")
    return f"valid_{select_by}" if task is None else f"valid_{select_by}_{task}"


def higher_is_better(select_by: str) -> bool:
    metric_key(select_by)
    return select_by == "auc"


@dataclass(frozen=True)
class Verdict:
    """One evaluation's outcome: ``improved`` (a new best: keep this checkpoint) and
    ``stop`` (patience ran out)."""

    improved: bool
    stop: bool


class SelectionTracker:
    """Best evaluation so far by ``select_by``, and the patience count.

    ``patience=None`` never stops. ``per_epoch``: the evaluations an epoch has (an epoch
    cut into passes by ``pass_rows`` is evaluated after each); patience then counts
    epochs, ``patience * per_epoch`` evaluations, so a short pass that ends an epoch a
    little worse does not stop a run that still improves epoch over epoch.
    ``min_delta`` is how much better than the best an evaluation must be to count as an
    improvement. A non-finite value never improves.
    """

    def __init__(self, select_by: str = "logloss", patience: int | None = DEFAULT_PATIENCE,
                 min_delta: float = 0.0, task: str | None = None,
                 per_epoch: int = 1) -> None:
        self.key = metric_key(select_by, task)
        self.task = task
        if patience is not None and patience < 1:
            raise ValueError(f"patience {patience}: must be >= 1")
        if per_epoch < 1:
            raise ValueError(f"per_epoch {per_epoch}: must be >= 1")
        if min_delta < 0 or not math.isfinite(min_delta):
            raise ValueError(f"min_delta {min_delta}: must be a finite number >= 0")
        self.select_by = select_by
        self.patience = patience
        self.per_epoch = per_epoch
        self.min_delta = min_delta
        self.maximize = higher_is_better(select_by)
        self.best_value: float | None = None
        self.best_pass: int | None = None  # pass id after which the best was measured
        self.evaluations = 0
        self.since_best = 0

    def is_better(self, value: float) -> bool:
        if not math.isfinite(value):
            return False
        if self.best_value is None:
            return True
        if self.maximize:
            return value > self.best_value + self.min_delta
        return value < self.best_value - self.min_delta

    def update(self, value: float, pass_id: int) -> Verdict:
        """Take the evaluation measured after pass ``pass_id``."""
        self.evaluations += 1
        improved = self.is_better(float(value))
        if improved:
            self.best_value, self.best_pass, self.since_best = float(value), pass_id, 0
        else:
            self.since_best += 1
        return Verdict(improved, self.exhausted)

    @property
    def exhausted(self) -> bool:
        """Patience has run out: true from the stopping evaluation on, so a tracker
        rebuilt from the history of a run killed after it still stops that run."""
        wait = self.wait
        return wait is not None and self.since_best >= wait

    @property
    def wait(self) -> int | None:
        """Evaluations without improvement that stop the run (None: never)."""
        return None if self.patience is None else self.patience * self.per_epoch

    def observe(self, record: dict) -> Verdict:
        """:meth:`update` from a history record (its metric and ``pass_id + 1``, the pass
        count a checkpoint after it carries), writing the verdict into the record."""
        if self.key not in record:
            raise KeyError(f"history record of pass {record.get('pass_id')} has no "
                           f"{self.key}: selection needs a validation set"
                           + (f" and a label {self.task!r}" if self.task else ""))
        verdict = self.update(record[self.key], int(record["pass_id"]) + 1)
        record["best"] = verdict.improved
        return verdict

    @classmethod
    def from_history(cls, history: Sequence[Mapping], select_by: str = "logloss",
                     patience: int | None = DEFAULT_PATIENCE,
                     min_delta: float = 0.0, task: str | None = None,
                     per_epoch: int = 1) -> SelectionTracker:
        """The tracker a run with ``history`` ends with (for resuming it)."""
        tracker = cls(select_by, patience, min_delta, task, per_epoch)
        for record in history:
            if tracker.key in record:
                tracker.update(record[tracker.key], int(record["pass_id"]) + 1)
        return tracker

    def summary(self) -> dict:
        """What metrics.json says about the selection."""
        out = {"select_by": self.select_by, "best_pass": self.best_pass,
               "best_value": self.best_value, "evaluations": self.evaluations,
               "patience": self.patience}
        if self.per_epoch > 1:
            out["evaluations_per_epoch"] = self.per_epoch
        if self.task is not None:
            out["select_task"] = self.task
        return out


def refit_epochs(history: Sequence[Mapping], best_pass: int | None) -> int | None:
    """Epochs to refit for on the training plus validation rows: as many as the selected
    pass (``best_pass``, a pass count as :class:`SelectionTracker` keeps it) had trained.
    None when there is nothing to refit to: no selected pass, or passes that cut epochs
    into parts (``--eval-every``, ``--pass-rows``), where a pass count is not a number of
    epochs."""
    if best_pass is None:
        return None
    epochs = [int(record["epoch"]) for record in history]
    if len(set(epochs)) != len(epochs):  # some epoch took several passes
        return None
    for record in history:
        if int(record["pass_id"]) + 1 == best_pass:
            return int(record["epoch"]) + 1
    return None
