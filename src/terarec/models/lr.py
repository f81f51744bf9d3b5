"""Logistic regression: one weight per key plus a linear term over the dense features."""

from __future__ import annotations

import torch
from torch import nn

from terarec.config import ModelConfig
from terarec.models.base import CTRModel
from terarec.models.layers import dense_linear
from terarec.types import FeatureSchema


class LR(CTRModel):
    """``logit = bias + sum_f emb[:, f, 0] + w . dense``; each key's row is its weight."""

    def __init__(self, schema: FeatureSchema, config: ModelConfig) -> None:
        super().__init__(schema, config)
        self.bias = nn.Parameter(torch.zeros(1))
        self.dense_linear = dense_linear(self.dense_dim)

    @classmethod
    def row_dim_for(cls, config: ModelConfig) -> int:
        cls.check_config(config)
        return 1

    def forward(self, dense: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        self.check_inputs(dense, emb)
        logit = emb[:, :, 0].sum(dim=1) + self.bias
        if self.dense_linear is not None:
            logit = logit + self.dense_linear(dense).squeeze(1)
        return logit
