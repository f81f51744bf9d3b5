"""The dense part's optimizer: torch's Adam / Adagrad / SGD, stepped eagerly.

torch.optim wraps ``step`` (and ``zero_grad``, ``add_param_group``, ``state_dict``,
``load_state_dict``) so that ``torch.compile`` breaks its graph around them; the wrappers
import ``torch._dynamo`` on first use, which costs 1.5-2 s of CPU — most of a small
``train`` run's start-up, paid again by every rank and every command that builds a
trainer. terarec never compiles its training step, so the subclasses here call the
wrapped functions directly: same arithmetic, same state, same ``state_dict`` as the torch
class (checkpoints written by either load in the other), no ``torch._dynamo`` import.
Where a torch release no longer wraps a method, ``inspect.unwrap`` returns it as it is.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, ClassVar

import torch

from terarec.config import TrainConfig


def _unwrapped(owner: type, name: str) -> Callable[..., Any]:
    return inspect.unwrap(getattr(owner, name))


class _Eager:
    """Mixin placed before a ``torch.optim.Optimizer`` subclass in the bases."""

    _raw_step: ClassVar[Callable[..., Any]]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        base = next(b for b in cls.__mro__[1:] if issubclass(b, torch.optim.Optimizer))
        cls._raw_step = staticmethod(_unwrapped(base, "step"))

    def step(self, closure: Callable[[], float] | None = None) -> Any:
        with torch.no_grad():  # what torch's wrapper sets (``differentiable`` is off)
            return type(self)._raw_step(self, closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        _unwrapped(torch.optim.Optimizer, "zero_grad")(self, set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        _unwrapped(torch.optim.Optimizer, "add_param_group")(self, param_group)

    def state_dict(self) -> dict[str, Any]:
        return _unwrapped(torch.optim.Optimizer, "state_dict")(self)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        _unwrapped(torch.optim.Optimizer, "load_state_dict")(self, state_dict)


class EagerAdam(_Eager, torch.optim.Adam):
    """``torch.optim.Adam`` without the compile wrappers."""


class EagerAdagrad(_Eager, torch.optim.Adagrad):
    """``torch.optim.Adagrad`` without the compile wrappers."""


class EagerSGD(_Eager, torch.optim.SGD):
    """``torch.optim.SGD`` without the compile wrappers."""


def dense_optimizer(model: torch.nn.Module, config: TrainConfig) -> torch.optim.Optimizer:
    """The dense optimizer ``config.dense_optimizer`` names, over ``model``'s parameters."""
    c = config.dense_optimizer
    params = list(model.parameters())
    if c.name == "adam":
        return EagerAdam(params, lr=c.lr, weight_decay=c.weight_decay)
    if c.name == "adagrad":
        return EagerAdagrad(params, lr=c.lr, weight_decay=c.weight_decay)
    if c.name == "sgd":
        return EagerSGD(params, lr=c.lr, weight_decay=c.weight_decay)
    raise ValueError(f"unknown dense optimizer {c.name!r}; known: adam, adagrad, sgd")
