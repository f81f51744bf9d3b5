"""Per-key (sparse) optimizers, applied to a pass's working set inside the backward pass.

Each key's optimizer state lives in its store row next to its values, so a checkpoint
takes both from the same moment. The update is fused: gradients of repeated keys in a
batch are summed, then each touched row is updated once; untouched rows cost nothing.
On CPU the update is one compiled loop over the touched rows; on other devices it is the
same math in torch ops (also the reference the CPU kernel is tested against).

State layout per row (``S`` floats):

    adagrad (row-wise): [acc]                 S = 1
    adam    (lazy):     [m_0..m_D, v_0..v_D, t] S = 2D + 1
    ftrl    (proximal): [z_0..z_D, n_0..n_D]  S = 2D
    sgd:                []                    S = 0

``weight_decay`` adds ``wd * w`` to a row's gradient once per step it is touched;
``embedding_l2`` is BARS's embedding regulariser, the gradient of
``embedding_l2 / 2 * mean over the batch's rows of ||e||^2`` over the looked-up
embeddings: ``embedding_l2 * occurrences / batch_rows * w``, so a frequent key is pulled
toward zero as often as it is used, and the strength does not depend on the batch size.

``bucket_l2`` is the same per-use L2 on the rows of bucketed numeric fields only, the
keys of a count range: their first-order weights and factors fit a free value per range,
where the signal is usually smooth in the count (the field's standardised value already
carries its slope), so they want a prior far stronger than the categorical values'
(docs/models.md, "Where the gap on the planted truths sits"). The kernel knows rows, not
fields, so it is applied on the lookup's output instead (``slot_l2``): the gradient of
``bucket_l2 / 2 * mean_b sum_{numeric f} ||e_bf||^2``, the math of ``embedding_l2``.

``l2`` is L2 on the whole table at every step, touched or not: the gradient of
``l2 / 2 * ||W||^2`` added to every row at every step, as a full-batch penalty
(scikit-learn's ``1 / (2 C)`` over N rows is ``l2 = 1 / (C * N)`` per step of the mean
loss). A row seen rarely is pulled toward zero as often as a frequent one, so it keeps
less of the few labels it saw: the prior that per-use and per-touch L2 lack. It is
applied as its proximal step, ``w <- w / (1 + step * l2)`` per step (``step`` the row's
step size; stable at any step size, and the same optimum as adding ``l2 * w`` to the
gradient), and lazily: a touched row first shrinks once for each step it missed since its
last update, at its step size then (Adagrad's does not change while a row is untouched, so
this equals shrinking it at every step), then takes its update and this step's shrink; at
the pass end every row of the working set catches up to the pass's last step. A pass a
key is not in does not shrink it.

Row 0 of every working set is the shared zero row of unadmitted and unknown keys: it is
never updated.

Group lasso (``group_lasso = lambda``) follows each row's update with the proximal step of
``lambda * ||w||_2``::

    w <- w * max(0, 1 - step * lambda / ||w||)

``step`` is the row's own step size: ``lr / (sqrt(acc) + eps)`` for row-wise Adagrad (its
metric is the same for every column of a row, so this is the exact proximal step), ``lr``
for Adam and SGD. Rows shrink as a whole and reach exactly zero, which is what lets the
store prune them. FTRL recomputes weights from its accumulators at every step, so a
shrink applied to ``w`` would not stick; it has its own ``ftrl_l1`` instead.
"""

from __future__ import annotations

import numba
import numpy as np
import torch

from terarec.config import SparseOptimizerConfig
from terarec.types import FeatureSchema

_ADAGRAD, _ADAM, _FTRL, _SGD = 0, 1, 2, 3
_KINDS = {"adagrad": _ADAGRAD, "adam": _ADAM, "ftrl": _FTRL, "sgd": _SGD}


@numba.njit(nogil=True, cache=True)
def _fused_update(kind, weights, state, rows, grads, pos, lr, eps, wd, beta1, beta2,
                  alpha, beta, l1, l2, group_lasso, emb_l2, table_l2, last, step_index):
    n, dim = grads.shape
    touched = np.empty(n, np.int64)
    gsum = np.empty((n, dim), np.float32)
    count = np.zeros(n, np.float32)
    n_t = 0
    for i in range(n):
        r = rows[i]
        if r == 0:
            continue
        p = pos[r]
        if p < 0:
            pos[r] = n_t
            touched[n_t] = r
            count[n_t] = 1.0
            for d in range(dim):
                gsum[n_t, d] = grads[i, d]
            n_t += 1
        else:
            count[p] += 1.0
            for d in range(dim):
                gsum[p, d] += grads[i, d]
    for j in range(n_t):
        r = touched[j]
        pos[r] = -1
        w = weights[r]
        s = state[r]
        g = gsum[j]
        if table_l2 != 0.0:
            # the steps since the row was last brought up to date shrink it first, at
            # the rate its accumulator gave it then (unchanged while it was not touched)
            k = step_index - last[r] - 1
            if k > 0:
                rate = lr / (np.sqrt(s[0]) + eps) if kind == _ADAGRAD else lr
                f = (1.0 + rate * table_l2) ** -float(k)
                for d in range(dim):
                    w[d] *= f
            last[r] = step_index
        if wd != 0.0:
            for d in range(dim):
                g[d] += wd * w[d]
        if emb_l2 != 0.0:
            for d in range(dim):
                g[d] += emb_l2 * count[j] * w[d]
        step = lr
        if kind == _ADAGRAD:
            sq = 0.0
            for d in range(dim):
                sq += g[d] * g[d]
            s[0] += sq / dim
            step = lr / (np.sqrt(s[0]) + eps)
            for d in range(dim):
                w[d] -= step * g[d]
        elif kind == _ADAM:
            s[2 * dim] += 1.0
            t = s[2 * dim]
            c1 = 1.0 - beta1 ** t
            c2 = 1.0 - beta2 ** t
            for d in range(dim):
                s[d] = beta1 * s[d] + (1.0 - beta1) * g[d]
                s[dim + d] = beta2 * s[dim + d] + (1.0 - beta2) * g[d] * g[d]
                w[d] -= lr * (s[d] / c1) / (np.sqrt(s[dim + d] / c2) + eps)
        elif kind == _FTRL:
            for d in range(dim):
                n_old = s[dim + d]
                n_new = n_old + g[d] * g[d]
                sigma = (np.sqrt(n_new) - np.sqrt(n_old)) / alpha
                s[d] += g[d] - sigma * w[d]
                s[dim + d] = n_new
                z = s[d]
                if abs(z) <= l1:
                    w[d] = 0.0
                else:
                    w[d] = -(z - np.sign(z) * l1) / ((beta + np.sqrt(n_new)) / alpha + l2)
        else:
            for d in range(dim):
                w[d] -= lr * g[d]
        if table_l2 != 0.0:  # this step's own shrink, after its update
            f = 1.0 / (1.0 + step * table_l2)
            for d in range(dim):
                w[d] *= f
        if group_lasso > 0.0:
            norm = 0.0
            for d in range(dim):
                norm += w[d] * w[d]
            norm = np.sqrt(norm)
            shrink = step * group_lasso
            factor = 0.0 if norm <= shrink else 1.0 - shrink / norm
            for d in range(dim):
                w[d] *= factor
    return n_t


_NO_ROWS = np.zeros(1, np.int64)


class _SlotL2(torch.autograd.Function):
    """Identity forward; backward adds ``scale[s] * e`` to each slot's gradient."""

    @staticmethod
    def forward(ctx, emb: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(emb, scale)
        return emb.view_as(emb)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        emb, scale = ctx.saved_tensors
        return grad + emb * scale.view(1, -1, 1).to(emb.dtype), None


def slot_l2(emb: torch.Tensor, strength: torch.Tensor | None, per_row: float
            ) -> torch.Tensor:
    """``emb`` (``[B, S, D]``, a lookup's rows) unchanged, whose backward adds
    ``strength[s] * per_row * e`` to each slot's gradient: a per-use L2 of ``strength``
    over a loss whose gradient per row is ``per_row`` (``1 / B`` for a batch's mean)."""
    if strength is None or not emb.requires_grad:
        return emb
    return _SlotL2.apply(emb, strength * per_row)


class LazyL2:
    """One working set's bookkeeping for ``l2``: the step of the pass each row was last
    brought up to date at (-1: the pass start). Untouched rows cost nothing per step;
    they decay when next touched and at the pass end (``SparseOptimizer.catch_up``)."""

    def __init__(self, rows: int, device: torch.device | str) -> None:
        self.last = torch.full((rows,), -1, dtype=torch.int64, device=device)


class SparseOptimizer:
    """A per-row optimizer configured by ``SparseOptimizerConfig``."""

    def __init__(self, config: SparseOptimizerConfig) -> None:
        if config.name not in _KINDS:
            raise ValueError(f"unknown sparse optimizer {config.name!r}; known: {sorted(_KINDS)}")
        if config.group_lasso < 0:
            raise ValueError(f"group_lasso must be >= 0, got {config.group_lasso}")
        if config.group_lasso and config.name == "ftrl":
            raise ValueError("group_lasso does not apply to ftrl (it recomputes weights from "
                             "its accumulators); use ftrl_l1, or adagrad/adam/sgd")
        if config.l2 and config.name not in ("adagrad", "sgd"):
            raise ValueError(f"l2 (every-step L2) applies to adagrad and sgd, not "
                             f"{config.name}: use weight_decay"
                             + (" or ftrl_l2" if config.name == "ftrl" else ""))
        self.config = config
        self.kind = _KINDS[config.name]
        self.lr = config.lr

    @property
    def name(self) -> str:
        return self.config.name

    def state_dim(self, row_dim: int) -> int:
        return {_ADAGRAD: 1, _ADAM: 2 * row_dim + 1, _FTRL: 2 * row_dim, _SGD: 0}[self.kind]

    def init_state(self, n: int, row_dim: int) -> np.ndarray:
        state = np.zeros((n, self.state_dim(row_dim)), np.float32)
        if self.kind == _ADAGRAD:
            state[:, 0] = self.config.initial_accumulator
        return state

    def l2_per_occurrence(self, batch_rows: int | None) -> float:
        """The embedding L2 coefficient per occurrence of a row in a batch of
        ``batch_rows`` rows (the gradient of ``l2/2 * mean_b ||e_b||^2``)."""
        if not self.config.embedding_l2:
            return 0.0
        if batch_rows is None:
            raise ValueError("embedding_l2 needs the batch size of each step; this trainer "
                             "does not pass it (use weight_decay for a per-step L2)")
        return self.config.embedding_l2 / max(batch_rows, 1)

    def bucket_l2_slots(self, schema: FeatureSchema, device: torch.device | str
                        ) -> torch.Tensor | None:
        """Per slot of ``schema.sparse_fields``, the ``bucket_l2`` strength (0 for every
        slot but a bucketed numeric field's) for ``slot_l2``; None when none applies."""
        fields = schema.sparse_fields
        if not self.config.bucket_l2 or not any(f.kind == "numeric" for f in fields):
            return None
        return torch.tensor([self.config.bucket_l2 if f.kind == "numeric" else 0.0
                             for f in fields], dtype=torch.float32, device=device)

    def lazy_l2(self, rows: int, device: torch.device | str) -> LazyL2 | None:
        """A working set's bookkeeping for ``l2``, or None without it."""
        return LazyL2(rows, device) if self.config.l2 else None

    def rate(self, state: torch.Tensor) -> torch.Tensor | float:
        """Each row's current step size: ``lr / (sqrt(acc) + eps)`` for row-wise Adagrad,
        ``lr`` for SGD (the optimizers ``l2`` applies to)."""
        if self.kind == _ADAGRAD:
            return self.lr / (state[:, :1].sqrt() + self.config.eps)
        return self.lr

    @torch.no_grad()
    def catch_up(self, weights: torch.Tensor, state: torch.Tensor, lazy: LazyL2 | None,
                 steps: int) -> None:
        """Decay every row for the steps up to ``steps`` (the pass's) that did not touch
        it since its last update: after this the working set holds what an L2 applied to
        every row at every step gives."""
        if lazy is None or weights.shape[0] <= 1:
            return
        pending = (steps - 1 - lazy.last[1:]).clamp_min(0).to(torch.float32).unsqueeze(1)
        weights[1:] *= self._shrink(state[1:], weights.device) ** pending
        lazy.last[1:] = steps - 1

    def _shrink(self, state: torch.Tensor, device: torch.device) -> torch.Tensor:
        """Each row's factor for one step of ``l2`` (its proximal step at the row's rate:
        stable at any rate, where ``1 - rate * l2`` would turn negative)."""
        return torch.as_tensor(1.0 / (1.0 + self.rate(state) * self.config.l2),
                               dtype=torch.float32, device=device)

    def step(self, weights: torch.Tensor, state: torch.Tensor, rows: torch.Tensor,
             grads: torch.Tensor, scratch: np.ndarray | None = None,
             batch_rows: int | None = None, occurrence_l2: bool = True,
             lazy: LazyL2 | None = None, step_index: int = 0) -> int:
        """Apply one update for gradient ``grads[i]`` of row ``rows[i]`` (rows may repeat).

        ``scratch``: int64 array of -1 with one entry per working-set row, reused across
        steps on CPU (returned to all -1). ``batch_rows``: rows of the step's batch, which
        scales ``embedding_l2``. ``occurrence_l2=False``: ``grads`` already hold the
        ``embedding_l2`` term (the sharded lookup adds it where the occurrences are
        counted: an owner receives one gradient per requesting rank, not per occurrence).
        ``lazy``/``step_index``: with ``l2``, the working set's bookkeeping and this step's
        index in the pass (a touched row first decays for the steps it missed).
        Returns the number of rows updated.
        """
        c = self.config
        emb_l2 = self.l2_per_occurrence(batch_rows) if occurrence_l2 else 0.0
        if weights.device.type == "cpu":
            if scratch is None:
                scratch = np.full(weights.shape[0], -1, np.int64)
            return int(_fused_update(
                self.kind, weights.numpy(), state.numpy(), rows.numpy(),
                grads.detach().to(torch.float32).contiguous().numpy(), scratch,
                self.lr, c.eps, c.weight_decay, c.beta1, c.beta2, c.ftrl_alpha,
                c.ftrl_beta, c.ftrl_l1, c.ftrl_l2, c.group_lasso, emb_l2,
                c.l2 if lazy is not None else 0.0,
                lazy.last.numpy() if lazy is not None else _NO_ROWS, step_index))
        return self.step_torch(weights, state, rows, grads, batch_rows, occurrence_l2,
                               lazy, step_index)

    @torch.no_grad()
    def step_torch(self, weights: torch.Tensor, state: torch.Tensor, rows: torch.Tensor,
                   grads: torch.Tensor, batch_rows: int | None = None,
                   occurrence_l2: bool = True, lazy: LazyL2 | None = None,
                   step_index: int = 0) -> int:
        """The same update in torch ops, for CUDA and as the CPU kernel's reference."""
        c = self.config
        emb_l2 = self.l2_per_occurrence(batch_rows) if occurrence_l2 else 0.0
        uniq, inverse = torch.unique(rows, return_inverse=True)
        g = torch.zeros(len(uniq), grads.shape[1], dtype=torch.float32, device=grads.device)
        g.index_add_(0, inverse, grads.to(torch.float32))
        count = torch.bincount(inverse, minlength=len(uniq)).to(torch.float32)
        keep = uniq != 0
        uniq, g, count = uniq[keep], g[keep], count[keep]
        w = weights[uniq]
        s = state[uniq]
        dim = w.shape[1]
        if lazy is not None:
            missed = (step_index - 1 - lazy.last[uniq]).clamp_min(0).to(torch.float32)
            w = w * self._shrink(s, w.device) ** missed.unsqueeze(1)
            lazy.last[uniq] = step_index
        if c.weight_decay:
            g = g + c.weight_decay * w
        if emb_l2:
            g = g + emb_l2 * count.unsqueeze(1) * w
        step = torch.full((len(uniq), 1), self.lr, dtype=torch.float32, device=w.device)
        if self.kind == _ADAGRAD:
            s[:, 0] += (g * g).mean(dim=1)
            step = self.lr / (s[:, :1].sqrt() + c.eps)
            w -= step * g
        elif self.kind == _ADAM:
            s[:, 2 * dim] += 1.0
            t = s[:, 2 * dim:2 * dim + 1]
            m, v = s[:, :dim], s[:, dim:2 * dim]
            m.mul_(c.beta1).add_((1 - c.beta1) * g)
            v.mul_(c.beta2).add_((1 - c.beta2) * g * g)
            w -= self.lr * (m / (1 - c.beta1 ** t)) / ((v / (1 - c.beta2 ** t)).sqrt() + c.eps)
        elif self.kind == _FTRL:
            z, n = s[:, :dim], s[:, dim:]
            n_new = n + g * g
            sigma = (n_new.sqrt() - n.sqrt()) / c.ftrl_alpha
            z += g - sigma * w
            n.copy_(n_new)
            w = torch.where(
                z.abs() <= c.ftrl_l1, torch.zeros_like(z),
                -(z - z.sign() * c.ftrl_l1)
                / ((c.ftrl_beta + n_new.sqrt()) / c.ftrl_alpha + c.ftrl_l2))
        else:
            w -= self.lr * g
        if lazy is not None:
            w = w / (1.0 + step * c.l2)
        if c.group_lasso > 0:
            norm = w.norm(dim=1, keepdim=True)
            shrink = step * c.group_lasso
            w = torch.where(norm <= shrink, torch.zeros_like(w),
                            w * (1 - shrink / norm.clamp_min(1e-30)))
        weights[uniq] = w
        state[uniq] = s
        return int(len(uniq))
