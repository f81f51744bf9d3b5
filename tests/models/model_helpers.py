"""Small schemas and configs shared by the model tests."""

from __future__ import annotations

from dataclasses import replace

from terarec.config import ModelConfig
from terarec.types import FeatureSchema, FieldSpec

MODEL_NAMES = ("lr", "fm", "widedeep", "deepfm", "dcnv2", "dlrm", "dssm")


def tiny_schema(missing_flags: bool = False) -> FeatureSchema:
    """Three categorical fields (user, item, ctx) and two numeric ones."""
    return FeatureSchema(
        label="y",
        fields=(FieldSpec("user", "categorical"), FieldSpec("x1", "numeric"),
                FieldSpec("item", "categorical"), FieldSpec("ctx", "categorical"),
                FieldSpec("x2", "numeric")),
        missing_flags=missing_flags,
    )


def small_config(name: str, schema: FeatureSchema, **overrides) -> ModelConfig:
    """Narrow widths so each test runs in milliseconds; DSSM's user side is the first
    half of the categorical fields."""
    names = schema.sparse_names
    config = ModelConfig(name=name, embedding_dim=8, bottom_mlp=(16, 8), top_mlp=(32, 16),
                         deep_mlp=(32, 16), cross_layers=2,
                         user_fields=names[: max(1, len(names) // 2)])
    return replace(config, **overrides)
