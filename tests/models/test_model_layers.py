"""The interaction layers against their definitions, computed the slow, explicit way."""

from __future__ import annotations

import itertools

import pytest
import torch
from model_helpers import small_config

from terarec.models import build_model
from terarec.models.layers import MLP, CrossNetV2, DotInteraction, concat_dense, fm_pairwise


def test_fm_sum_square_trick_equals_explicit_pairwise_sum() -> None:
    torch.manual_seed(0)
    factors = torch.randn(5, 7, 4, dtype=torch.float64)
    explicit = torch.zeros(5, dtype=torch.float64)
    for i, j in itertools.combinations(range(7), 2):
        explicit += (factors[:, i] * factors[:, j]).sum(dim=1)
    torch.testing.assert_close(fm_pairwise(factors), explicit)


def test_fm_pairwise_ignores_self_products() -> None:
    single = torch.tensor([[[3.0, -2.0]]])
    assert fm_pairwise(single).item() == pytest.approx(0.0)
    two = torch.tensor([[[1.0, 2.0], [3.0, 4.0]]])
    assert fm_pairwise(two).item() == pytest.approx(1 * 3 + 2 * 4)


@pytest.mark.parametrize("num_vectors", [2, 5, 27])
def test_dot_interaction_equals_explicit_upper_triangle(num_vectors: int) -> None:
    torch.manual_seed(1)
    vectors = torch.randn(3, num_vectors, 6, dtype=torch.float64)
    layer = DotInteraction(num_vectors)
    pairs = list(itertools.combinations(range(num_vectors), 2))
    explicit = torch.stack([(vectors[:, i] * vectors[:, j]).sum(dim=1) for i, j in pairs],
                           dim=1)
    assert layer.out_dim == len(pairs)
    torch.testing.assert_close(layer(vectors), explicit)


def test_dot_interaction_index_is_not_saved_in_state_dict() -> None:
    assert DotInteraction(4).state_dict() == {}


def test_cross_layer_equals_formula_on_a_tiny_example() -> None:
    cross = CrossNetV2(dim=2, num_layers=1)
    with torch.no_grad():
        cross.layers[0].weight.copy_(torch.tensor([[1.0, 2.0], [0.0, -1.0]]))
        cross.layers[0].bias.copy_(torch.tensor([0.5, 1.0]))
    x0 = torch.tensor([[2.0, 3.0]])
    # W x0 + b = [1*2 + 2*3 + 0.5, -3 + 1] = [8.5, -2]; x0 * that + x0 = [19, -3]
    torch.testing.assert_close(cross(x0), torch.tensor([[19.0, -3.0]]))


@pytest.mark.parametrize("rank", [0, 3])
def test_stacked_cross_layers_follow_the_recurrence(rank: int) -> None:
    torch.manual_seed(2)
    cross = CrossNetV2(dim=6, num_layers=3, rank=rank).double()
    for p in cross.parameters():  # non-zero biases so the test sees them
        torch.nn.init.normal_(p)
    x0 = torch.randn(4, 6, dtype=torch.float64)
    x = x0
    for layer in cross.layers:
        if rank:
            down, up = layer[0], layer[1]
            w, b = up.weight @ down.weight, up.bias
            assert down.weight.shape == (rank, 6)
        else:
            w, b = layer.weight, layer.bias
        x = x0 * (x @ w.T + b) + x
    torch.testing.assert_close(cross(x0), x)


def test_mlp_widths_activation_and_output_layer() -> None:
    mlp = MLP(5, (8, 4), dropout=0.0, out_dim=1)
    linears = [m for m in mlp if isinstance(m, torch.nn.Linear)]
    assert [(m.in_features, m.out_features) for m in linears] == [(5, 8), (8, 4), (4, 1)]
    assert mlp.out_dim == 1
    assert all(torch.count_nonzero(m.bias) == 0 for m in linears)
    assert isinstance(mlp[-1], torch.nn.Linear)  # the output is not squashed by ReLU
    hidden = MLP(5, (8, 4))
    assert hidden.out_dim == 4
    assert (hidden(torch.randn(10, 5)) >= 0).all()


def test_zero_output_mlp_starts_at_zero_and_learns() -> None:
    torch.manual_seed(4)
    mlp = MLP(5, (8, 4), out_dim=1, zero_output=True)
    x = torch.randn(32, 5)
    assert torch.count_nonzero(mlp(x)) == 0
    hidden = [m for m in mlp if isinstance(m, torch.nn.Linear)][:-1]
    assert all(torch.count_nonzero(m.weight) > 0 for m in hidden)  # Xavier as before
    opt = torch.optim.Adam(mlp.parameters(), lr=0.01)
    for _ in range(2):  # the output layer moves first, then the hidden ones get gradient
        opt.zero_grad()
        ((mlp(x).squeeze(1) - x[:, 0]) ** 2).mean().backward()
        opt.step()
    assert torch.count_nonzero(mlp(x)) > 0
    with pytest.raises(ValueError, match="out_dim"):
        MLP(5, (8,), zero_output=True)


def test_untrained_deepfm_is_its_fm(schema) -> None:
    """DeepFM's deep part starts at zero, so before training it scores as FM does with
    the same rows and first-order weights."""
    torch.manual_seed(5)
    deepfm = build_model(schema, small_config("deepfm", schema))
    fm = build_model(schema, small_config("fm", schema))
    fm.load_state_dict({k: v for k, v in deepfm.state_dict().items()
                        if not k.startswith("deep.")})
    dense = torch.randn(6, deepfm.dense_dim)
    emb = torch.randn(6, deepfm.num_fields, deepfm.row_dim)
    torch.testing.assert_close(deepfm(dense, emb), fm(dense, emb))


def test_mlp_dropout_only_when_training() -> None:
    torch.manual_seed(3)
    mlp = MLP(16, (64,), dropout=0.5)
    x = torch.randn(8, 16)
    mlp.eval()
    torch.testing.assert_close(mlp(x), mlp(x))
    mlp.train()
    assert not torch.equal(mlp(x), mlp(x))


def test_concat_dense_flattens_fields_then_appends_dense() -> None:
    vectors = torch.arange(12.0).view(2, 3, 2)
    dense = torch.tensor([[100.0], [200.0]])
    out = concat_dense(vectors, dense)
    torch.testing.assert_close(out[0], torch.tensor([0.0, 1, 2, 3, 4, 5, 100]))
    torch.testing.assert_close(concat_dense(vectors, dense[:, :0]), vectors.view(2, 6))
