"""What a search tries and how, as one typed value: ``SearchConfig``.

The command line builds it from its flags and Python callers build it directly; both
hand it to ``run_search``, so the two cannot drift. It is checked when made: a bad value
is a ``ValueError`` that names its field, before any data is read.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from terarec.config import TrainConfig
from terarec.train.search.samplers import (
    PRUNERS,
    SAMPLERS,
    PrunerName,
    SamplerName,
)
from terarec.train.search.space import Space, check_space, default_space, grid_space
from terarec.train.selection import SELECT_BY, SelectBy


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class SearchConfig:
    """A search's settings: the trials' base configuration, the space their values come
    from, how many train and how many at once, how they are sampled, pruned and
    selected, and how often they commit.

    ``space`` maps dotted ``TrainConfig`` paths to specs (``space.check_space``); None
    is the default space for ``base``'s model (``space.default_space``). ``fixed``:
    values tried first, in order (e.g. ``base``'s own, so that the search answers at
    least what ``train`` would); the first ``unpruned`` of them train to their own stop,
    never pruned (``train``'s own runs: a slow starter, such as a regularised or linear
    one, is what ``train`` would keep). ``first_rung``: the pass at which the pruner first
    compares trials. ``seed`` seeds the sampler; the trials train from ``base.seed``.
    """

    base: TrainConfig = field(default_factory=TrainConfig)
    space: Mapping[str, Any] | None = None  # path -> spec, or a list of choices
    trials: int = 8
    parallel: int | None = None  # trials trained together in one pass loop; None: all
    sampler: SamplerName = "tpe"
    pruner: PrunerName = "halving"
    first_rung: int = 1
    select_by: SelectBy = "logloss"
    patience: int | None = 2  # epochs of evaluations without improvement; None: never
    # The estimated training rows: how many passes (evaluations) a trial's epoch has, so
    # its patience counts epochs as ``train``'s does. None: one an epoch.
    rows: int | None = None
    seed: int = 0
    fixed: Sequence[Mapping[str, Any]] = ()  # kept as a tuple of dicts
    unpruned: int = 0  # the first this many fixed trials are never pruned
    checkpoint_every: int = 1  # passes between a live trial's commits
    resume: bool = False  # continue the search already in the output directory
    progress: bool = False  # a progress bar on stderr

    def __post_init__(self) -> None:
        if not isinstance(self.base, TrainConfig):
            raise ValueError(f"base: expected a TrainConfig, got {type(self.base).__name__}")
        for name, low in (("trials", 1), ("first_rung", 1), ("checkpoint_every", 1)):
            value = getattr(self, name)
            if not _count(value) or value < low:
                raise ValueError(f"{name} {value!r}: must be an integer >= {low}")
        if self.parallel is not None and (not _count(self.parallel) or self.parallel < 1):
            raise ValueError(f"parallel {self.parallel!r}: must be an integer >= 1 "
                             "(None for all)")
        if self.patience is not None and (not _count(self.patience) or self.patience < 1):
            raise ValueError(f"patience {self.patience!r}: must be an integer >= 1 "
                             "(None: never stop)")
        if self.rows is not None and (not _count(self.rows) or self.rows < 0):
            raise ValueError(f"rows {self.rows!r}: must be an integer >= 0 (None: unknown)")
        if not _count(self.seed) or self.seed < 0:
            raise ValueError(f"seed {self.seed!r}: must be an integer >= 0")
        for name, known in (("sampler", SAMPLERS), ("pruner", PRUNERS),
                            ("select_by", SELECT_BY)):
            if getattr(self, name) not in known:
                raise ValueError(f"{name} {getattr(self, name)!r}: expected one of "
                                 f"{', '.join(known)}")
        for name in ("resume", "progress"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} {getattr(self, name)!r}: must be true or false")
        if self.space is not None:
            # frozen: the checked space (a list of choices made a spec) replaces the given
            given = dict(self.space) if isinstance(self.space, Mapping) else self.space
            object.__setattr__(self, "space", check_space(given, self.base, "space"))
        if self.sampler == "grid":
            try:
                grid_space(self.search_space)
            except ValueError as exc:
                raise ValueError(f"space: {exc}") from None
        fixed = tuple(self.fixed)
        for i, values in enumerate(fixed):
            if not isinstance(values, Mapping):
                raise ValueError(f"fixed[{i}]: expected a mapping of config paths to "
                                 f"values, got {values!r}")
        object.__setattr__(self, "fixed", tuple(dict(v) for v in fixed))
        if not _count(self.unpruned) or not 0 <= self.unpruned <= len(fixed):
            raise ValueError(f"unpruned {self.unpruned!r}: must be an integer from 0 to "
                             f"the {len(fixed)} fixed trials")

    @property
    def search_space(self) -> Space:
        """The space the trials' values come from: ``space``, or the default one."""
        if self.space is None:
            return default_space(self.base.model.name, self.base)
        return {k: dict(v) for k, v in self.space.items()}
