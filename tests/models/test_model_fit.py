"""Each model learns a planted signal: the loss drops clearly within a few hundred steps.

The rows live in an ``nn.Embedding`` trained with the model, standing in for the store.
The signal is a per-user and a per-item effect plus a dense effect, which every model here
can express (the two-tower one through its similarity); the third field is noise.
"""

from __future__ import annotations

import pytest
import torch
from model_helpers import MODEL_NAMES, small_config, tiny_schema

from terarec.models import build_model

NUM_IDS = 20
ROWS = 8192
TRAIN_ROWS = 6144  # the rest is held out: the loss must drop on rows never trained on


def planted_problem(seed: int = 0) -> tuple[torch.Tensor, ...]:
    """ids ``[N, 3]`` (user, item, ctx), dense ``[N, 2]``, labels ``[N]`` and the true
    logits they were drawn from."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, NUM_IDS, (ROWS, 3), generator=gen)
    dense = torch.randn(ROWS, 2, generator=gen)
    user_effect = torch.randn(NUM_IDS, generator=gen) * 2
    item_effect = torch.randn(NUM_IDS, generator=gen) * 2
    logit = user_effect[ids[:, 0]] + item_effect[ids[:, 1]] + 1.5 * dense[:, 0]
    labels = torch.bernoulli(torch.sigmoid(logit), generator=gen)
    return ids, dense, labels, logit


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_model_fits_a_planted_signal(name: str) -> None:
    torch.manual_seed(0)
    schema = tiny_schema()
    ids, dense, labels, true_logit = planted_problem()
    model = build_model(schema, small_config(name, schema))
    table = torch.nn.Embedding(3 * NUM_IDS, model.row_dim)
    torch.nn.init.normal_(table.weight, std=0.01)
    field_offset = torch.arange(3) * NUM_IDS
    opt = torch.optim.Adam([*model.parameters(), *table.parameters()], lr=1e-2)
    bce = torch.nn.functional.binary_cross_entropy_with_logits

    def loss_on(rows: torch.Tensor) -> torch.Tensor:
        return bce(model(dense[rows], table(ids[rows] + field_offset)), labels[rows])

    held_out = torch.arange(TRAIN_ROWS, ROWS)
    with torch.no_grad():
        before = loss_on(held_out).item()
    gen = torch.Generator().manual_seed(1)
    for _ in range(300):
        opt.zero_grad()
        loss_on(torch.randint(0, TRAIN_ROWS, (128,), generator=gen)).backward()
        opt.step()
    model.eval()
    with torch.no_grad():
        after = loss_on(held_out).item()
    best = bce(true_logit[held_out], labels[held_out]).item()  # about 0.39
    report = f"{name}: held-out loss {before:.3f} -> {after:.3f}, best possible {best:.3f}"
    assert after < before - 0.15, report
    assert after < best + 0.1, report
    if name != "dssm":  # a scaled cosine of untrained towers is not centred on 0
        assert before == pytest.approx(0.693, abs=0.05), "should start near chance"
