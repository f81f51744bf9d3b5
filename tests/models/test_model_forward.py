"""Every model's forward and backward, and each model's logit against its formula."""

from __future__ import annotations

import itertools

import pytest
import torch
from model_helpers import MODEL_NAMES, as_trained, small_config, tiny_schema

from terarec.models import DLRM, DSSM, FM, LR, DCNv2, DeepFM, WideDeep, build_model
from terarec.types import FeatureSchema


def random_inputs(model, batch: int = 6, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    dense = torch.randn(batch, model.dense_dim, generator=gen)
    emb = torch.randn(batch, model.num_fields, model.row_dim, generator=gen) * 0.5
    return dense, emb.requires_grad_()


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_forward_shape_and_gradients_reach_emb_and_every_parameter(
        name: str, schema: FeatureSchema) -> None:
    torch.manual_seed(0)
    model = as_trained(build_model(schema, small_config(name, schema)))
    dense, emb = random_inputs(model)
    logits = model(dense, emb)
    assert logits.shape == (6,)
    assert logits.dtype == torch.float32
    assert torch.isfinite(logits).all()
    torch.nn.functional.binary_cross_entropy_with_logits(
        logits, torch.tensor([0.0, 1, 0, 1, 1, 0])).backward()
    assert emb.grad is not None and emb.grad.shape == emb.shape
    used = (model.user_index.tolist() + model.item_index.tolist()
            if name == "dssm" else range(model.num_fields))
    for f in used:
        assert emb.grad[:, f].abs().sum() > 0, f"no gradient reached field {f}"
    for pname, param in model.named_parameters():
        assert param.grad is not None, f"{name}.{pname} got no gradient"
        assert param.grad.abs().sum() > 0, f"{name}.{pname} got an all-zero gradient"


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_row_dim_matches_the_layout(name: str) -> None:
    schema = tiny_schema()
    model = build_model(schema, small_config(name, schema, embedding_dim=5,
                                             bottom_mlp=(16, 5)))
    expected = {"lr": 1, "fm": 6, "widedeep": 6, "deepfm": 6, "dcnv2": 5, "dlrm": 5,
                "dssm": 5}[name]
    assert model.row_dim == expected


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_samples_are_scored_independently(name: str) -> None:
    """Scoring a batch equals scoring each sample alone (no cross-sample leakage)."""
    schema = tiny_schema()
    model = build_model(schema, small_config(name, schema)).eval()
    dense, emb = random_inputs(model, batch=5)
    with torch.no_grad():
        whole = model(dense, emb)
        alone = torch.cat([model(dense[i:i + 1], emb[i:i + 1]) for i in range(5)])
    torch.testing.assert_close(whole, alone, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_wrong_input_shapes_are_named(name: str) -> None:
    schema = tiny_schema()
    model = build_model(schema, small_config(name, schema))
    dense, emb = random_inputs(model)
    with pytest.raises(ValueError, match=r"emb must be \[B, 3, "):
        model(dense, emb[:, :2])
    with pytest.raises(ValueError, match=r"emb must be"):
        model(dense, torch.zeros(6, 3, model.row_dim + 1))
    with pytest.raises(ValueError, match=r"dense must be \[6, 2\]"):
        model(dense[:, :1], emb)


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_schema_without_numeric_fields(name: str) -> None:
    schema = FeatureSchema(label="y", fields=tiny_schema().categorical)
    assert schema.dense_dim == 0
    model = build_model(schema, small_config(name, schema))
    dense, emb = random_inputs(model)
    model(dense, emb).sum().backward()
    assert emb.grad.abs().sum() > 0


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_schema_without_categorical_fields_is_rejected(name: str) -> None:
    schema = FeatureSchema(label="y", fields=tiny_schema().numeric)
    with pytest.raises(ValueError, match="at least one categorical field"):
        build_model(schema, small_config(name, schema, user_fields=("x1",)))


def test_lr_logit_is_bias_plus_key_weights_plus_dense_linear() -> None:
    schema = tiny_schema()
    model = LR(schema, small_config("lr", schema))
    with torch.no_grad():
        model.bias.fill_(0.25)
        model.dense_linear.weight.copy_(torch.tensor([[2.0, -1.0]]))
    emb = torch.tensor([[[0.5], [-1.0], [3.0]], [[0.0], [0.0], [0.0]]])
    dense = torch.tensor([[1.0, 4.0], [0.5, 0.0]])
    # sample 0: 0.25 + (0.5 - 1 + 3) + (2*1 - 1*4) = 0.75; sample 1: 0.25 + 0 + 1 = 1.25
    torch.testing.assert_close(model(dense, emb), torch.tensor([0.75, 1.25]))


def test_fm_logit_is_linear_part_plus_explicit_pairwise_factor_products() -> None:
    torch.manual_seed(4)
    schema = tiny_schema()
    model = FM(schema, small_config("fm", schema, embedding_dim=3)).double()
    with torch.no_grad():
        model.bias.fill_(-0.3)
        model.dense_linear.weight.normal_()
    dense = torch.randn(4, 2, dtype=torch.float64)
    emb = torch.randn(4, 3, 4, dtype=torch.float64)
    expected = -0.3 + emb[:, :, 0].sum(1) + dense @ model.dense_linear.weight[0]
    for i, j in itertools.combinations(range(3), 2):
        expected = expected + (emb[:, i, 1:] * emb[:, j, 1:]).sum(1)
    torch.testing.assert_close(model(dense, emb), expected)


def test_deepfm_is_fm_plus_deep_over_factors_and_dense() -> None:
    torch.manual_seed(5)
    schema = tiny_schema()
    config = small_config("deepfm", schema)
    deepfm = DeepFM(schema, config)
    fm = FM(schema, config)
    fm.load_state_dict({k: v for k, v in deepfm.state_dict().items() if k in fm.state_dict()})
    dense, emb = random_inputs(deepfm)
    deep_in = torch.cat([emb[:, :, 1:].reshape(6, -1), dense], dim=1)
    expected = fm(dense, emb) + deepfm.deep(deep_in).squeeze(1)
    torch.testing.assert_close(deepfm(dense, emb), expected)


def test_widedeep_sums_wide_and_deep_parts() -> None:
    torch.manual_seed(6)
    schema = tiny_schema()
    model = WideDeep(schema, small_config("widedeep", schema))
    with torch.no_grad():
        model.dense_linear.weight.normal_()
    dense, emb = random_inputs(model)
    wide = model.bias + emb[:, :, 0].sum(1) + dense @ model.dense_linear.weight[0]
    deep = model.deep(torch.cat([emb[:, :, 1:].reshape(6, -1), dense], dim=1)).squeeze(1)
    torch.testing.assert_close(model(dense, emb), wide + deep)


def test_dcnv2_feeds_embeddings_and_dense_as_x0_through_cross_then_deep() -> None:
    torch.manual_seed(7)
    schema = tiny_schema()
    model = DCNv2(schema, small_config("dcnv2", schema, cross_layers=3))
    assert len(model.cross.layers) == 3
    dense, emb = random_inputs(model)
    x0 = torch.cat([emb.reshape(6, -1), dense], dim=1)
    torch.testing.assert_close(model(dense, emb), model.deep(model.cross(x0)).squeeze(1))
    low = DCNv2(schema, small_config("dcnv2", schema, cross_rank=4))
    assert low.cross.layers[0][0].weight.shape == (4, x0.shape[1])


def test_dlrm_concatenates_bottom_output_with_pairwise_dots_for_the_top_mlp() -> None:
    torch.manual_seed(8)
    schema = tiny_schema()
    model = DLRM(schema, small_config("dlrm", schema))
    dense, emb = random_inputs(model)
    z = model.bottom(dense)
    vectors = [z] + [emb[:, f] for f in range(3)]
    dots = [(vectors[i] * vectors[j]).sum(1) for i, j in itertools.combinations(range(4), 2)]
    top_in = torch.cat([z, torch.stack(dots, dim=1)], dim=1)
    assert top_in.shape == (6, 8 + 6)
    torch.testing.assert_close(model(dense, emb), model.top(top_in).squeeze(1))


def test_dssm_logit_is_scaled_cosine_of_the_tower_outputs_plus_bias() -> None:
    torch.manual_seed(9)
    schema = tiny_schema()
    model = DSSM(schema, small_config("dssm", schema, user_fields=("ctx", "user"),
                                      cosine_scale=7.0))
    assert model.user_fields == ("ctx", "user") and model.item_fields == ("item",)
    dense, emb = random_inputs(model)
    user = model.user_tower(torch.cat([emb[:, 2], emb[:, 0], dense], dim=1))
    item = model.item_tower(emb[:, 1])
    cosine = torch.nn.functional.cosine_similarity(user, item, dim=1)
    torch.testing.assert_close(model(dense, emb), 7.0 * cosine + model.bias, rtol=1e-5,
                               atol=1e-5)
    u = model.user_embedding(dense, emb[:, [2, 0]])
    v = model.item_embedding(emb[:, [1]])
    torch.testing.assert_close(u.norm(dim=1), torch.ones(6))
    torch.testing.assert_close(model(dense, emb), 7.0 * (u * v).sum(1) + model.bias)


def test_dssm_dot_similarity_uses_raw_tower_outputs() -> None:
    torch.manual_seed(10)
    schema = tiny_schema()
    model = DSSM(schema, small_config("dssm", schema, tower_similarity="dot",
                                      user_fields=("user",), item_fields=("item",)))
    dense, emb = random_inputs(model)
    u = model.user_tower(torch.cat([emb[:, 0], dense], dim=1))
    v = model.item_tower(emb[:, 1])
    torch.testing.assert_close(model(dense, emb), (u * v).sum(1) + model.bias)
    # "ctx" is in neither tower, so it cannot change the score
    emb2 = emb.detach().clone()
    emb2[:, 2] += 5.0
    torch.testing.assert_close(model(dense, emb2), model(dense, emb))


def test_dssm_item_vectors_rank_items_as_the_model_scores_them() -> None:
    """Retrieval: precomputed item vectors and one user vector reproduce forward's order."""
    torch.manual_seed(11)
    schema = tiny_schema()
    model = DSSM(schema, small_config("dssm", schema, user_fields=("user", "ctx"))).eval()
    items = torch.randn(20, 1, 8)
    user_rows, dense = torch.randn(1, 2, 8), torch.randn(1, 2)
    with torch.no_grad():
        scores = model.item_embedding(items) @ model.user_embedding(dense, user_rows)[0]
        emb = torch.empty(20, 3, 8)
        emb[:, 0], emb[:, 2], emb[:, 1] = user_rows[0, 0], user_rows[0, 1], items[:, 0]
        logits = model(dense.expand(20, 2), emb)
    torch.testing.assert_close(logits, model.scale * scores + model.bias)
    assert torch.equal(scores.argsort(), logits.argsort())


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_torch_export_with_a_dynamic_batch_matches_eager(name: str) -> None:
    """Serving may run an exported graph: it must hold for batch sizes other than the
    example's, with the index buffers captured."""
    schema = tiny_schema()
    model = build_model(schema, small_config(name, schema)).eval()
    dense, emb = random_inputs(model, batch=4)
    batch = torch.export.Dim("batch")
    exported = torch.export.export(model, (dense, emb.detach()),
                                   dynamic_shapes=({0: batch}, {0: batch}))
    dense, emb = random_inputs(model, batch=9, seed=1)
    with torch.no_grad():
        torch.testing.assert_close(exported.module()(dense, emb), model(dense, emb))
