"""How a search picks and stops trials: optuna's samplers and pruners by name.

The pruners are asked at pass boundaries, where every live trial has trained the same
passes: successive halving and hyperband compare trials of one wave; median compares
with finished trials (earlier waves).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal, get_args

from terarec.config import TrainConfig
from terarec.train.search.space import grid_space

if TYPE_CHECKING:
    from optuna.pruners import BasePruner
    from optuna.samplers import BaseSampler

SamplerName = Literal["random", "tpe", "grid"]
PrunerName = Literal["none", "halving", "median", "hyperband"]

SAMPLERS: tuple[str, ...] = get_args(SamplerName)
PRUNERS: tuple[str, ...] = get_args(PrunerName)


def make_sampler(name: str, space: Mapping[str, Mapping[str, Any]], seed: int
                 ) -> BaseSampler:
    """optuna's sampler ``name`` (``SAMPLERS``) over ``space``, drawing from ``seed``."""
    import optuna

    if name == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    if name == "tpe":
        return optuna.samplers.TPESampler(seed=seed)
    if name == "grid":
        return optuna.samplers.GridSampler(grid_space(space), seed=seed)
    raise ValueError(f"sampler {name!r}: expected one of {', '.join(SAMPLERS)}")


# The pruners first compare trials after this many optimizer steps: on small data one
# pass is an epoch of about 30 steps, which shows how fast a trial starts rather than
# where it ends (a trial with Adagrad's damped start always lost there).
FIRST_RUNG_STEPS = 100


def first_rung(rows: int | None, config: TrainConfig) -> int:
    """The pass at which the pruners first compare trials: enough passes for
    ``FIRST_RUNG_STEPS`` steps of ``config``'s batch on ``rows`` training rows (a pass is
    ``pass_rows`` rows, or the epoch when shorter); 1 when ``rows`` is unknown."""
    if rows is None or rows < 1:
        return 1
    per_pass = max(1, math.ceil(min(rows, config.pass_rows) / config.batch_size))
    return max(1, math.ceil(FIRST_RUNG_STEPS / per_pass))


def make_pruner(name: str, first: int = 1) -> BasePruner:
    """Pruners that work while trials train together: successive halving and hyperband
    compare trials that reached the same pass, first at pass ``first`` (``first_rung``);
    median needs finished trials (earlier waves, ``parallel`` < ``trials``) and prunes
    from pass ``first`` on."""
    import optuna

    if first < 1:
        raise ValueError(f"first rung (--prune-after) {first}: must be >= 1")
    if name == "none":
        return optuna.pruners.NopPruner()
    if name == "halving":
        return optuna.pruners.SuccessiveHalvingPruner(min_resource=first, reduction_factor=3)
    if name == "median":
        return optuna.pruners.MedianPruner(n_startup_trials=1, n_warmup_steps=first - 1)
    if name == "hyperband":
        return optuna.pruners.HyperbandPruner(min_resource=first, reduction_factor=3)
    raise ValueError(f"pruner {name!r}: expected one of {', '.join(PRUNERS)}")
