"""DLRM (Naumov et al., 2019): bottom MLP over dense features, pairwise dot products with
the embeddings, top MLP over the products and the bottom output."""

from __future__ import annotations

import torch
from torch import nn

from terarec.config import ModelConfig
from terarec.models.base import CTRModel
from terarec.models.layers import MLP, DotInteraction
from terarec.types import FeatureSchema


class DLRM(CTRModel):
    """Data flow for ``F`` fields of width ``D``::

        dense [B, dense_dim] -> bottom_mlp -> z [B, D]
        T = [z, emb_1, ..., emb_F]                       [B, F+1, D]
        p = dot products T_i . T_j for i < j            [B, (F+1)F/2]
        logit = top_mlp([z, p]) -> Linear -> [B]

    ``bottom_mlp`` must end at ``embedding_dim`` so ``z`` can be dotted with the rows.
    Without numeric fields there is no bottom MLP and only the ``F`` rows interact.
    """

    def __init__(self, schema: FeatureSchema, config: ModelConfig) -> None:
        super().__init__(schema, config)
        has_dense = self.dense_dim > 0
        self.bottom = MLP(self.dense_dim, tuple(config.bottom_mlp), config.dropout,
                          batch_norm=config.batch_norm) \
            if has_dense else None
        self.interaction = DotInteraction(self.num_fields + int(has_dense))
        top_in = self.interaction.out_dim + (config.embedding_dim if has_dense else 0)
        self.top = MLP(top_in, tuple(config.top_mlp), config.dropout, out_dim=1,
                       batch_norm=config.batch_norm)

    @classmethod
    def check_config(cls, config: ModelConfig) -> None:
        super().check_config(config)
        bottom = tuple(config.bottom_mlp)
        if not bottom or bottom[-1] != config.embedding_dim:
            last = bottom[-1] if bottom else "none (empty)"
            raise ValueError(
                f"model 'dlrm': bottom_mlp's last width must equal embedding_dim "
                f"({config.embedding_dim}) because the dense output is dotted with the "
                f"embedding rows; got bottom_mlp={bottom} (last width {last})")

    @classmethod
    def row_dim_for(cls, config: ModelConfig) -> int:
        cls.check_config(config)
        return config.embedding_dim

    def logit_offset(self) -> nn.Parameter | None:
        """The bias of the last layer of the MLP that outputs the logit."""
        last = self.top[-1]
        return last.bias if isinstance(last, nn.Linear) else None

    def forward(self, dense: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        self.check_inputs(dense, emb)
        if self.bottom is None:
            return self.top(self.interaction(emb)).squeeze(1)
        z = self.bottom(dense)
        vectors = torch.cat([z.unsqueeze(1), emb], dim=1)
        return self.top(torch.cat([z, self.interaction(vectors)], dim=1)).squeeze(1)
