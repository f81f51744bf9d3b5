"""Factorization machines: FM, and DeepFM (FM plus an MLP over the same factors).

Rows are ``1 + D`` wide: column 0 is the key's linear weight, columns ``1:`` its factor.
"""

from __future__ import annotations

import torch
from torch import nn

from terarec.config import ModelConfig
from terarec.models.base import CTRModel
from terarec.models.layers import MLP, concat_dense, dense_linear, fm_pairwise
from terarec.types import FeatureSchema


class FM(CTRModel):
    """``logit = bias + sum_f w_f + w . dense + sum_{i<j} <v_i, v_j>``."""

    def __init__(self, schema: FeatureSchema, config: ModelConfig) -> None:
        super().__init__(schema, config)
        self.bias = nn.Parameter(torch.zeros(1))
        self.dense_linear = dense_linear(self.dense_dim)

    @classmethod
    def row_dim_for(cls, config: ModelConfig) -> int:
        cls.check_config(config)
        return 1 + config.embedding_dim

    def linear_logit(self, dense: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        """First-order part: global bias, per-key weights, dense linear term."""
        logit = emb[:, :, 0].sum(dim=1) + self.bias
        if self.dense_linear is not None:
            logit = logit + self.dense_linear(dense).squeeze(1)
        return logit

    def forward(self, dense: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        self.check_inputs(dense, emb)
        return self.linear_logit(dense, emb) + fm_pairwise(emb[:, :, 1:])


class DeepFM(FM):
    """FM plus an MLP over the concatenated factors and dense features; both parts share
    the factors, so the deep part learns from the same rows the FM part shapes. The MLP's
    output layer starts at zero: an untrained DeepFM is an FM, and the deep part adds
    what the data supports beyond it (on 8,000 rows, little; docs/models.md)."""

    def __init__(self, schema: FeatureSchema, config: ModelConfig) -> None:
        super().__init__(schema, config)
        deep_in = self.num_fields * config.embedding_dim + self.dense_dim
        self.deep = MLP(deep_in, tuple(config.deep_mlp), config.dropout, out_dim=1,
                        batch_norm=config.batch_norm, zero_output=True)

    def forward(self, dense: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        self.check_inputs(dense, emb)
        factors = emb[:, :, 1:]
        deep = self.deep(concat_dense(factors, dense)).squeeze(1)
        return self.linear_logit(dense, emb) + fm_pairwise(factors) + deep
