"""Deep Gradient Compression: warm-up schedule, error feedback, momentum masking."""

from __future__ import annotations

import math

import pytest
import torch

from terarec.config import DenseCommConfig
from terarec.distributed.dense_comm import CommMeter, DGCState, dgc_sparsify


def _state(n: int = 8, **kw) -> DGCState:
    return DGCState(DenseCommConfig(mode="dgc", **kw), world=1, meter=CommMeter(),
                    params=[torch.zeros(n)])


def test_density_decays_from_a_quarter_to_the_ratio_over_warmup():
    state = _state(dgc_ratio=0.001, dgc_warmup_steps=40)
    densities = []
    for step in range(60):
        state.step = step
        densities.append(state.density())
    assert densities[0] == pytest.approx(0.25)
    assert all(a > b for a, b in zip(densities[:40], densities[1:41], strict=True))
    assert densities[40:] == [0.001] * 20
    state = _state(dgc_ratio=0.01, dgc_warmup_steps=0)
    assert state.density() == 0.01


def test_nothing_is_lost_without_momentum_sent_plus_residual_is_the_update_sum():
    torch.manual_seed(0)
    n, total, sent = 2000, torch.zeros(2000), torch.zeros(2000)
    state = _state(n, dgc_ratio=0.01, dgc_momentum=0.0, dgc_warmup_steps=5)
    for step in range(20):
        state.step = step
        update = torch.randn(n)
        total += update
        values, idx = dgc_sparsify(state, update)
        assert values.numel() == math.ceil(n * state.density())
        assert idx.unique().numel() == idx.numel()
        sent.index_add_(0, idx, values)
    residual = state.v
    torch.testing.assert_close(sent + residual, total, rtol=0, atol=1e-4)


def test_top_k_sends_the_largest_accumulated_entries_and_masks_momentum():
    state = _state(dgc_ratio=0.25, dgc_momentum=0.5, dgc_warmup_steps=0)
    update = torch.tensor([0.1, -3.0, 0.2, 2.0, 0.0, 0.05, -0.3, 0.4])
    values, idx = dgc_sparsify(state, update)
    assert sorted(idx.tolist()) == [1, 3]
    torch.testing.assert_close(values[idx.argsort()], torch.tensor([-3.0, 2.0]))
    u, v = state.u, state.v
    assert u[1] == 0 and u[3] == 0 and v[1] == 0 and v[3] == 0  # momentum factor masking
    torch.testing.assert_close(u[[0, 2]], torch.tensor([0.1, 0.2]))
    # Next step: momentum correction accumulates u = 0.5 u + d into the residual.
    dgc_sparsify(state, torch.zeros(8))
    torch.testing.assert_close(v[0], torch.tensor(0.1 + 0.05))


def test_each_parameter_gets_its_share_and_small_ones_are_sent_whole():
    """Top-k per parameter: a layer of small updates is not starved by a larger one; a
    parameter under 1 / ratio entries (a bias) is sent whole, leaving no residual."""
    big, small_updates, bias = torch.zeros(100), torch.zeros(100), torch.zeros(3)
    state = DGCState(DenseCommConfig(mode="dgc", dgc_ratio=0.02, dgc_momentum=0.0,
                                     dgc_warmup_steps=0), 1, CommMeter(),
                     params=[big, small_updates, bias])
    update = torch.cat([torch.linspace(1.0, 2.0, 100), torch.linspace(1e-3, 2e-3, 100),
                        torch.tensor([1e-6, -2e-6, 3e-6])])
    values, idx = dgc_sparsify(state, update)
    assert sorted(idx.tolist()) == [98, 99, 198, 199, 200, 201, 202]
    torch.testing.assert_close(state.v[200:], torch.zeros(3))
    torch.testing.assert_close(state.whole, torch.tensor([200, 201, 202]))
    assert state.v[:98].abs().sum() > 0 and state.v[100:198].abs().sum() > 0


@pytest.mark.parametrize("bad", [dict(mode="zip"), dict(dgc_ratio=0.0), dict(dgc_ratio=2.0),
                                 dict(dgc_momentum=1.0), dict(dgc_warmup_steps=-1)])
def test_config_rejects_bad_values(bad):
    with pytest.raises(ValueError):
        DenseCommConfig(**bad)


@pytest.mark.parametrize("flags, message", [
    (dict(dense_comm="dgc", dgc_ratio=2.0), "--dgc-ratio must be in (0, 1], got 2.0"),
    (dict(dense_comm="dgc", dgc_momentum=1.0), "--dgc-momentum must be in [0, 1), got 1.0"),
    (dict(dense_comm="dgc", dgc_warmup_steps=-1), "--dgc-warmup-steps must be >= 0, got -1"),
    (dict(dense_comm="fp16", dgc_momentum=0.9),
     "--dgc-momentum applies only with --dense-comm dgc (got --dense-comm fp16)")])
def test_dgc_flags_are_checked_naming_the_flag(flags, message):
    """A DGC knob was ignored unless --dense-comm dgc, and a bad one was named by its
    config field: both are refused naming the flag."""
    import argparse

    from terarec.cli.main import UserError
    from terarec.cli.train import dense_comm_from_args

    args = argparse.Namespace(**{"dgc_ratio": None, "dgc_momentum": None,
                                 "dgc_warmup_steps": None, **flags})
    with pytest.raises(UserError) as err:
        dense_comm_from_args(args)
    assert str(err.value) == message


def test_dgc_flags_left_out_take_the_config_defaults():
    import argparse

    from terarec.cli.train import dense_comm_from_args

    args = argparse.Namespace(dense_comm="dgc", dgc_ratio=0.01, dgc_momentum=None,
                              dgc_warmup_steps=None)
    assert dense_comm_from_args(args) == DenseCommConfig(mode="dgc", dgc_ratio=0.01)
