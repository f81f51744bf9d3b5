"""Multi-task models: one logit per label over the same embedding rows, so tasks that
share sparse rows (click and conversion, income and marital status) train one table.

Rows are laid out as DeepFM's, ``1 + D`` wide (column 0 a key's linear weight, columns
``1:`` its factor ``v``), and each task's logit is DeepFM's shape with a shared deep part::

    shallow_t = bias_t + sum_f (c_tf w_f + <u_tf, v_f>) + a_t . dense + <s_t, fm(v)>
                (c, s start at 1 and u at 0: every task starts as the same FM; fm(v) is
                 the pairwise-interaction vector 0.5 ((sum v)^2 - sum v^2), <1, fm> FM's
                 term; u_tf lets each task weigh a key's factor as its own first order)
    x         = [v_1, ..., v_F, dense]
    sharedbottom   deep_t = tower_t(deep_mlp(x))
    mmoe           expert_e = deep_mlp_e(x), e < num_experts
                   deep_t = tower_t(sum_e softmax(W_t x)[e] expert_e)
    esmm           ctr = shallow_0 + ctr_mlp(x),  cvr = shallow_1 + cvr_mlp(x)
                   outputs [ctr, logit(sigmoid(ctr) * sigmoid(cvr))]   (pCTR, pCTCVR)

    logit_t = shallow_t + deep_t, returned as [B, T] in ``schema.task_names`` order.

The towers' output layers start at zero (as DeepFM's deep part): an untrained model is
one FM per task, and the deep part learns what the tasks share beyond it.
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
    """Each task's FM part and the towers the three models share."""

    multi_task: ClassVar[bool] = True

    def __init__(self, schema: FeatureSchema, config: ModelConfig) -> None:
        super().__init__(schema, config)
        tasks, fields, dim = self.num_tasks, self.num_fields, config.embedding_dim
        self.in_dim = fields * dim + self.dense_dim
        self.task_bias = nn.Parameter(torch.zeros(tasks))
        self.field_scale = nn.Parameter(torch.ones(tasks, fields))
        self.pair_scale = nn.Parameter(torch.ones(tasks, dim))
        # Each task's own reading of a key's factor as a first-order weight: the rows'
        # linear weight is shared, and tasks may weigh one key differently.
        self.field_proj = nn.Parameter(torch.zeros(tasks, fields, dim))
        self.task_dense = nn.Linear(self.dense_dim, tasks, bias=False) \
            if self.dense_dim else None
        if self.task_dense is not None:
            nn.init.zeros_(self.task_dense.weight)

    @classmethod
    def row_dim_for(cls, config: ModelConfig) -> int:
        cls.check_config(config)
        return 1 + config.embedding_dim

    def shallow(self, dense: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        """``[B, T]``: each task's FM logit over the shared rows."""
        factors = emb[:, :, 1:]
        linear = emb[:, :, 0] @ self.field_scale.T + self.task_bias \
            + torch.einsum("bfd,tfd->bt", factors, self.field_proj)
        if self.task_dense is not None:
            linear = linear + self.task_dense(dense)
        pairs = 0.5 * (factors.sum(dim=1).square() - factors.square().sum(dim=1))
        return linear + pairs @ self.pair_scale.T

    def deep_input(self, dense: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        return concat_dense(emb[:, :, 1:], dense)

    def _towers(self, in_dim: int) -> nn.ModuleList:
        cfg = self.config
        return nn.ModuleList(MLP(in_dim, tuple(cfg.tower_mlp), cfg.dropout, out_dim=1,
                                 batch_norm=cfg.batch_norm, zero_output=True)
                             for _ in self.task_names)

    def logit_offset(self) -> nn.Parameter | None:
        """None: each task has its own output bias (``task_bias``); recalibration, which
        shifts one, is off for these models."""
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
        h = self.bottom(self.deep_input(dense, emb))
        deep = torch.cat([tower(h) for tower in self.towers], dim=1)
        return self.shallow(dense, emb) + deep


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
        x = self.deep_input(dense, emb)
        experts = torch.stack([e(x) for e in self.experts], dim=1)  # [B, E, H]
        gates = F.softmax(self.gates(x).view(x.shape[0], self.num_tasks, -1), dim=2)
        mixed = torch.bmm(gates, experts)  # [B, T, H]
        deep = torch.cat([tower(mixed[:, t]) for t, tower in enumerate(self.towers)], dim=1)
        return self.shallow(dense, emb) + deep


class ESMM(_MultiTask):
    """Entire-space multi-task model (Ma et al., SIGIR 2018) for click then conversion:
    a CTR and a CVR network (each an FM part and a ``deep_mlp``) over the shared rows;
    the second output is pCTCVR = pCTR * pCVR, trained on impressions against click and
    conversion, so the CVR tower learns over the whole impression space (no selection
    bias) and from the click task's rows. Labels: ``click,conversion``; a conversion
    without a click counts as none. The CVR itself is ``sigmoid(cvr_logits)``."""

    def __init__(self, schema: FeatureSchema, config: ModelConfig) -> None:
        super().__init__(schema, config)
        if self.num_tasks != 2:
            raise ValueError(f"model 'esmm' has two tasks (click, then conversion); the "
                             f"schema has {self.num_tasks}: {', '.join(self.task_names)}")
        self.ctr = MLP(self.in_dim, tuple(config.deep_mlp), config.dropout, out_dim=1,
                       batch_norm=config.batch_norm, zero_output=True)
        self.cvr = MLP(self.in_dim, tuple(config.deep_mlp), config.dropout, out_dim=1,
                       batch_norm=config.batch_norm, zero_output=True)

    def _ctr_cvr(self, dense: torch.Tensor, emb: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """``[B, 1]`` CTR and CVR logits: each task's FM part plus its tower."""
        shallow, x = self.shallow(dense, emb), self.deep_input(dense, emb)
        return shallow[:, :1] + self.ctr(x), shallow[:, 1:] + self.cvr(x)

    def cvr_logits(self, dense: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        """``[B]`` conversion-given-click logits (the CVR tower alone)."""
        return self._ctr_cvr(dense, emb)[1].squeeze(1)

    def task_targets(self, labels: torch.Tensor) -> torch.Tensor:
        """``[click, click and conversion]``: pCTCVR's target on every impression."""
        return torch.stack([labels[:, 0], labels[:, 0] * labels[:, 1]], dim=1)

    def forward(self, dense: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        self.check_inputs(dense, emb)
        a, b = self._ctr_cvr(dense, emb)
        # log pCTCVR = log s(a) + log s(b); its logit is that minus log(1 - pCTCVR),
        # where 1 - s(a) s(b) = s(-a) + s(a) s(-b): a sum of positive terms, so no
        # cancellation near pCTCVR = 1 (and every operation exports to ONNX).
        log_p = F.logsigmoid(a) + F.logsigmoid(b)
        log_q = torch.logsumexp(torch.cat([F.logsigmoid(-a),
                                           F.logsigmoid(a) + F.logsigmoid(-b)], dim=1),
                                dim=1, keepdim=True)
        return torch.cat([a, log_p - log_q], dim=1)
