"""Small schemas and configs shared by the model tests."""

from __future__ import annotations

from dataclasses import replace

import torch

from terarec.config import ModelConfig
from terarec.types import FeatureSchema, FieldSpec

MODEL_NAMES = ("lr", "fm", "widedeep", "deepfm", "dcnv2", "dlrm", "dssm")
# Models over sequence fields (tests/sequences): they need a schema with one.
SEQUENCE_MODEL_NAMES = ("din", "seqpool")
# One logit per label: built over a schema with several labels (tests/multitask).
MULTI_TASK_NAMES = ("sharedbottom", "mmoe", "esmm")


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


def as_trained(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with its zero-started layers (DeepFM's deep output, the dense linear
    terms) drawn at random, as training moves them: behind a zero layer an untrained
    model's output shows nothing of what lies before it."""
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Linear) and not module.weight.any():
                torch.nn.init.normal_(module.weight)
    return model
