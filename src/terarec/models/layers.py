"""Building blocks shared by the CTR models: MLPs, the FM and DLRM interactions, the
DCN-v2 cross network, and the small helpers that feed dense features next to embeddings.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class BatchNorm(nn.BatchNorm1d):
    """``BatchNorm1d`` that normalises a one-row training batch with its running
    statistics (and leaves them as they are): one row has no batch variance, and PyTorch
    refuses it, yet a file's last batch may hold one row, and under torchrun a rank whose
    local batch is empty runs the model on one zero row weighted 0."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and x.shape[0] == 1:
            return F.batch_norm(x, self.running_mean, self.running_var, self.weight,
                                self.bias, False, 0.0, self.eps)
        return super().forward(x)


class MLP(nn.Sequential):
    """``Linear (-> BatchNorm) -> ReLU (-> Dropout)`` for each width in ``widths``; with
    ``out_dim`` a last ``Linear`` without activation (a logit or a tower's output vector).

    Xavier weights and zero biases: activations keep their scale through the layers, so
    an untrained network's logit is O(1) and the loss starts near chance. Batch norm
    sits before the activation, as in FuxiCTR's MLP blocks. With ``zero_output`` the last
    ``Linear`` starts at zero: an MLP whose output is added to a shallow model's logit
    (DeepFM's deep part) then starts as nothing, so the untrained model is the shallow
    one and the MLP learns only what that misses, instead of adding a random function
    of the factors that training must first undo.
    """

    def __init__(self, in_dim: int, widths: tuple[int, ...], dropout: float = 0.0,
                 out_dim: int | None = None, batch_norm: bool = False,
                 zero_output: bool = False) -> None:
        if zero_output and out_dim is None:
            raise ValueError("zero_output needs an output layer (out_dim)")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        layers: list[nn.Module] = []
        for width in widths:
            layers.append(nn.Linear(in_dim, width))
            if batch_norm:
                layers.append(BatchNorm(width))
            layers.append(nn.ReLU(inplace=True))
            if dropout > 0:
                layers.append(nn.Dropout(dropout))
            in_dim = width
        if out_dim is not None:
            layers.append(nn.Linear(in_dim, out_dim))
            in_dim = out_dim
        super().__init__(*layers)
        self.out_dim = in_dim
        linears = [m for m in self if isinstance(m, nn.Linear)]
        for linear in linears:
            nn.init.xavier_uniform_(linear.weight)
            nn.init.zeros_(linear.bias)
        if zero_output:
            nn.init.zeros_(linears[-1].weight)


def dense_linear(dense_dim: int) -> nn.Linear | None:
    """A bias-free linear term over the dense features (the model owns the global bias);
    ``None`` when the schema has no numeric fields, so no zero-sized parameter exists."""
    if dense_dim == 0:
        return None
    layer = nn.Linear(dense_dim, 1, bias=False)
    nn.init.zeros_(layer.weight)
    return layer


def concat_dense(vectors: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
    """``[B, F, K]`` field vectors flattened to ``[B, F*K]`` with ``dense`` appended."""
    return torch.cat([vectors.reshape(vectors.shape[0], -1), dense], dim=1)


def fm_pairwise(factors: torch.Tensor) -> torch.Tensor:
    """``sum_{i<j} <v_i, v_j>`` for ``factors`` ``[B, F, K]``, returned as ``[B]``.

    Uses ``((sum v)^2 - sum v^2) / 2``: O(F*K) instead of O(F^2*K).
    """
    square_of_sum = factors.sum(dim=1).square().sum(dim=1)
    sum_of_squares = factors.square().sum(dim=(1, 2))
    return 0.5 * (square_of_sum - sum_of_squares)


class DotInteraction(nn.Module):
    """Dot products of every pair of ``N`` vectors (upper triangle, no self-products).

    One ``bmm`` gives the ``[B, N, N]`` Gram matrix; a precomputed flat index picks the
    ``N(N-1)/2`` entries above the diagonal, row by row::

        N = 3:   G = | g00 g01 g02 |      out = [g01, g02, g12]
                     | g10 g11 g12 |      flat_index = [1, 2, 5]
                     | g20 g21 g22 |
    """

    flat_index: torch.Tensor  # buffer: upper-triangle positions in the flattened Gram matrix

    def __init__(self, num_vectors: int) -> None:
        super().__init__()
        self.num_vectors = num_vectors
        rows, cols = torch.triu_indices(num_vectors, num_vectors, offset=1)
        self.register_buffer("flat_index", rows * num_vectors + cols, persistent=False)

    @property
    def out_dim(self) -> int:
        return self.num_vectors * (self.num_vectors - 1) // 2

    def forward(self, vectors: torch.Tensor) -> torch.Tensor:
        gram = torch.bmm(vectors, vectors.transpose(1, 2))
        return gram.reshape(vectors.shape[0], -1).index_select(1, self.flat_index)


class CrossNetV2(nn.Module):
    """DCN-v2 cross network: ``x_{l+1} = x0 * (W_l x_l + b_l) + x_l``.

    Each layer adds one degree of explicit feature crossing while the residual keeps the
    lower-order terms. ``rank = 0`` keeps ``W_l`` full (``d x d``); ``rank = r > 0``
    factors it as ``U_l V_l^T`` (``d x r`` each), the paper's low-rank form, which costs
    ``2dr`` instead of ``d^2`` per sample: the cheaper choice on CPU once ``r < d / 2``.
    """

    def __init__(self, dim: int, num_layers: int, rank: int = 0) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(dim, rank, bias=False), nn.Linear(rank, dim)) if rank
            else nn.Linear(dim, dim)
            for _ in range(num_layers)
        )
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)

    def forward(self, x0: torch.Tensor) -> torch.Tensor:
        x = x0
        for layer in self.layers:
            x = torch.addcmul(x, x0, layer(x))
        return x

