"""Models over sequence fields: DIN's target attention, and the pooled-sequence baseline.

Both get the other fields' rows ``[B, F, D]`` and each sequence's padded rows ``[B, L,
D]`` with its mask (``terarec.models.sequence``), turn each sequence into one interest
vector, and feed ``[fields, interests, dense]`` to an MLP:

- ``seqpool``: the interest is the sum (or, for a field pooled by mean, the mean) of
  the sequence's rows: what a multi-valued field gives, kept as a baseline;
- ``din`` (Zhou et al., *Deep Interest Network*, KDD 2018): the candidate's row ``q``
  attends over the history's rows ``k_i`` through the paper's activation unit, an MLP
  of ``[q, k_i, q - k_i, q * k_i]`` with widths 80-40 and PReLU activations; the interest
  is ``v = sum_i a(q, k_i) k_i`` over the filled positions, without softmax
  normalisation (the paper keeps the weights' sum, the intensity of the interest). The
  MLP gets ``[v, v * q]``: whether the attended history agrees with the candidate is a
  product of the two, which an MLP over their concatenation learns only slowly (Rendle
  et al., 2020), while the elementwise product hands it over as the activation unit's
  ``q * k_i`` does for each item.

The candidate field of a sequence is the field sharing its table (``--share-table
hist_items=item``): the history and the candidate then look up the same rows, which is
what lets the attention compare them.
"""

from __future__ import annotations

import torch
from torch import nn

from terarec.config import ModelConfig
from terarec.models.base import CTRModel
from terarec.models.layers import MLP
from terarec.models.sequence import SequenceRows
from terarec.types import FeatureSchema

ATTENTION_MLP = (80, 40)  # the activation unit's widths, as in the paper


class SeqPool(CTRModel):
    """MLP over the fields, each sequence's pooled rows and the dense features."""

    uses_sequences = True
    interest_parts = 1  # an interest vector is this many rows wide

    def __init__(self, schema: FeatureSchema, config: ModelConfig) -> None:
        super().__init__(schema, config)
        self.sequence_names = tuple(f.name for f in schema.sequence_fields)
        if not self.sequence_names:
            raise ValueError(f"model {config.name!r} needs a sequence field (--sequence "
                             "COL[:max_len]); the schema has none")
        self.mean = tuple(f.pooling == "mean" for f in schema.sequence_fields)
        dim = config.embedding_dim
        in_dim = (self.num_fields + self.interest_parts * len(self.sequence_names)) * dim \
            + self.dense_dim
        self.bias = nn.Parameter(torch.zeros(1))
        self.deep = MLP(in_dim, tuple(config.deep_mlp), config.dropout, out_dim=1,
                        batch_norm=config.batch_norm)

    def interest(self, i: int, emb: torch.Tensor, seq: SequenceRows) -> torch.Tensor:
        """Sequence ``i``'s interest vector ``[B, interest_parts * D]``."""
        total = seq.rows.sum(dim=1)
        if self.mean[i]:
            total = total / seq.lengths.clamp_min(1).to(total.dtype).unsqueeze(1)
        return total

    def forward(self, dense: torch.Tensor, emb: torch.Tensor,
                sequences: dict[str, SequenceRows] | None = None) -> torch.Tensor:
        self.check_inputs(dense, emb)
        if sequences is None:
            raise ValueError(f"{type(self).__name__}: needs the sequence fields' rows")
        parts = [emb.flatten(1)]
        parts += [self.interest(i, emb, sequences[name])
                  for i, name in enumerate(self.sequence_names)]
        parts.append(dense)
        return self.deep(torch.cat(parts, dim=1)).squeeze(1) + self.bias


class PReLU(nn.Module):
    """``max(x, 0) + alpha * min(x, 0)`` with one ``alpha`` per unit of the last axis
    (``nn.PReLU``'s channels are axis 1: the positions of ``[B, L, width]``); ``alpha``
    starts at 0.25, as He et al.'s."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.full((width,), 0.25))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.clamp_min(0) + self.alpha * x.clamp_max(0)


def activation_unit(in_dim: int, widths: tuple[int, ...]) -> nn.Sequential:
    """``Linear -> PReLU`` per width, then a ``Linear`` to one weight; Xavier weights and
    zero biases, as ``MLP``. PReLU, not the paper's Dice: Dice switches on batch
    statistics, which differ between ranks that split a batch, so N ranks would train
    another model than one process."""
    layers: list[nn.Module] = []
    for width in widths:
        layers += [nn.Linear(in_dim, width), PReLU(width)]
        in_dim = width
    layers.append(nn.Linear(in_dim, 1))
    for layer in layers:
        if isinstance(layer, nn.Linear):
            nn.init.xavier_uniform_(layer.weight)
            nn.init.zeros_(layer.bias)
    return nn.Sequential(*layers)


class DIN(SeqPool):
    """Deep Interest Network: target attention of the candidate over each sequence."""

    interest_parts = 2  # [v, v * q]

    def __init__(self, schema: FeatureSchema, config: ModelConfig) -> None:
        super().__init__(schema, config)
        pooled = [f.name for f in schema.key_fields if f.max_len is None]
        self.query_index: list[int] = []
        for spec in schema.sequence_fields:
            same = [f for f in schema.key_fields
                    if f.max_len is None and f.key_space == spec.key_space]
            if not same:
                raise ValueError(
                    f"model 'din': sequence field {spec.name!r} needs a candidate field on "
                    f"its table {spec.key_space!r}: share one (--share-table "
                    f"{spec.name}=ITEM_FIELD, or FieldSpec.table)")
            self.query_index.append(pooled.index(same[0].name))
        dim = config.embedding_dim
        self.attention = nn.ModuleList(
            activation_unit(4 * dim, ATTENTION_MLP) for _ in self.sequence_names)

    def interest(self, i: int, emb: torch.Tensor, seq: SequenceRows) -> torch.Tensor:
        keys = seq.rows  # [B, L, D]
        q = emb[:, self.query_index[i]]
        query = q.unsqueeze(1).expand_as(keys)
        units = torch.cat([query, keys, query - keys, query * keys], dim=2)
        weights = self.attention[i](units).squeeze(2) * seq.mask.to(keys.dtype)
        interest = (weights.unsqueeze(2) * keys).sum(dim=1)
        return torch.cat([interest, interest * q], dim=1)
