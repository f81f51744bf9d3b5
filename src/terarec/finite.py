"""One check that nothing non-finite leaves the process: checkpoints, exports, responses.

A NaN or an infinity in a weight spreads to every score it touches, so an artifact that
holds one is refused before any byte of it is written, and the caller is told which
tensor (and how many of its entries) went bad.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch


class NonFiniteError(ValueError):
    """A tensor, a loss or a score holds NaN or an infinity."""


def _bad_count(value: torch.Tensor | np.ndarray) -> int:
    if isinstance(value, torch.Tensor):
        if not value.is_floating_point():
            return 0
        return int((~torch.isfinite(value.detach())).sum())
    array = np.asarray(value)
    if not np.issubdtype(array.dtype, np.floating):
        return 0
    return int(array.size - np.count_nonzero(np.isfinite(array)))


def check_finite(tensors: Mapping[str, torch.Tensor | np.ndarray], what: str) -> None:
    """Raise ``NonFiniteError`` naming ``what`` and each tensor holding NaN/inf entries."""
    bad = {name: n for name, v in tensors.items() if (n := _bad_count(v))}
    if bad:
        listed = ", ".join(f"{name} ({n} entries)" for name, n in sorted(bad.items()))
        raise NonFiniteError(f"{what}: not finite, refusing to write it: {listed}. "
                             "Training diverged: lower the learning rates or check the input "
                             "values (numeric columns are normalised unless told otherwise)")


def check_finite_loss(loss: float, where: str) -> None:
    """A non-finite training loss means every later weight is poisoned: stop now."""
    if not np.isfinite(loss):
        raise NonFiniteError(f"{where}: training loss is {loss}; training stopped before "
                             "writing a checkpoint. Lower the learning rates or check the "
                             "input values")


def check_trainer_finite(trainer: Any) -> None:
    """The dense weights and the in-memory embedding rows of ``trainer`` are finite (a
    tiered store's disk rows were finite when they left RAM: this checks what is held)."""
    check_finite(dict(trainer.model.state_dict()), f"pass {trainer.pass_id} dense weights")
    store = trainer.store
    values = getattr(store, "values", None)
    index = getattr(store, "index", None)
    if isinstance(values, np.ndarray) and index is not None:
        # First every slot in use so far, read in place (30x faster than gathering the
        # live ones); only if that finds a bad entry, which may sit in a freed slot, are
        # the live rows gathered and counted.
        if np.isfinite(values[:index.slot_bound]).all():
            return
        _, slots = index.items()
        check_finite({"embedding rows": values[slots]}, f"pass {trainer.pass_id} store")


def check_model_scores(probs: np.ndarray, where: str) -> None:
    """Finite weights can still overflow in the forward pass (learning rates far too
    high): such a model's metrics and scores are NaN, so scoring stops instead."""
    bad = _bad_count(probs)
    if bad:
        raise NonFiniteError(f"{where}: {bad} of {len(probs)} scores are not finite (the "
                             "weights overflow the network): training diverged; lower the "
                             "learning rates or check the input values")


def check_scores(scores: np.ndarray | torch.Tensor) -> None:
    """A response never carries NaN (JSON ``null``) as a score."""
    check_finite({"scores": scores}, "model output")
