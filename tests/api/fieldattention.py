"""A model of a user's own, as docs/api.md shows: self-attention across the fields."""

from __future__ import annotations

import torch
from torch import nn

import terarec


class FieldAttention(terarec.CTRModel):
    """Each field's row attends to every other field's (AutoInt's idea, one layer); the
    attended rows and the dense features go through a linear head."""

    def __init__(self, schema: terarec.FeatureSchema, config: terarec.ModelConfig) -> None:
        super().__init__(schema, config)
        d = self.row_dim
        self.attention = nn.MultiheadAttention(d, num_heads=1, batch_first=True)
        self.head = nn.Linear(self.num_fields * d + self.dense_dim, 1)
        self.bias = nn.Parameter(torch.zeros(1))  # the logit offset recalibration moves

    def forward(self, dense: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        attended, _ = self.attention(emb, emb, emb, need_weights=False)
        flat = (emb + attended).flatten(1)
        return self.head(torch.cat([flat, dense], dim=1)).squeeze(1) + self.bias
