"""``model.bucket_weight_scale``: the first-order weights of bucketed numeric fields enter
the logit times the factor; the categorical fields' and the rest of the model do not."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from model_helpers import small_config

from terarec.config import TrainConfig, from_dict, to_dict, unused_keys
from terarec.models import build_model
from terarec.types import FeatureSchema, FieldSpec

FIRST_ORDER_MODELS = ("lr", "fm", "deepfm", "widedeep")


def bucketed_schema() -> FeatureSchema:
    """Two categorical fields and a numeric one cut into buckets (a sparse field too)."""
    return FeatureSchema(label="y", fields=(
        FieldSpec("user", "categorical"),
        FieldSpec("count", "numeric", transform="log1p", buckets=(1.0, 2.0)),
        FieldSpec("item", "categorical")))


@pytest.mark.parametrize("name", FIRST_ORDER_MODELS)
def test_only_the_bucket_column_is_scaled(name: str) -> None:
    schema = bucketed_schema()
    assert [f.name for f in schema.sparse_fields] == ["user", "item", "count"]
    torch.manual_seed(0)
    plain = build_model(schema, small_config(name, schema))
    scaled = build_model(schema, small_config(name, schema, bucket_weight_scale=0.25))
    scaled.load_state_dict(plain.state_dict())  # the factor is no parameter
    dense = torch.randn(6, schema.dense_dim)
    emb = torch.randn(6, 3, plain.row_dim)
    # moving the bucket field's first-order weight by d moves the logit by 0.25 d ...
    bumped = emb.clone()
    bumped[:, 2, 0] += 1.0
    with torch.no_grad():
        assert torch.allclose(scaled(dense, bumped) - scaled(dense, emb),
                              0.25 * (plain(dense, bumped) - plain(dense, emb)), atol=1e-5)
        # ... and a categorical field's by d, as without the factor
        cat = emb.clone()
        cat[:, 0, 0] += 1.0
        assert torch.allclose(scaled(dense, cat) - scaled(dense, emb),
                              plain(dense, cat) - plain(dense, emb), atol=1e-5)


def test_a_schema_without_buckets_is_unchanged() -> None:
    schema = FeatureSchema(label="y", fields=(FieldSpec("a", "categorical"),
                                              FieldSpec("x", "numeric")))
    model = build_model(schema, small_config("fm", schema, bucket_weight_scale=0.25))
    assert model.bucket_scale is None
    assert "bucket_scale" not in model.state_dict()


def test_the_factor_must_be_positive_and_only_for_first_order_models() -> None:
    base = to_dict(TrainConfig())
    with pytest.raises(ValueError, match="bucket_weight_scale"):
        from_dict(TrainConfig, {**base, "model": {**base["model"],
                                                  "bucket_weight_scale": 0.0}})
    config = TrainConfig(model=dataclasses.replace(TrainConfig().model, name="dcnv2",
                                                   bucket_weight_scale=0.5))
    assert "model.bucket_weight_scale" in unused_keys(config, {"model.bucket_weight_scale"})
    deepfm = dataclasses.replace(config, model=dataclasses.replace(config.model,
                                                                   name="deepfm"))
    assert unused_keys(deepfm, {"model.bucket_weight_scale"}) == {}
