"""DCN-v2 (Wang et al., 2021), stacked form: cross network, then an MLP, then a logit."""

from __future__ import annotations

import torch
from torch import nn

from terarec.config import ModelConfig
from terarec.models.base import CTRModel
from terarec.models.layers import MLP, CrossNetV2, concat_dense
from terarec.types import FeatureSchema


class DCNv2(CTRModel):
    """``x0 = [emb_1, ..., emb_F, dense]``; ``config.cross_layers`` cross layers
    ``x_{l+1} = x0 * (W x_l + b) + x_l`` (``W`` low-rank when ``config.cross_rank > 0``);
    then ``config.deep_mlp`` and a linear logit."""

    def __init__(self, schema: FeatureSchema, config: ModelConfig) -> None:
        super().__init__(schema, config)
        x0_dim = self.num_fields * config.embedding_dim + self.dense_dim
        self.cross = CrossNetV2(x0_dim, config.cross_layers, config.cross_rank)
        self.deep = MLP(x0_dim, tuple(config.deep_mlp), config.dropout, out_dim=1,
                        batch_norm=config.batch_norm)

    @classmethod
    def check_config(cls, config: ModelConfig) -> None:
        super().check_config(config)
        if config.cross_layers < 0:
            raise ValueError(f"model 'dcnv2': cross_layers must be >= 0, "
                             f"got {config.cross_layers}")
        if config.cross_rank < 0:
            raise ValueError(f"model 'dcnv2': cross_rank must be >= 0 (0 = full rank), "
                             f"got {config.cross_rank}")

    @classmethod
    def row_dim_for(cls, config: ModelConfig) -> int:
        cls.check_config(config)
        return config.embedding_dim

    def logit_offset(self) -> nn.Parameter | None:
        """The bias of the last layer of the MLP that outputs the logit."""
        last = self.deep[-1]
        return last.bias if isinstance(last, nn.Linear) else None

    def forward(self, dense: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        self.check_inputs(dense, emb)
        return self.deep(self.cross(concat_dense(emb, dense))).squeeze(1)
