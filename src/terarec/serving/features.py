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
    """The schema restricted to ``fields``. A Batch needs one categorical field at least,
    so one is borrowed when ``fields`` has none (its keys are then ignored)."""
    if not any(f.kind == "categorical" for f in fields):
        fields = [*fields, schema.categorical[0]]
    return replace(schema, fields=tuple(fields))


def request_batch(context: Mapping[str, Any], candidates: Sequence[Mapping[str, Any]],
                  schema: FeatureSchema) -> Batch:
    """The Batch of rows ``{**context, **c}`` for every candidate ``c``.

    Errors are ``DataError``s naming ``context`` or ``candidates[i]`` and the field.
    """
    if not candidates:
        raise DataError("no candidates")
    per_row = set().union(*candidates)
    row_fields = [f for f in schema.fields if f.name in per_row]
    shared_fields = [f for f in schema.fields if f.name not in per_row]
    if not shared_fields or not schema.categorical:
        merged = [{**context, **c} for c in candidates]
        return _relabel(lambda: batch_from_records(merged, schema), "candidates")
    overlap = [k for k in context if k in per_row]
    if overlap:  # a candidate that lacks a field still takes the context's value
        fallback = {k: context[k] for k in overlap}
        candidates = [{**fallback, **c} for c in candidates]
    n = len(candidates)
    shared = _relabel(lambda: batch_from_records([context], _part(schema, shared_fields)),
                      "context")
    rows = (_relabel(lambda: batch_from_records(candidates, _part(schema, row_fields)),
                     "candidates") if row_fields else None)
    row_names = {f.name for f in row_fields}

    def side(name: str) -> tuple[Batch, FeatureSchema]:
        if name in row_names:
            assert rows is not None
            return rows, _part(schema, row_fields)
        return shared, _part(schema, shared_fields)

    dense = torch.zeros(n, schema.dense_dim)
    num_numeric = len(schema.numeric)
    for j, spec in enumerate(schema.numeric):
        batch, part = side(spec.name)
        k = [f.name for f in part.numeric].index(spec.name)
        dense[:, j] = batch.dense[:, k]
        if schema.missing_flags:
            dense[:, num_numeric + j] = batch.dense[:, len(part.numeric) + k]
    values, lengths = [], []
    for spec in schema.categorical:
        batch, _ = side(spec.name)
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
