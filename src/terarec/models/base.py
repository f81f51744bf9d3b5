"""The contract every CTR model keeps: a pure ``nn.Module`` over dense features and the
pooled rows of a batch's keys.

The embedding rows live outside the model (in the store, staged per pass into a working
set); the trainer looks them up and hands the model a ``[B, F, row_dim]`` tensor. So one
model class trains on a laptop, across ranks, and serves from a cache, unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import torch
from torch import nn

from terarec.config import ModelConfig
from terarec.models.sequence import SlotLayout
from terarec.types import FeatureSchema


class CTRModel(nn.Module):
    """Base class of every model, the built-ins and the user's own.

    The contract:

    - ``__init__(schema, config)``: ``schema`` (``FeatureSchema``) names the fields;
      ``config`` (``ModelConfig``) carries ``embedding_dim``, the MLP widths, ``dropout``
      and ``batch_norm``, which a model may read or ignore. Call ``super().__init__``
      first: it sets ``schema``, ``config``, ``num_fields``, ``dense_dim`` and ``row_dim``.
    - ``row_dim_for(config)`` (classmethod): floats per key in the store, known before
      the model is built so the store is sized first; the default is
      ``config.embedding_dim``.
    - ``forward(dense, emb) -> logits``: ``dense`` float32 ``[B, schema.dense_dim]``
      (the standardised numeric columns); ``emb`` float32 ``[B, F, row_dim]``, one row
      per categorical field in ``schema.sparse_names`` order, a multi-valued field's keys
      pooled (sum or mean, as the schema says); returns ``[B]`` logits (pre-sigmoid).
      The rows come from terarec's store (memory, tiered or sharded across ranks) and
      their gradients go back to it: the model owns only its dense parameters.
    - ``logit_offset()``: the one-element global bias that recalibration shifts after
      each pass so the mean prediction equals the click rate; found as a one-element
      ``self.bias`` parameter by default, None turns recalibration off for the model.

    - Sequence fields (``terarec.models.sequence``): every lookup yields one row per slot
      of ``schema.sparse_fields``, a sequence taking ``max_len`` slots; the base class
      adapts them before ``forward``. A model with ``uses_sequences = True`` gets
      ``forward(dense, emb, sequences)``: ``emb`` the other fields, ``sequences``
      ``{name: SequenceRows}`` (padded ``[B, L, D]`` rows, lengths, mask); any other
      model gets each sequence pooled into one field of ``emb``.

    Several labels (``schema.task_names``, ``--label click,conversion``): a model that
    sets ``multi_task = True`` returns ``[B, T]`` logits, one column per task in
    ``task_names`` order, and may map the labels it is trained on with
    ``task_targets`` (ESMM's CTCVR target is click and conversion). Other models keep
    one label and return ``[B]``.

    Keep ``forward`` traceable (tensor operations, no data-dependent Python control
    flow) and the server runs it as an ONNX graph; otherwise it runs it in PyTorch.
    """

    row_dim: int
    # Whether ``forward`` takes a third argument, the sequence fields' padded rows.
    uses_sequences: bool = False

    multi_task: ClassVar[bool] = False

    def __init__(self, schema: FeatureSchema, config: ModelConfig) -> None:
        super().__init__()
        self.schema = schema
        self.config = config
        self.num_fields = len(schema.sparse_names)
        if schema.sequence_fields:
            layout = SlotLayout(schema)
            self.num_fields = layout.pooled_fields(self.uses_sequences)
            self.register_forward_pre_hook(_slot_hook(layout, self.uses_sequences))
        self.dense_dim = schema.dense_dim
        if self.num_fields < 1:  # every model reads embedding rows
            raise ValueError(f"model {type(self).__name__.lower()!r} needs at least one "
                             "categorical field in the feature schema, found none")
        self.row_dim = self.row_dim_for(config)  # validates config too
        self.task_names = schema.task_names
        self.num_tasks = len(self.task_names)
        name = type(self).__name__.lower()
        if self.num_tasks > 1 and not self.multi_task:
            raise ValueError(f"model {name!r} predicts one label, the schema has "
                             f"{self.num_tasks} ({', '.join(self.task_names)}); train "
                             "several labels with sharedbottom, mmoe or esmm")
        if self.num_tasks < 2 and self.multi_task:
            raise ValueError(f"model {name!r} is a multi-task model: it needs two or more "
                             f"labels (--label click,conversion), the schema has one")

    def forward(self, dense: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:  # noqa: D102
        raise NotImplementedError

    def task_targets(self, labels: torch.Tensor) -> torch.Tensor:
        """The targets the loss compares the logits with: the labels as read, unless a
        model trains a task on a combination of them."""
        return labels

    def logit_offset(self) -> nn.Parameter | None:
        """The one-element parameter added to every logit (the global bias), which
        ``Trainer.recalibrate`` shifts; None where the model has none."""
        bias = getattr(self, "bias", None)
        return bias if isinstance(bias, nn.Parameter) and bias.numel() == 1 else None

    @classmethod
    def row_dim_for(cls, config: ModelConfig) -> int:
        """Floats per key this model needs, known before it is built so the store can be
        sized first: ``embedding_dim`` unless a subclass says otherwise; ``config`` is
        validated on the way."""
        cls.check_config(config)
        return config.embedding_dim

    @classmethod
    def check_config(cls, config: ModelConfig) -> None:
        """Reject shapes no model can use; subclasses extend with their own rules."""
        if config.embedding_dim < 1:
            raise ValueError(f"model {config.name!r}: embedding_dim must be >= 1, "
                             f"got {config.embedding_dim}")
        if not 0.0 <= config.dropout < 1.0:
            raise ValueError(f"model {config.name!r}: dropout must be in [0, 1), "
                             f"got {config.dropout}")
        for key in ("bottom_mlp", "top_mlp", "deep_mlp"):
            widths = getattr(config, key)
            if any(int(w) < 1 for w in widths):
                raise ValueError(f"model {config.name!r}: {key} widths must be >= 1, "
                                 f"got {tuple(widths)}")

    def check_inputs(self, dense: torch.Tensor, emb: torch.Tensor) -> None:
        """Fail with the expected shapes instead of a matmul error deep inside the net."""
        if torch.jit.is_tracing():  # shapes are fixed by the example inputs already
            return
        expected = (self.num_fields, self.row_dim)
        if emb.dim() != 3 or tuple(emb.shape[1:]) != expected:
            raise ValueError(f"{type(self).__name__}: emb must be [B, {expected[0]}, "
                             f"{expected[1]}], got {list(emb.shape)}")
        if dense.dim() != 2 or dense.shape[0] != emb.shape[0] or dense.shape[1] != self.dense_dim:
            raise ValueError(f"{type(self).__name__}: dense must be [{emb.shape[0]}, "
                             f"{self.dense_dim}], got {list(dense.shape)}")


def _slot_hook(layout: SlotLayout, uses_sequences: bool
               ) -> Callable[[nn.Module, tuple], tuple | None]:
    """The pre-forward hook that turns the lookup's slot rows into the model's inputs."""

    def hook(module: nn.Module, args: tuple) -> tuple | None:
        # (the ONNX exporter passes a forward's defaults too: ``sequences=None``)
        if len(args) < 2 or any(a is not None for a in args[2:]):
            return None
        dense, emb = args[:2]
        if emb.dim() != 3 or emb.shape[1] != layout.slots:
            return None  # already adapted (or a caller's own shape, checked in forward)
        if uses_sequences:
            pooled, sequences = layout.split(emb)
            return dense, pooled, sequences
        return dense, layout.pool(emb)

    return hook
