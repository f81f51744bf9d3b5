"""Raw request values -> Batch, hashing each shared context value once.

A ``/predict`` request holds one context (user, page) and N candidates; scoring it means
scoring the N merged rows ``{**context, **candidate}``. Parsing and hashing are per
field and independent of the other fields, so the fields no candidate carries (the
context's, and those nobody sent) are converted once, on a single row, and broadcast::

    fields carried by some candidate ──> batch_from_records(N rows)  ─┐ per field,
    every other field               ──> batch_from_records(1 row)    ─┴ broadcast -> Batch

The result is exactly ``batch_from_records(merged rows, schema)``, the keys training saw,
at a fraction of the per-value work.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch

from terarec.data.readers import DataError, batch_from_records
from terarec.types import Batch, FeatureSchema, FieldSpec, KeyedIds


def _part(schema: FeatureSchema, fields: list[FieldSpec]) -> FeatureSchema:
    """The schema restricted to ``fields``. A Batch needs one sparse field at least,
    so one is borrowed when ``fields`` has none (its keys are then ignored)."""
    if not any(f.sparse for f in fields):
        fields = [*fields, schema.sparse_fields[0]]
    return replace(schema, fields=tuple(fields))


class _Plan:
    """Where each field of ``schema`` comes from when ``row_names`` are per candidate:
    index arrays into the per-row and the shared part, so assembly is a few gathers."""

    def __init__(self, schema: FeatureSchema, row_names: frozenset[str]) -> None:
        self.row = _part(schema, [f for f in schema.fields if f.name in row_names])
        self.shared = _part(schema, [f for f in schema.fields if f.name not in row_names])
        self.has_rows = bool(row_names)
        self.one_per_slot = all(f.separator is None for f in schema.sparse_fields)
        self.dense_row, self.dense_shared = _dense_sources(schema, self.row, self.shared,
                                                           row_names)
        sparse = schema.sparse_fields
        self.sparse_from_row = torch.tensor([f.name in row_names for f in sparse])
        # Per sparse field of ``schema``: its position in each part (0 where it is not).
        row_sparse = list(self.row.sparse_names)
        shared_sparse = list(self.shared.sparse_names)
        self.row_index = torch.tensor([row_sparse.index(f.name) if f.name in row_names
                                       else 0 for f in sparse])
        self.shared_index = torch.tensor([0 if f.name in row_names
                                          else shared_sparse.index(f.name)
                                          for f in sparse])


def _dense_sources(schema: FeatureSchema, row: FeatureSchema, shared: FeatureSchema,
                   row_names: frozenset[str]) -> tuple[tuple, tuple]:
    """(target columns, source columns) of ``Batch.dense`` for the per-row and the shared
    part: a value column per numeric field, then its missing flag column."""
    pairs: dict[bool, tuple[list[int], list[int]]] = {True: ([], []), False: ([], [])}
    num = len(schema.numeric)
    for j, spec in enumerate(schema.numeric):
        from_row = spec.name in row_names
        part = row if from_row else shared
        k = [f.name for f in part.numeric].index(spec.name)
        targets, sources = pairs[from_row]
        targets.append(j)
        sources.append(k)
        if schema.missing_flags:
            targets.append(num + j)
            sources.append(len(part.numeric) + k)
    as_index = lambda p: (torch.tensor(p[0], dtype=torch.int64),  # noqa: E731
                          torch.tensor(p[1], dtype=torch.int64))
    return as_index(pairs[True]), as_index(pairs[False])


_PLANS: dict[tuple[int, frozenset[str]], tuple[FeatureSchema, _Plan]] = {}


def _plan(schema: FeatureSchema, row_names: frozenset[str]) -> _Plan:
    """The plan for this split, cached per schema object (requests mostly share one)."""
    hit = _PLANS.get((id(schema), row_names))
    if hit is not None and hit[0] is schema:
        return hit[1]
    if len(_PLANS) >= 256:
        _PLANS.clear()
    plan = _Plan(schema, row_names)
    _PLANS[(id(schema), row_names)] = (schema, plan)
    return plan


def request_batch(context: Mapping[str, Any], candidates: Sequence[Mapping[str, Any]],
                  schema: FeatureSchema) -> Batch:
    """The Batch of rows ``{**context, **c}`` for every candidate ``c``.

    Errors are ``DataError``s naming ``context`` or ``candidates[i]`` and the field.
    """
    if not candidates:
        raise DataError("no candidates")
    row_names = frozenset(k for c in candidates for k in c)
    if len(row_names) == len(schema.fields) or not schema.sparse_fields:
        merged = [{**context, **c} for c in candidates]
        return _relabel(lambda: batch_from_records(merged, schema), "candidates")
    overlap = [k for k in context if k in row_names]
    if overlap:  # a candidate that lacks a field still takes the context's value
        fallback = {k: context[k] for k in overlap}
        candidates = [{**fallback, **c} for c in candidates]
    plan = _plan(schema, row_names)
    n = len(candidates)
    shared = _relabel(lambda: batch_from_records([context], plan.shared), "context")
    rows = (_relabel(lambda: batch_from_records(candidates, plan.row), "candidates")
            if plan.has_rows else None)

    dense = torch.empty(n, schema.dense_dim)
    targets, sources = plan.dense_shared
    dense[:, targets] = shared.dense[0, sources]
    if rows is not None:
        targets, sources = plan.dense_row
        dense[:, targets] = rows.dense[:, sources]

    if plan.one_per_slot:
        # [F, n] keys, field-major as KeyedIds stores them: shared keys broadcast.
        ids = shared.sparse.values[plan.shared_index].unsqueeze(1).expand(-1, n)
        if rows is not None:
            row_keys = rows.sparse.values.view(len(plan.row.sparse_fields), n)
            ids = torch.where(plan.sparse_from_row.unsqueeze(1), row_keys[plan.row_index], ids)
        sparse = KeyedIds(schema.sparse_names, ids.reshape(-1).contiguous(),
                          torch.arange(ids.numel() + 1, dtype=torch.int64))
        return Batch(dense, sparse, torch.zeros(n))

    values, lengths = [], []
    for spec in schema.sparse_fields:
        batch = rows if rows is not None and spec.name in row_names else shared
        sparse = batch.sparse
        f = sparse.fields.index(spec.name)
        keys = sparse.field_values(spec.name)
        slot_lengths = sparse.lengths[f * sparse.batch_size:(f + 1) * sparse.batch_size]
        if batch is shared:
            keys = keys.repeat(n)
            slot_lengths = slot_lengths.expand(n)
        values.append(keys)
        lengths.append(slot_lengths)
    sparse = KeyedIds.from_lengths(schema.sparse_names, torch.cat(values), torch.cat(lengths))
    return Batch(dense, sparse, torch.zeros(n))


def _relabel(build, where: str) -> Batch:
    """Run ``build``, renaming ``record i`` in its errors to the request's own terms."""
    try:
        return build()
    except DataError as exc:
        message = str(exc)
        if where == "context":
            message = message.replace("record 0", "context", 1)
        elif message.startswith("record "):
            message = "candidates[" + message[len("record "):].replace(":", "]:", 1)
        raise DataError(message) from None
