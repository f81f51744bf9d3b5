"""Multi-task models: one logit per label over the same embedding rows, so tasks that
share sparse rows (click and conversion, income and marital status) train one table.

Every model here reads ``x = [emb_1, ..., emb_F, dense]`` (the pooled rows flattened,
the numeric columns appended) and returns ``[B, T]`` logits in ``schema.task_names``
order::

    sharedbottom   x -> deep_mlp -> tower_t (tower_mlp -> 1)            per task t
    mmoe           x -> expert_e (deep_mlp), e < num_experts
                   gate_t = softmax(W_t x); h_t = sum_e gate_t[e] expert_e
                   h_t -> tower_t (tower_mlp -> 1)                       per task t
    esmm           x -> ctr tower (deep_mlp -> 1) = a,  x -> cvr tower = b
                   [a, logit(sigmoid(a) * sigmoid(b))]   (pCTR, pCTCVR)
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from terarec.config import ModelConfig
from terarec.models.base import CTRModel
from terarec.models.layers import MLP, concat_dense
from terarec.types import FeatureSchema


class _MultiTask(CTRModel):
    """The input width and per-task towers the three models share."""

    multi_task: ClassVar[bool] = True

    def __init__(self, schema: FeatureSchema, config: ModelConfig) -> None:
        super().__init__(schema, config)
        self.in_dim = self.num_fields * config.embedding_dim + self.dense_dim

    def _towers(self, in_dim: int) -> nn.ModuleList:
        cfg = self.config
        return nn.ModuleList(MLP(in_dim, tuple(cfg.tower_mlp), cfg.dropout, out_dim=1,
                                 batch_norm=cfg.batch_norm) for _ in self.task_names)

    def logit_offset(self) -> nn.Parameter | None:
        """None: each task has its own output bias (recalibration is per model)."""
        return None


class SharedBottom(_MultiTask):
    """Shared-bottom multi-task network (Caruana, 1997): one ``deep_mlp`` for every
    task, then a ``tower_mlp`` tower and a logit per task."""

    def __init__(self, schema: FeatureSchema, config: ModelConfig) -> None:
        super().__init__(schema, config)
        self.bottom = MLP(self.in_dim, tuple(config.deep_mlp), config.dropout,
                          batch_norm=config.batch_norm)
        self.towers = self._towers(self.bottom.out_dim)

    def forward(self, dense: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        self.check_inputs(dense, emb)
        h = self.bottom(concat_dense(emb, dense))
        return torch.cat([tower(h) for tower in self.towers], dim=1)


class MMoE(_MultiTask):
    """Multi-gate mixture of experts (Ma et al., KDD 2018): ``num_experts`` experts
    (each a ``deep_mlp``) shared by every task; each task mixes them with its own
    softmax gate over the input, then its ``tower_mlp`` tower gives its logit."""

    def __init__(self, schema: FeatureSchema, config: ModelConfig) -> None:
        super().__init__(schema, config)
        experts = [MLP(self.in_dim, tuple(config.deep_mlp), config.dropout,
                       batch_norm=config.batch_norm) for _ in range(config.num_experts)]
        self.experts = nn.ModuleList(experts)
        self.gates = nn.Linear(self.in_dim, config.num_experts * self.num_tasks)
        nn.init.zeros_(self.gates.weight)  # an even mixture to start with
        nn.init.zeros_(self.gates.bias)
        self.towers = self._towers(experts[0].out_dim)

    @classmethod
    def check_config(cls, config: ModelConfig) -> None:
        super().check_config(config)
        if config.num_experts < 1:
            raise ValueError(f"model 'mmoe': num_experts must be >= 1, "
                             f"got {config.num_experts}")

    def forward(self, dense: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        self.check_inputs(dense, emb)
        x = concat_dense(emb, dense)
        experts = torch.stack([e(x) for e in self.experts], dim=1)  # [B, E, H]
        gates = F.softmax(self.gates(x).view(x.shape[0], self.num_tasks, -1), dim=2)
        mixed = torch.bmm(gates, experts)  # [B, T, H]
        return torch.cat([tower(mixed[:, t]) for t, tower in enumerate(self.towers)],
                         dim=1)


class ESMM(_MultiTask):
    """Entire-space multi-task model (Ma et al., SIGIR 2018) for click then conversion:
    a CTR tower and a CVR tower over the shared rows; the second output is
    pCTCVR = pCTR * pCVR, trained on impressions against click and conversion, so the
    CVR tower learns over the whole impression space (no selection bias) and from the
    click task's rows. Labels: ``click,conversion``; a conversion without a click counts
    as none. The CVR itself is ``sigmoid(cvr_logits)``."""

    def __init__(self, schema: FeatureSchema, config: ModelConfig) -> None:
        super().__init__(schema, config)
        if self.num_tasks != 2:
            raise ValueError(f"model 'esmm' has two tasks (click, then conversion); the "
                             f"schema has {self.num_tasks}: {', '.join(self.task_names)}")
        self.ctr = MLP(self.in_dim, tuple(config.deep_mlp), config.dropout, out_dim=1,
                       batch_norm=config.batch_norm)
        self.cvr = MLP(self.in_dim, tuple(config.deep_mlp), config.dropout, out_dim=1,
                       batch_norm=config.batch_norm)

    def cvr_logits(self, dense: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        """``[B]`` conversion-given-click logits (the CVR tower alone)."""
        return self.cvr(concat_dense(emb, dense)).squeeze(1)

    def task_targets(self, labels: torch.Tensor) -> torch.Tensor:
        """``[click, click and conversion]``: pCTCVR's target on every impression."""
        return torch.stack([labels[:, 0], labels[:, 0] * labels[:, 1]], dim=1)

    def forward(self, dense: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        self.check_inputs(dense, emb)
        x = concat_dense(emb, dense)
        a, b = self.ctr(x), self.cvr(x)
        # log pCTCVR = log s(a) + log s(b); its logit is that minus log(1 - pCTCVR),
        # kept below 0 so the product never rounds to 1 (an infinite logit).
        log_p = (F.logsigmoid(a) + F.logsigmoid(b)).clamp(max=-1e-6)
        log_q = torch.where(log_p > -0.6931, torch.log(-torch.expm1(log_p)),
                            torch.log1p(-torch.exp(log_p)))
        return torch.cat([a, log_p - log_q], dim=1)
