"""DSSM-style two-tower model: a user tower and an item tower meet only in a final
similarity, so item vectors can be computed once and searched by nearest neighbour."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from terarec.config import ModelConfig
from terarec.models.base import CTRModel
from terarec.models.layers import MLP, concat_dense
from terarec.types import FeatureSchema, KeyedIds

SIMILARITIES = ("cosine", "dot")


class DSSM(CTRModel):
    """Two towers over disjoint field sets::

        user rows [B, U, D] + dense -> user tower (deep_mlp) -> u [B, K]
        item rows [B, I, D]         -> item tower (deep_mlp) -> v [B, K]
        logit = scale * cos(u, v) + bias     (tower_similarity = "cosine")
        logit = u . v + bias                 (tower_similarity = "dot")

    ``config.user_fields`` names the user side; ``config.item_fields`` the item side, by
    default every other categorical field. Bucketed numeric fields (their keys) join the
    user tower, as their dense values do, unless a side names them. Fields in neither
    tower are ignored. With
    cosine, ``user_embedding``/``item_embedding`` return unit vectors, so retrieval by
    inner product ranks exactly as the model scores.
    """

    user_index: torch.Tensor  # buffers: each tower's field positions in ``emb``
    item_index: torch.Tensor

    def __init__(self, schema: FeatureSchema, config: ModelConfig) -> None:
        super().__init__(schema, config)
        self.user_fields, self.item_fields = self._split_fields(schema, config)
        names = schema.sparse_names
        self.register_buffer("user_index", torch.tensor([names.index(n) for n in
                                                         self.user_fields]), persistent=False)
        self.register_buffer("item_index", torch.tensor([names.index(n) for n in
                                                         self.item_fields]), persistent=False)
        widths = tuple(config.deep_mlp)
        dim = config.embedding_dim
        self.user_tower = MLP(len(self.user_fields) * dim + self.dense_dim, widths[:-1],
                              config.dropout, out_dim=widths[-1],
                              batch_norm=config.batch_norm)
        self.item_tower = MLP(len(self.item_fields) * dim, widths[:-1], config.dropout,
                              out_dim=widths[-1], batch_norm=config.batch_norm)
        self.cosine = config.tower_similarity == "cosine"
        self.scale = float(config.cosine_scale) if self.cosine else 1.0
        self.bias = nn.Parameter(torch.zeros(1))

    @classmethod
    def check_config(cls, config: ModelConfig) -> None:
        super().check_config(config)
        if not config.deep_mlp:
            raise ValueError("model 'dssm': deep_mlp must have at least one width (the last "
                             "is the size of the user and item vectors)")
        if config.tower_similarity not in SIMILARITIES:
            raise ValueError(f"model 'dssm': tower_similarity must be one of {SIMILARITIES}, "
                             f"got {config.tower_similarity!r}")
        if config.tower_similarity == "cosine" and not config.cosine_scale > 0:
            raise ValueError(f"model 'dssm': cosine_scale must be > 0, "
                             f"got {config.cosine_scale}")

    @classmethod
    def row_dim_for(cls, config: ModelConfig) -> int:
        cls.check_config(config)
        return config.embedding_dim

    @staticmethod
    def _split_fields(schema: FeatureSchema,
                      config: ModelConfig) -> tuple[tuple[str, ...], tuple[str, ...]]:
        names = schema.sparse_names
        user = tuple(config.user_fields)
        if not user:
            raise ValueError(f"model 'dssm': user_fields is empty; name the user-side "
                             f"categorical fields, from {list(names)}")
        # Numeric fields feed the user tower (its dense input); so do their bucket keys,
        # unless a side names them: the item tower must not read a user's values.
        named = set(user) | set(config.item_fields)
        user += tuple(f.name for f in schema.numeric
                      if f.buckets is not None and f.name not in named)
        item = tuple(config.item_fields) or tuple(n for n in names if n not in user)
        for side, chosen in (("user_fields", user), ("item_fields", item)):
            unknown = [n for n in chosen if n not in names]
            if unknown:
                raise ValueError(f"model 'dssm': {side} {unknown} are not categorical fields "
                                 f"of the schema; known: {list(names)}")
            if len(set(chosen)) != len(chosen):
                raise ValueError(f"model 'dssm': {side} repeats a field: {list(chosen)}")
        if not item:
            raise ValueError("model 'dssm': no item-side fields left; set item_fields or "
                             "leave some categorical fields out of user_fields")
        shared = sorted(set(user) & set(item))
        if shared:
            raise ValueError(f"model 'dssm': fields {shared} are in both user_fields and "
                             "item_fields; the towers must not share inputs")
        return user, item

    def user_embedding(self, dense: torch.Tensor, user_emb: torch.Tensor) -> torch.Tensor:
        """User vectors ``[B, K]`` from ``user_emb`` ``[B, U, D]`` (rows of ``user_fields``
        in that order) and ``dense`` ``[B, dense_dim]``."""
        out = self.user_tower(concat_dense(user_emb, dense))
        return F.normalize(out, dim=1, eps=1e-8) if self.cosine else out

    def item_embedding(self, item_emb: torch.Tensor) -> torch.Tensor:
        """Item vectors ``[B, K]`` from ``item_emb`` ``[B, I, D]`` (rows of ``item_fields``
        in that order)."""
        out = self.item_tower(item_emb.reshape(item_emb.shape[0], -1))
        return F.normalize(out, dim=1, eps=1e-8) if self.cosine else out

    def item_ids(self, sparse: KeyedIds) -> torch.Tensor:
        """One int64 id per sample naming its item: the item fields' keys combined (equal
        ids, equal item-tower inputs), for in-batch negatives and their logQ counts."""
        if not sparse.one_per_slot:
            raise ValueError("loss 'sampled_softmax' needs one key per item field and sample; "
                             f"fields {list(self.item_fields)} hold several")
        ids = torch.zeros(sparse.batch_size, dtype=torch.int64, device=sparse.values.device)
        for name in self.item_fields:
            ids = ids * 1_000_003 + sparse.field_values(name)  # wraps in int64, still an id
        return ids

    def sampled_softmax_loss(self, dense: torch.Tensor, emb: torch.Tensor,
                             labels: torch.Tensor, item_ids: torch.Tensor) -> torch.Tensor:
        """Mean softmax cross-entropy of each clicked (label 1) sample's item against the
        other clicked items of the batch (``in_batch_softmax``). Rows with label 0 are
        not used; a batch without clicks gives a zero loss."""
        self.check_inputs(dense, emb)
        pos = torch.nonzero(labels > 0.5).squeeze(1)
        if len(pos) == 0:
            return emb.sum() * 0.0  # keeps the graph (and the lookup's backward) intact
        vectors = self(dense.index_select(0, pos), emb.index_select(0, pos), towers=True)
        user, item = vectors.chunk(2, dim=1)
        return self.in_batch_softmax(user, item, item_ids[pos]) / len(pos)

    def in_batch_softmax(self, user: torch.Tensor, items: torch.Tensor, ids: torch.Tensor,
                         first: int = 0) -> torch.Tensor:
        """Summed softmax cross-entropy of user vectors ``[P_r, K]`` (the clicked rows
        ``first, first + 1, ...`` of the batch) against the items ``[P, K]`` of all its
        clicked rows (ids ``[P]``), each row's own item the answer, with logQ correction.

        Popular items turn up as negatives more often than they would be drawn uniformly,
        so uncorrected they are pushed down; subtracting ``log q(item)`` (q estimated by
        the item's share of the batch's clicks) removes that sampling bias (Yi et al.,
        RecSys 2019). Other occurrences of a row's own item are not negatives. On N ranks
        ``items`` and ``ids`` are every rank's (``distributed.negatives``)."""
        logits = self.scale * user @ items.T
        _, inverse, counts = torch.unique(ids, return_inverse=True, return_counts=True)
        log_q = torch.log(counts[inverse].to(logits.dtype) / len(ids))
        own = torch.arange(first, first + len(user), device=ids.device)
        same = ids.index_select(0, own)[:, None] == ids[None, :]
        same[torch.arange(len(user), device=ids.device), own] = False
        logits = (logits - log_q[None, :]).masked_fill(same, float("-inf"))
        return F.cross_entropy(logits, own, reduction="sum")

    def forward(self, dense: torch.Tensor, emb: torch.Tensor, *,
                towers: bool = False) -> torch.Tensor:
        """Logits ``[B]``; ``towers=True``: the user and item vectors side by side
        ``[B, 2K]`` instead, so that a DDP-wrapped model computes them in its forward
        (with the bias, which a softmax over items ignores, at zero weight: DDP expects a
        gradient for every parameter)."""
        self.check_inputs(dense, emb)
        user = self.user_embedding(dense, emb.index_select(1, self.user_index))
        item = self.item_embedding(emb.index_select(1, self.item_index))
        if towers:
            return torch.cat([user, item], dim=1) + 0.0 * self.bias
        return self.scale * (user * item).sum(dim=1) + self.bias
