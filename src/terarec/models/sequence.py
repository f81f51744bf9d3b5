"""Sequence fields on the model side: the slot rows every lookup yields, split back into
pooled fields and padded sequences.

Every lookup (training, ranks, serving) hands a model ``[B, S, D]``: one slot per
``schema.sparse_fields`` entry, a sequence field of ``max_len`` L taking L slots
(``terarec.data.sequences``). ``SlotLayout`` turns that into what the model declares:

- a model with ``uses_sequences = True``: ``forward(dense, emb, sequences)``, ``emb``
  ``[B, F, D]`` of the other fields and ``sequences`` ``{name: SequenceRows}`` (the
  padded ``[B, L, D]`` rows, their ``[B]`` lengths and ``[B, L]`` mask);
- any other model: ``forward(dense, emb)``, each sequence pooled (sum or mean, as its
  field says) into one slot in its field's place, as a multi-valued field would be.

A slot counts as filled when its row is not the zero row: padding, and a key with no
row yet (not admitted in training, unknown to the server), carry nothing, and both
paths see the same mask. The split is tensor indexing only, so it traces into the
served ONNX graph.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from terarec.types import FeatureSchema


class SequenceRows(NamedTuple):
    """One sequence field's rows: ``rows`` ``[B, L, D]`` (oldest kept first, zero rows
    after the last), ``lengths`` ``[B]`` int64 and ``mask`` ``[B, L]`` bool."""

    rows: torch.Tensor
    lengths: torch.Tensor
    mask: torch.Tensor


def sequence_rows(rows: torch.Tensor) -> SequenceRows:
    """``rows`` ``[B, L, D]`` with its mask (non-zero rows) and lengths."""
    mask = rows.ne(0).any(dim=2)
    return SequenceRows(rows, mask.sum(dim=1), mask)


class SlotLayout:
    """Where each field's rows sit among a schema's slots."""

    def __init__(self, schema: FeatureSchema) -> None:
        self.fields: list[tuple[str, int, int, bool]] = []  # name, start, stop, mean
        start = 0
        for spec in schema.key_fields:
            width = spec.max_len if spec.max_len is not None else 1
            self.fields.append((spec.name, start, start + width,
                                spec.max_len is not None and spec.pooling == "mean"))
            start += width
        self.slots = start
        self.sequences = tuple(f.name for f in schema.sequence_fields)
        seq = set(self.sequences)
        self._pooled_index = torch.tensor(
            [s for name, s, _, _ in self.fields if name not in seq], dtype=torch.int64)
        self._spans = {name: (s, e) for name, s, e, _ in self.fields if name in seq}

    def pooled_fields(self, uses_sequences: bool) -> int:
        """The fields of the ``emb`` a model gets."""
        return len(self.fields) - (len(self.sequences) if uses_sequences else 0)

    def split(self, emb: torch.Tensor) -> tuple[torch.Tensor, dict[str, SequenceRows]]:
        """``[B, S, D]`` slots -> (``[B, F, D]`` of the other fields, sequences)."""
        pooled = emb.index_select(1, self._pooled_index.to(emb.device))
        return pooled, {name: sequence_rows(emb[:, s:e]) for name, (s, e)
                        in self._spans.items()}

    def pool(self, emb: torch.Tensor) -> torch.Tensor:
        """``[B, S, D]`` slots -> ``[B, fields, D]``, each sequence pooled in place."""
        parts = []
        for _, s, e, mean in self.fields:
            if e - s == 1 and not mean:
                parts.append(emb[:, s:e])
                continue
            rows = emb[:, s:e]
            total = rows.sum(dim=1, keepdim=True)
            if mean:
                count = rows.ne(0).any(dim=2).sum(dim=1).clamp_min(1)
                total = total / count.to(total.dtype).view(-1, 1, 1)
            parts.append(total)
        return torch.cat(parts, dim=1)
