"""The eager dense optimizers: torch's arithmetic and state, without torch._dynamo."""

from __future__ import annotations

import copy
import subprocess
import sys
import textwrap

import pytest
import torch

from terarec.config import DenseOptimizerConfig, TrainConfig
from terarec.train.dense_optimizer import dense_optimizer

TORCH = {"adam": torch.optim.Adam, "adagrad": torch.optim.Adagrad, "sgd": torch.optim.SGD}


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))


def _steps(model: torch.nn.Module, opt: torch.optim.Optimizer, n: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(n):
        opt.zero_grad(set_to_none=True)
        model(torch.randn(8, 6, generator=gen)).square().mean().backward()
        opt.step()


@pytest.mark.parametrize("name", sorted(TORCH))
def test_same_steps_and_state_as_torch(name: str) -> None:
    config = TrainConfig(dense_optimizer=DenseOptimizerConfig(name=name, lr=0.05,
                                                              weight_decay=0.01))
    ours, theirs = _model(), _model()
    opt = dense_optimizer(ours, config)
    ref = TORCH[name](theirs.parameters(), lr=0.05, weight_decay=0.01)
    assert isinstance(opt, TORCH[name])
    _steps(ours, opt, 5, seed=1)
    _steps(theirs, ref, 5, seed=1)
    for a, b in zip(ours.parameters(), theirs.parameters(), strict=True):
        assert torch.equal(a, b)
    # State written by either class loads in the other and trains on alike.
    # (deep copies: a loaded state shares the tensors it was given)
    mine, yours = copy.deepcopy(opt.state_dict()), copy.deepcopy(ref.state_dict())
    opt.load_state_dict(yours)
    ref.load_state_dict(mine)
    _steps(ours, opt, 3, seed=2)
    _steps(theirs, ref, 3, seed=2)
    for a, b in zip(ours.parameters(), theirs.parameters(), strict=True):
        assert torch.equal(a, b)
    assert not any(p.grad is not None and p.grad.requires_grad for p in ours.parameters())


def test_no_dynamo_import() -> None:
    """Building, stepping and checkpointing the dense optimizer leaves torch._dynamo
    unimported (its import is 1.5-2 s of every run's start-up)."""
    code = textwrap.dedent("""
        import sys, torch
        from terarec.config import TrainConfig
        from terarec.train.dense_optimizer import dense_optimizer
        model = torch.nn.Linear(3, 1)
        opt = dense_optimizer(model, TrainConfig())
        model(torch.ones(2, 3)).sum().backward()
        opt.step(); opt.zero_grad(); opt.load_state_dict(opt.state_dict())
        print("torch._dynamo" in sys.modules)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "False"
