"""Settings the data decides: a small built-in portfolio raced on the validation rows.

The data-sized defaults (``train.defaults``) are one guess for every data set; how
fast a model converges within its epoch budget, how fast its deep part should learn and
how much it should be held back differ between data sets. So where ``train`` has
validation rows, a few alternatives (``portfolio``) race the default::

    1. the default trains alone, as its run would, to its patience stop: d passes (a
       member that only waits longer is that run trained on, ``_first_run``)
    2. the challengers train side by side (``train.choose.race``, one pass loop), with
       (budget - 1) * d passes between them: successive halving keeps the better half
       by the selection metric at each rung, and a challenger stops once the next pass
       would overrun the budget
    3. the challenger with the best validation AUC (at its selected pass) replaces the
       default only when it beats the default's by more than that AUC's standard error
       (Hanley & McNeil), so selection noise does not trade a default for a setting
       that was lucky on the validation rows

The race costs at most ``budget`` times the default's passes (measured, not assumed,
and recorded with the time taken); the chosen setting is then trained as an ordinary
run. What each member is for: docs/training.md, "Settings chosen by validation".
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from terarec.config import TrainConfig, read_only_by
from terarec.data.positions import InputFile
from terarec.distributed.context import DistContext
from terarec.train.choose import race
from terarec.train.cohort import apply_params
from terarec.train.defaults import max_epochs
from terarec.train.loop import TrialRun
from terarec.train.passes import iter_scoring_passes
from terarec.train.selection import STOP_PRUNED, SelectionTracker
from terarec.types import Batch, FeatureSchema

# The race's compute, in passes trained, as a multiple of the default run's passes.
DEFAULT_BUDGET = 3.0
DEFAULT_NAME = "default"
RULE = ("a challenger replaces the default when its validation AUC beats the default's "
        "by more than that AUC's standard error; the best such challenger wins")


@dataclass(frozen=True)
class Member:
    """One setting of the portfolio: dotted config values on the sized default, and
    the patience its selection uses (None: the run's)."""

    name: str
    params: dict[str, Any]
    patience: int | None = None
    why: str = ""


@dataclass
class Candidate:
    """What one member reached: passes trained, best pass and its validation figures."""

    member: Member
    passes: int = 0
    best_pass: int | None = None
    best_value: float | None = None
    valid_auc: float | None = None
    valid_logloss: float | None = None
    stop_reason: str | None = None

    def summary(self) -> dict[str, Any]:
        return {"name": self.member.name, "params": self.member.params,
                "patience": self.member.patience, "why": self.member.why,
                "passes": self.passes, "best_pass": self.best_pass,
                "best_value": self.best_value, "valid_auc": self.valid_auc,
                "valid_logloss": self.valid_logloss, "stop_reason": self.stop_reason}


@dataclass
class PortfolioChoice:
    """The race's outcome: every candidate, the budget and what it used, the choice."""

    candidates: list[Candidate]
    chosen: Candidate
    auc_standard_error: float | None
    budget: float
    passes: int
    default_passes: int
    seconds: float
    rule: str
    valid_rows: int = 0
    notes: list[str] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        used = self.passes / self.default_passes if self.default_passes else 0.0
        return {"chosen": self.chosen.member.name, "params": self.chosen.member.params,
                "patience": self.chosen.member.patience, "rule": self.rule,
                "valid_rows": self.valid_rows,
                "auc_standard_error": self.auc_standard_error,
                "budget": {"limit_x_default_run": self.budget, "passes": self.passes,
                           "default_passes": self.default_passes,
                           "used_x_default_run": round(used, 4),
                           "seconds": round(self.seconds, 3)},
                "candidates": [c.summary() for c in self.candidates],
                **({"notes": self.notes} if self.notes else {})}


def portfolio(config: TrainConfig, given: set[str], patience: int,
              rows: int | None) -> list[Member]:
    """The members raced against the default (``config``, the sized one), those that
    set no key in ``given`` (a value the user gave is not the data's to choose) and
    change the model trained. Each one fixes a way the default under- or over-trains
    on some data: a sparse rate too low for its epoch budget, a deep part too slow, a
    patience too short, too few steps' worth of signal per batch, too narrow or too
    free a network."""
    sparse, dense = config.sparse_optimizer.lr, config.dense_optimizer.lr
    batch = config.batch_size
    name = config.model.name
    members = [
        Member("sparse-x3", {"sparse_optimizer.lr": sparse * 3},
               why="a sparse rate that converges within the epoch budget"),
        Member("deep-x8", {"dense_optimizer.lr": dense * 8},
               why="a faster dense / deep part (DeepFM's starts at 1/8 of the rate)"),
        Member("fast", {"sparse_optimizer.lr": sparse * 3, "dense_optimizer.lr": dense * 8},
               why="both rates raised together"),
        Member("patience-x3", {}, patience=patience * 3,
               why="a slow model that needs more evaluations to show its gain"),
        Member("batch-x4", {"batch_size": batch * 4, "sparse_optimizer.lr": sparse * 2,
                            "dense_optimizer.lr": dense * 2},
               why="larger batches at the square-root-scaled rate: less gradient noise"),
        Member("wide", {"model.embedding_dim": config.model.embedding_dim * 2},
               why="a wider embedding for data with more interaction signal"),
    ]
    if config.store.admit_min_count > 1 and config.store.admit_probability is None:
        members.append(Member("admit-all", {"store.admit_min_count": 1},
                              why="a row for every key, as one-hot regression has"))
    if name in (read_only_by("model.dropout") or ()):  # the models with an MLP
        members.append(Member("dropout", {"model.dropout": 0.2},
                              why="a deep part held back where it overfits"))
    out = [Member(DEFAULT_NAME, {}, why="the data-sized default")]
    for member in members:
        keys = set(member.params) | ({"patience"} if member.patience else set())
        if keys & given:
            continue
        params = dict(member.params)
        if "epochs" not in given and (member.patience or "batch_size" in params):
            # the epoch upper bound follows the member's batch size and patience
            params["epochs"] = max_epochs(rows, int(params.get("batch_size", batch))) \
                + (member.patience or patience)
        if params and apply_params(config, params) == config and member.patience is None:
            continue  # the same model as the default's (a width an LR does not read)
        out.append(Member(member.name, params, member.patience, member.why))
    return out


def auc_standard_error(auc: float, positives: int, negatives: int) -> float:
    """The standard error of an AUC measured on ``positives`` and ``negatives`` rows
    (Hanley & McNeil, 1982)."""
    if positives < 1 or negatives < 1:
        return math.inf
    q1, q2 = auc / (2 - auc), 2 * auc * auc / (1 + auc)
    var = (auc * (1 - auc) + (positives - 1) * (q1 - auc * auc)
           + (negatives - 1) * (q2 - auc * auc)) / (positives * negatives)
    return math.sqrt(max(var, 0.0))


def rungs(challengers: int, budget_passes: int) -> list[int]:
    """Successive halving's rungs (pass counts where the better half of the live
    challengers goes on): one round per halving, each round's share of the budget split
    evenly among the challengers it starts with."""
    rounds = max(1, math.ceil(math.log2(max(challengers, 2))))
    out, live, at = [], challengers, 0
    for _ in range(rounds):
        at += max(1, budget_passes // (rounds * live))
        out.append(at)
        live = math.ceil(live / 2)
    return out


def _candidate(member: Member, run: TrialRun) -> Candidate:
    history = run.trainer.history
    best = [r for r in history if r.get("best")]
    record = best[-1] if best else {}
    assert run.selection is not None
    return Candidate(member, passes=len(history), best_pass=run.selection.best_pass,
                     best_value=run.selection.best_value,
                     valid_auc=record.get("valid_auc"),
                     valid_logloss=record.get("valid_logloss"),
                     stop_reason=run.stop_reason)


def choose_settings(schema: FeatureSchema, config: TrainConfig, members: Sequence[Member],
                    train_paths: Sequence[str | Path | InputFile],
                    valid_batches: list[Batch], scratch: str | Path, *, select_by: str,
                    patience: int, ctx: DistContext,
                    budget: float = DEFAULT_BUDGET) -> PortfolioChoice:
    """Race ``members`` (the first is the default) on the validation batches within
    ``budget`` times the default's passes, and keep the default unless a challenger's
    validation AUC beats it by more than its standard error. Every rank calls this."""
    if not valid_batches:
        raise ValueError("choosing settings by validation needs a validation set")
    if budget < 1:
        raise ValueError(f"choosing budget {budget}: must be >= 1 (the default's run)")
    start = time.perf_counter()
    valid = list(iter_scoring_passes(ctx, valid_batches, config.pass_rows))
    scratch = Path(scratch)
    default, *challengers = members
    # A member that only waits longer trains what the default does up to its stop: it
    # is the default's run trained on (``_first_run``), not raced from the start.
    longer = next((m for m in challengers if m.patience and set(m.params) <= {"epochs"}),
                  None)
    challengers = [m for m in challengers if m is not longer]
    candidates, d, first_passes = _first_run(
        schema, config, default, longer, train_paths, valid, scratch, select_by=select_by,
        patience=patience, ctx=ctx, budget=budget)
    allowed = int(budget * d) - first_passes
    spent = first_passes - d
    if challengers and allowed >= len(challengers):
        marks = rungs(len(challengers), allowed)
        tracker = SelectionTracker(select_by, patience=None)
        counted: list[int] = [0]

        def boundary(live: list[TrialRun]) -> None:
            """Count the pass just trained; halve at a rung; stop what would overrun."""
            counted[0] += len(live)
            trained = max(len(r.trainer.history) for r in live)
            ranked = sorted(live, key=lambda r: _rank(r, tracker))
            if trained in marks[:-1]:
                for run in ranked[math.ceil(len(ranked) / 2):]:
                    run.stop(STOP_PRUNED)
                ranked = ranked[:math.ceil(len(ranked) / 2)]
            still = [r for r in ranked if r.live]
            while still and counted[0] + len(still) > allowed:
                still.pop().stop(STOP_PRUNED)

        runs = race(schema, config, [m.params for m in challengers], train_paths, valid,
                    scratch, select_by=select_by,
                    patience=[m.patience or patience for m in challengers], ctx=ctx,
                    on_boundary=boundary)
        candidates += [_candidate(m, r) for m, r in zip(challengers, runs, strict=True)]
        spent += counted[0]
    positives = int(sum(float(b.labels.sum()) for b in valid_batches) + 0.5)
    rows = sum(len(b) for b in valid_batches)
    chosen, se = pick(candidates, positives, rows - positives)
    notes = [f"no challenger raced: the default trained {d} pass(es), leaving "
             f"{allowed} for {len(challengers)} challenger(s)"] \
        if challengers and allowed < len(challengers) else []
    return PortfolioChoice(candidates, chosen, se, budget, d + spent, d,
                           time.perf_counter() - start,
                           rule=RULE,
                           valid_rows=rows, notes=notes)


def pick(candidates: Sequence[Candidate], positives: int, negatives: int
         ) -> tuple[Candidate, float | None]:
    """``RULE``: the first candidate (the default) unless another's validation AUC is
    above the default's plus its standard error (on ``positives`` and ``negatives``
    validation rows); the best of those that are. Returns it and the standard error."""
    default = candidates[0]
    if default.valid_auc is None or not math.isfinite(default.valid_auc):
        se = None
        bar = -math.inf  # a default with no finite AUC: any finite challenger beats it
    else:
        se = auc_standard_error(default.valid_auc, positives, negatives)
        bar = default.valid_auc + se
    chosen = default
    for c in candidates[1:]:
        auc = c.valid_auc
        if auc is None or not math.isfinite(auc) or auc <= bar:
            continue
        if chosen is default or auc > (chosen.valid_auc or -math.inf):
            chosen = c
    return chosen, se


def _first_run(schema: FeatureSchema, config: TrainConfig, default: Member,
               longer: Member | None, train_paths: Sequence[str | Path | InputFile],
               valid: list, scratch: Path, *, select_by: str, patience: int,
               ctx: DistContext, budget: float) -> tuple[list[Candidate], int, int]:
    """The default's run, alone, to its stop: its candidate, its passes (d) and the
    passes trained. With ``longer`` (a member that only waits longer) the run goes on
    under its patience and epoch bound, up to half the challengers' budget past d,
    while a second tracker with the default's patience says where the default stops."""
    wait = default.patience or patience
    if longer is None:
        (run,) = race(schema, config, [default.params], train_paths, valid, scratch,
                      select_by=select_by, patience=[wait], ctx=ctx)
        candidate = _candidate(default, run)
        return [candidate], candidate.passes, candidate.passes
    shadow = SelectionTracker(select_by, wait)
    stop: list[int | None] = [None]  # the default's passes, once it has stopped
    reason: list[str | None] = [None]
    cap: list[int | None] = [None]

    def watch(live: list[TrialRun]) -> None:
        (run,) = live
        history = run.trainer.history
        record = history[-1]
        if stop[0] is None and int(record["epoch"]) >= config.epochs:
            stop[0], reason[0] = len(history) - 1, "epochs_exhausted"  # not its pass
        elif stop[0] is None:
            shadow.update(record[shadow.key], int(record["pass_id"]) + 1)
            if shadow.exhausted:
                stop[0], reason[0] = len(history), "patience"
        if stop[0] is not None and cap[0] is None:
            cap[0] = stop[0] + int((budget - 1) * stop[0]) // 2
        if cap[0] is not None and len(history) >= cap[0]:
            run.stop(STOP_PRUNED)

    (run,) = race(schema, config, [{**default.params, **longer.params}], train_paths, valid,
                  scratch, select_by=select_by, patience=[longer.patience or wait],
                  ctx=ctx, on_boundary=watch)
    history = run.trainer.history
    d = stop[0] if stop[0] is not None else len(history)
    if stop[0] is None:  # both ended together (the data ran out of epochs)
        shadow = SelectionTracker.from_history(history, select_by, wait)
    best = next((r for r in history if int(r["pass_id"]) + 1 == shadow.best_pass), {})
    first = Candidate(default, passes=d, best_pass=shadow.best_pass,
                      best_value=shadow.best_value, valid_auc=best.get("valid_auc"),
                      valid_logloss=best.get("valid_logloss"),
                      stop_reason=reason[0] or run.stop_reason)
    return [first, _candidate(longer, run)], d, len(history)


def _rank(run: TrialRun, tracker: SelectionTracker) -> tuple[int, float]:
    """Sort key, best first: the run's best validation value by the selection metric."""
    value = run.selection.best_value if run.selection is not None else None
    if value is None or not math.isfinite(value):
        return (1, 0.0)
    return (0, -value if tracker.maximize else value)


def chosen_config(config: TrainConfig, choice: PortfolioChoice) -> TrainConfig:
    """``config`` with the chosen member's values."""
    return apply_params(config, choice.chosen.member.params)
