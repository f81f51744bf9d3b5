"""Baselines that the training-throughput benchmark measures beside terarec.

All three train the same DLRM dense network on the same in-memory batches and differ
only in where the embedding rows come from:

    dense_only   a constant zero ``[B, 26, 16]`` tensor: no lookups, no sparse optimizer.
                 The upper bound any embedding path can approach. With
                 ``embedding_grad`` backward also computes the gradient that reaches
                 the embeddings (what every embedding path needs) and discards it.
    pytorch      one ``nn.EmbeddingBag(1M, 16, sparse=True)`` per field, ``key % 1M``,
                 sparse gradients, ``torch.optim.Adagrad`` on the tables.
    torchrec     TorchRec's ``FusedEmbeddingBagCollection`` (FBGEMM's table-batched
                 kernel) with row-wise Adagrad applied inside backward, keys fed as a
                 ``KeyedJaggedTensor``.

The network, shared by all::

    dense [B,13] -> 64 -> 16 ─┐                      (bottom MLP, ReLU)
                              ├─ stack [B,27,16] -> pairwise dots, i<j: [B,351]
    emb   [B,26,16] ──────────┘
    concat(bottom [B,16], dots [B,351]) = [B,367] -> 512 -> 256 -> 1 logit

Loss is BCE-with-logits; the dense part trains with Adam (lr 1e-3). Per-batch input
preparation a baseline needs (``key % rows``, building the jagged tensor) is timed as part
of its step: it is work that baseline does on every batch.

Each ``*_sps`` function returns training samples per second over the timed steps after
warm-up; callers repeat runs and take what statistic they like.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
from torch import nn

from terarec.train.dense_step import DenseStep

NUM_DENSE = 13
NUM_FIELDS = 26
EMB_DIM = 16
TABLE_ROWS = 1_000_000
BATCH_SIZE = 4096
BOTTOM_HIDDEN = 64
TOP_MLP = (512, 256)
DENSE_LR = 1e-3
EMBEDDING_LR = 0.05


class DLRMBatch(NamedTuple):
    dense: torch.Tensor  # float32 [B, 13]
    ids: torch.Tensor  # int64 [B, 26], raw hashed keys
    labels: torch.Tensor  # float32 [B]


StepFn = Callable[[DLRMBatch], torch.Tensor]


def _mlp(widths: Sequence[int], final_relu: bool) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (fan_in, fan_out) in enumerate(zip(widths[:-1], widths[1:], strict=True)):
        layers.append(nn.Linear(fan_in, fan_out))
        if final_relu or i < len(widths) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class DLRMDense(nn.Module):
    """DLRM's dense network: bottom MLP, pairwise dot interaction, top MLP."""

    def __init__(self, num_dense: int = NUM_DENSE, num_fields: int = NUM_FIELDS,
                 emb_dim: int = EMB_DIM) -> None:
        super().__init__()
        self.bottom = _mlp((num_dense, BOTTOM_HIDDEN, emb_dim), final_relu=True)
        num_vectors = num_fields + 1
        rows, cols = torch.triu_indices(num_vectors, num_vectors, offset=1)
        # Flat positions of the strictly-upper triangle: each unordered pair once.
        self.register_buffer("pair_index", rows * num_vectors + cols, persistent=False)
        top_in = emb_dim + num_vectors * (num_vectors - 1) // 2
        self.top = _mlp((top_in, *TOP_MLP, 1), final_relu=False)

    def forward(self, dense: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        """``dense`` [B, 13], ``emb`` [B, 26, 16] -> logits [B]."""
        bottom = self.bottom(dense)
        vectors = torch.cat([bottom.unsqueeze(1), emb], dim=1)  # [B, 27, 16]
        dots = torch.bmm(vectors, vectors.transpose(1, 2)).flatten(1)  # [B, 27*27]
        pairs = dots.index_select(1, self.pair_index)  # [B, 351]
        return self.top(torch.cat([bottom, pairs], dim=1)).squeeze(1)


# --------------------------------------------------------------------------- timing


def make_batches(dense: torch.Tensor, ids: torch.Tensor, labels: torch.Tensor,
                 batch_size: int = BATCH_SIZE,
                 device: str | torch.device = "cpu") -> list[DLRMBatch]:
    """Cut the rows into full batches on ``device`` (a ragged tail is dropped so every
    timed step does the same work)."""
    expected = {"dense": (dense, torch.float32, (NUM_DENSE,)),
                "ids": (ids, torch.int64, (NUM_FIELDS,)),
                "labels": (labels, torch.float32, ())}
    for name, (tensor, dtype, trailing) in expected.items():
        if tensor.dtype != dtype or tensor.dim() != 1 + len(trailing) \
                or tuple(tensor.shape[1:]) != trailing:
            shape = ", ".join(["N", *map(str, trailing)])
            raise ValueError(f"{name} must be {dtype} [{shape}], "
                             f"got {tensor.dtype} {list(tensor.shape)}")
    n = labels.shape[0]
    if not dense.shape[0] == ids.shape[0] == n:
        raise ValueError(f"dense, ids and labels must have the same number of rows, got "
                         f"{dense.shape[0]}, {ids.shape[0]} and {n}")
    if n < batch_size:
        raise ValueError(f"need at least one full batch: {n} rows < batch_size {batch_size}")
    return [
        DLRMBatch(dense[s:s + batch_size].to(device), ids[s:s + batch_size].to(device),
                  labels[s:s + batch_size].to(device))
        for s in range(0, n - batch_size + 1, batch_size)
    ]


def _synchronize(batch: DLRMBatch) -> None:
    if batch.labels.is_cuda:
        torch.cuda.synchronize(batch.labels.device)


def time_steps(step_fn: StepFn, batches: Sequence[DLRMBatch], warmup: int,
               steps: int) -> float:
    """Run ``warmup`` untimed steps, then ``steps`` timed ones, cycling through
    ``batches`` in order; return timed samples per second."""
    if not batches:
        raise ValueError("time_steps: no batches")
    if steps < 1 or warmup < 0:
        raise ValueError(f"time_steps: need steps >= 1 and warmup >= 0, "
                         f"got steps={steps}, warmup={warmup}")
    for i in range(warmup):
        step_fn(batches[i % len(batches)])
    _synchronize(batches[0])
    samples = 0
    start = time.perf_counter()
    for i in range(warmup, warmup + steps):
        batch = batches[i % len(batches)]
        step_fn(batch)
        samples += batch.labels.shape[0]
    _synchronize(batches[0])
    return samples / (time.perf_counter() - start)


# --------------------------------------------------------------------------- steps


def _uniform_bound(rows: int) -> float:
    # DLRM's (and TorchRec's default) table init: U(-sqrt(1/rows), sqrt(1/rows)).
    return rows ** -0.5


def make_dense_only_step(batch_size: int = BATCH_SIZE, device: str | torch.device = "cpu",
                         seed: int = 0, compile: str = "off", autocast: str = "off",
                         embedding_grad: bool = False) -> tuple[StepFn, DLRMDense]:
    """A step of the network fed a constant zero embedding tensor; ``compile`` and
    ``autocast`` are terarec's dense-step switches (``train.dense_step``), so the bound
    can be measured with the dense settings terarec's run used. ``embedding_grad``:
    backward computes the embeddings' gradient too (discarded)."""
    torch.manual_seed(seed)
    model = DLRMDense().to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=DENSE_LR)
    zeros = torch.zeros(batch_size, NUM_FIELDS, EMB_DIM, device=device,
                        requires_grad=embedding_grad)
    dense_step = DenseStep(model, nn.BCEWithLogitsLoss(), torch.device(device),
                           compile=compile, autocast=autocast, batch_size=batch_size)

    def step(batch: DLRMBatch) -> torch.Tensor:
        loss = dense_step(batch.dense, zeros[: batch.labels.shape[0]], batch.labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        zeros.grad = None
        return loss.detach()

    return step, model


class PyTorchEmbeddings(nn.Module):
    """One sparse-gradient ``EmbeddingBag`` per field, each bag a single key."""

    def __init__(self, table_rows: int = TABLE_ROWS) -> None:
        super().__init__()
        self.table_rows = table_rows
        self.bags = nn.ModuleList(
            nn.EmbeddingBag(table_rows, EMB_DIM, mode="sum", sparse=True)
            for _ in range(NUM_FIELDS))
        bound = _uniform_bound(table_rows)
        for bag in self.bags:
            nn.init.uniform_(bag.weight, -bound, bound)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Raw keys [B, 26] -> pooled rows [B, 26, 16]."""
        rows = ids % self.table_rows  # remainder is non-negative for negative hashes too
        return torch.stack([bag(rows[:, f:f + 1]) for f, bag in enumerate(self.bags)], dim=1)


def make_pytorch_step(table_rows: int = TABLE_ROWS, device: str | torch.device = "cpu",
                      seed: int = 0) -> tuple[StepFn, DLRMDense, PyTorchEmbeddings]:
    """A step of plain PyTorch: sparse ``EmbeddingBag`` gradients, Adagrad on the tables."""
    torch.manual_seed(seed)
    model = DLRMDense().to(device)
    tables = PyTorchEmbeddings(table_rows).to(device)
    dense_optimizer = torch.optim.Adam(model.parameters(), lr=DENSE_LR)
    sparse_optimizer = torch.optim.Adagrad(tables.parameters(), lr=EMBEDDING_LR)
    loss_fn = nn.BCEWithLogitsLoss()

    def step(batch: DLRMBatch) -> torch.Tensor:
        loss = loss_fn(model(batch.dense, tables(batch.ids)), batch.labels)
        dense_optimizer.zero_grad(set_to_none=True)
        sparse_optimizer.zero_grad(set_to_none=True)
        loss.backward()
        dense_optimizer.step()
        sparse_optimizer.step()
        return loss.detach()

    return step, model, tables


def torchrec_available() -> bool:
    """Whether TorchRec and its FBGEMM kernels load beside this torch."""
    try:
        import torchrec  # noqa: F401
        from torchrec.modules.fused_embedding_modules import FusedEmbeddingBagCollection  # noqa: F401
    except (ImportError, OSError, RuntimeError):
        # FBGEMM builds for another torch fail at load time with OSError/RuntimeError.
        return False
    return True


def make_torchrec_step(table_rows: int = TABLE_ROWS, device: str | torch.device = "cpu",
                       seed: int = 0) -> tuple[StepFn, DLRMDense, nn.Module]:
    """A step of TorchRec's fused path: ``FusedEmbeddingBagCollection`` with row-wise
    Adagrad fused into backward (the rows are updated as their gradients are produced,
    so the step has no separate sparse optimizer call)."""
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.fused_embedding_modules import FusedEmbeddingBagCollection
    from torchrec.optim import RowWiseAdagrad
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    torch.manual_seed(seed)
    feature_names = [f"f{i}" for i in range(NUM_FIELDS)]
    tables = [
        EmbeddingBagConfig(name=f"t{i}", embedding_dim=EMB_DIM, num_embeddings=table_rows,
                           feature_names=[name])
        for i, name in enumerate(feature_names)
    ]
    collection = FusedEmbeddingBagCollection(
        tables=tables, optimizer_type=RowWiseAdagrad,
        optimizer_kwargs={"lr": EMBEDDING_LR}, device=torch.device(device))
    model = DLRMDense().to(device)
    dense_optimizer = torch.optim.Adam(model.parameters(), lr=DENSE_LR)
    loss_fn = nn.BCEWithLogitsLoss()
    lengths_cache: dict[int, torch.Tensor] = {}

    def step(batch: DLRMBatch) -> torch.Tensor:
        b = batch.labels.shape[0]
        if b not in lengths_cache:
            lengths_cache[b] = torch.ones(NUM_FIELDS * b, dtype=torch.int32, device=device)
        # KJT layout is field-major: all of f0's bags, then f1's, ... one key per bag.
        values = (batch.ids % table_rows).t().reshape(-1)
        features = KeyedJaggedTensor(keys=feature_names, values=values,
                                     lengths=lengths_cache[b])
        emb = collection(features).values().view(b, NUM_FIELDS, EMB_DIM)
        loss = loss_fn(model(batch.dense, emb), batch.labels)
        dense_optimizer.zero_grad(set_to_none=True)
        loss.backward()  # also applies row-wise Adagrad to the touched rows
        dense_optimizer.step()
        return loss.detach()

    return step, model, collection


# --------------------------------------------------------------------------- entry points


def dense_only_sps(dense: torch.Tensor, ids: torch.Tensor, labels: torch.Tensor, *,
                   steps: int = 50, warmup: int = 5, batch_size: int = BATCH_SIZE,
                   device: str | torch.device = "cpu", compile: str = "off",
                   autocast: str = "off", embedding_grad: bool = False) -> float:
    """Samples/s of the network alone (zero embeddings): the upper bound, eager fp32 by
    default, else with terarec's dense-step switches (``compile``, ``autocast``);
    ``embedding_grad``: with the gradient every embedding path needs."""
    batches = make_batches(dense, ids, labels, batch_size, device)
    step, _ = make_dense_only_step(batch_size, device, compile=compile, autocast=autocast,
                                   embedding_grad=embedding_grad)
    return time_steps(step, batches, warmup, steps)


def pytorch_sps(dense: torch.Tensor, ids: torch.Tensor, labels: torch.Tensor, *,
                steps: int = 50, warmup: int = 5, batch_size: int = BATCH_SIZE,
                table_rows: int = TABLE_ROWS, device: str | torch.device = "cpu") -> float:
    """Samples/s of plain PyTorch sparse ``EmbeddingBag`` tables + Adagrad."""
    batches = make_batches(dense, ids, labels, batch_size, device)
    step, _, _ = make_pytorch_step(table_rows, device)
    return time_steps(step, batches, warmup, steps)


def torchrec_sps(dense: torch.Tensor, ids: torch.Tensor, labels: torch.Tensor, *,
                 steps: int = 50, warmup: int = 5, batch_size: int = BATCH_SIZE,
                 table_rows: int = TABLE_ROWS,
                 device: str | torch.device = "cpu") -> float | None:
    """Samples/s of TorchRec's fused embedding path; ``None`` when TorchRec is absent."""
    if not torchrec_available():
        return None
    batches = make_batches(dense, ids, labels, batch_size, device)
    step, _, _ = make_torchrec_step(table_rows, device)
    return time_steps(step, batches, warmup, steps)
