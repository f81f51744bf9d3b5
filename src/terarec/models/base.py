"""The contract every CTR model keeps: a pure ``nn.Module`` over dense features and the
pooled rows of a batch's keys.

The embedding rows live outside the model (in the store, staged per pass into a working
set); the trainer looks them up and hands the model a ``[B, F, row_dim]`` tensor. So one
model class trains on a laptop, across ranks, and serves from a cache, unchanged.
"""

from __future__ import annotations

import torch
from torch import nn

from terarec.config import ModelConfig
from terarec.types import FeatureSchema


class CTRModel(nn.Module):
    """Base class. Subclasses set ``row_dim`` (floats per key in the store) in ``__init__``
    and implement ``forward(dense, emb) -> logits``.

    ``dense``: float32 ``[B, schema.dense_dim]``; ``emb``: float32 ``[B, F, row_dim]`` for the
    ``F = len(schema.sparse_names)`` categorical fields, in schema order; returns logits
    ``[B]`` (pre-sigmoid).
    """

    row_dim: int

    def __init__(self, schema: FeatureSchema, config: ModelConfig) -> None:
        super().__init__()
        self.schema = schema
        self.config = config
        self.num_fields = len(schema.sparse_names)
        self.dense_dim = schema.dense_dim

    def forward(self, dense: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:  # noqa: D102
        raise NotImplementedError
