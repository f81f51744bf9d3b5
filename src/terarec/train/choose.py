"""A default the data decides: one setting among a few (a config key's values, or named
members of several values), chosen by the best validation value each reaches, as
scikit-learn's ``LogisticRegressionCV`` picks C.

One run per member, trained side by side in one pass loop (``train.cohort``): the data is
read, hashed and planned once per pass for all of them, and each run is exactly
``train`` with those values (same initial weights, batches and random stream), so the
chosen member's run reaches what ``train`` then reaches with it. ``train`` chooses
Adagrad's start on small data and the model up to 10^7 rows this way.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from terarec.config import TrainConfig, parse_bytes
from terarec.data.positions import InputFile
from terarec.distributed.context import DistContext, resolve_device
from terarec.train.cohort import KeySides, free_rows, member_config, split_budget
from terarec.train.loop import TrialRun, run_passes
from terarec.train.passes import Pass, iter_scoring_passes
from terarec.train.selection import SelectionTracker
from terarec.train.trainer import Trainer
from terarec.types import Batch, FeatureSchema


@dataclass
class Choice:
    """What ``choose_member`` measured: each member's best validation value."""

    key: str
    chosen: Any
    values: dict[Any, float | None]

    def summary(self) -> dict[str, Any]:
        return {"key": self.key, "chosen": self.chosen,
                "validation": [{"value": v, "best": b} for v, b in self.values.items()]}


def race(schema: FeatureSchema, base: TrainConfig, params: Sequence[Mapping[str, Any]],
         train_paths: Sequence[str | Path | InputFile], valid: list[Pass],
         scratch: str | Path, *, select_by: str, patience: Sequence[int | None],
         ctx: DistContext,
         on_boundary: Callable[[list[TrialRun]], None] | None = None) -> list[TrialRun]:
    """One run per ``params`` (dotted values on ``base``) trained side by side in one
    pass loop on ``valid`` (planned passes), each with its own patience, until each
    stops; ``on_boundary`` may stop more after each pass. Their rows are freed after,
    their histories kept; a tiered store's files go to ``scratch``, removed after.
    Every rank calls this and trains its key shard of every run."""
    scratch = Path(scratch)
    if ctx.is_main:  # a run stopped while choosing left its stores: start them again
        shutil.rmtree(scratch, ignore_errors=True)
    ctx.barrier()
    budget = parse_bytes(base.store.memory_budget) if base.store.memory_budget else None
    keys = KeySides()
    runs = []
    for i, (values, wait) in enumerate(zip(params, patience, strict=True)):
        config = member_config(base, values, scratch / f"choice-{i}", budget, len(params))
        trainer = Trainer(schema, config, ctx=ctx)
        keys.attach(trainer)
        runs.append(TrialRun(trainer, SelectionTracker(select_by, wait),
                             stop_on_divergence=True))
    freed: set[int] = set()

    def free(stopped: bool = True) -> None:
        """Give back the rows of the runs that train no more (``stopped=False``: all)."""
        for i, run in enumerate(runs):
            if (not run.live or not stopped) and i not in freed:
                free_rows(run.trainer)
                freed.add(i)

    def boundary(live: list[TrialRun]) -> None:
        if on_boundary is not None:
            on_boundary(live)
        free()
        split_budget([r.trainer for r in runs if r.live], budget)

    # No try/finally: a rank that fails exits rather than wait for its peers in a
    # barrier; the next run removes what it left.
    run_passes(runs, train_paths, valid, progress=False, on_boundary=boundary)
    free(stopped=False)
    ctx.barrier()
    if ctx.is_main:
        shutil.rmtree(scratch, ignore_errors=True)
    return runs


def choose_member(schema: FeatureSchema, base: TrainConfig,
                  members: Mapping[Any, Mapping[str, Any]],
                  train_paths: Sequence[str | Path | InputFile],
                  valid_batches: list[Batch], scratch: str | Path, *, key: str,
                  select_by: str = "logloss", patience: int | None = 2,
                  ctx: DistContext | None = None,
                  known: Mapping[Any, float | None] | None = None) -> Choice:
    """The name among ``members`` (name -> dotted values on ``base``) whose run reaches
    the best validation value, the first on a tie; ``key`` names what is chosen in the
    summary. ``known``: the values reached by members already trained (not trained
    again). The runs train side by side in one pass loop (``race``)."""
    if not valid_batches:
        raise ValueError(f"choosing {key} by validation needs a validation set")
    ctx = ctx if ctx is not None else DistContext.single(resolve_device(base.device))
    known = known or {}
    trained = [name for name in members if name not in known]
    runs = race(schema, base, [members[name] for name in trained], train_paths,
                list(iter_scoring_passes(ctx, valid_batches, base.pass_rows)), scratch,
                select_by=select_by, patience=[patience] * len(trained), ctx=ctx)
    reached_by = dict(known)
    for name, run in zip(trained, runs, strict=True):
        assert run.selection is not None
        reached_by[name] = run.selection.best_value
    values: dict[Any, float | None] = {}
    best = SelectionTracker(select_by, patience=None)
    chosen: Any = None
    for name in members:
        reached = reached_by[name]
        values[name] = reached
        if reached is not None and best.is_better(reached):
            best.update(reached, 0)  # which pass reached it does not matter here
            chosen = name
    if best.best_value is None:
        raise ValueError(f"choosing {key} by validation: no run reached a finite "
                         "validation value")
    return Choice(key, chosen, values)
