"""Wide & Deep: a linear model over keys and dense features next to an MLP over factors."""

from __future__ import annotations

import torch
from torch import nn

from terarec.config import ModelConfig
from terarec.models.base import CTRModel
from terarec.models.layers import MLP, concat_dense, dense_linear
from terarec.types import FeatureSchema


class WideDeep(CTRModel):
    """Rows are ``1 + D``: column 0 feeds the wide (linear) part, columns ``1:`` the deep
    MLP together with the dense features; the logit is the sum of both."""

    def __init__(self, schema: FeatureSchema, config: ModelConfig) -> None:
        super().__init__(schema, config)
        self.bias = nn.Parameter(torch.zeros(1))
        self.dense_linear = dense_linear(self.dense_dim)
        deep_in = self.num_fields * config.embedding_dim + self.dense_dim
        self.deep = MLP(deep_in, tuple(config.deep_mlp), config.dropout, out_dim=1,
                        batch_norm=config.batch_norm)

    @classmethod
    def row_dim_for(cls, config: ModelConfig) -> int:
        cls.check_config(config)
        return 1 + config.embedding_dim

    def forward(self, dense: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        self.check_inputs(dense, emb)
        wide = emb[:, :, 0].sum(dim=1) + self.bias
        if self.dense_linear is not None:
            wide = wide + self.dense_linear(dense).squeeze(1)
        deep = self.deep(concat_dense(emb[:, :, 1:], dense)).squeeze(1)
        return wide + deep
