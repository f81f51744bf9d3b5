"""Sequence fields: an ordered multi-valued column (a user's recent items) kept in order.

A sequence field keeps the most recent ``max_len`` values of its cell (the cell lists
them oldest first, as logs append) and spreads them over ``max_len`` single-key slots,
``name#0`` .. ``name#{max_len-1}``; a shorter history leaves its last slots empty::

    max_len 3:
    row 0:  "a|b|c|d"  -> kept [b c d]  -> hist#0=b  hist#1=c  hist#2=d   (length 3)
    row 1:  "x"        -> kept [x]      -> hist#0=x  hist#1=-  hist#2=-   (length 1)

So the store, the working set, the ranks' key exchange, export and serving see
ordinary fields of zero or one key, and every lookup yields the padded rows
``[B, max_len, D]`` in place; an empty slot pools to the zero row.
``terarec.models.sequence`` turns those slots back into (rows, lengths) for a model.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from terarec.types import FeatureSchema


def parse_sequence(text: str) -> tuple[str, int | None]:
    """``COL[:max_len]`` (a ``--sequence`` item) as (column, max_len or None)."""
    col, sep, length = text.strip().partition(":")
    if not col:
        raise ValueError(f"--sequence {text!r}: expected COL or COL:MAX_LEN")
    if not sep:
        return col, None
    try:
        n = int(length)
    except ValueError:
        raise ValueError(f"--sequence {text!r}: max_len {length!r} is not an integer"
                         ) from None
    if n < 1:
        raise ValueError(f"--sequence {text!r}: max_len must be at least 1, got {n}")
    return col, n


def parse_share(text: str) -> tuple[str, str]:
    """``FIELD=TABLE`` (a ``--share-table`` item) as (field, table)."""
    field, sep, table = text.strip().partition("=")
    if not sep or not field.strip() or not table.strip():
        raise ValueError(f"--share-table {text!r}: expected FIELD=TABLE (e.g. "
                         "hist_items=item)")
    return field.strip(), table.strip()


def slot_keys(keys: np.ndarray, lengths: np.ndarray, max_len: int
              ) -> tuple[np.ndarray, np.ndarray]:
    """Per-row keys (``lengths[r]`` each, concatenated) -> the ``max_len`` slots' keys
    and per-(slot, row) lengths, slot-major as ``KeyedIds`` stores fields: row ``r``
    keeps its last ``min(lengths[r], max_len)`` keys, oldest first, in slots 0..."""
    lengths = lengths.astype(np.int64, copy=False)
    ends = np.cumsum(lengths)
    kept = np.minimum(lengths, max_len)
    starts = ends - kept  # first kept key of each row
    slot = np.arange(max_len, dtype=np.int64)
    filled = slot[:, None] < kept[None, :]  # [max_len, n]
    where = (starts[None, :] + slot[:, None])[filled]  # slot-major, rows in order
    out_keys = keys[where] if len(where) else np.empty(0, np.int64)
    return out_keys.astype(np.int64, copy=False), filled.reshape(-1).astype(np.int64)


DEFAULT_MAX_LEN = 50


def with_sequences(schema: FeatureSchema, sequences: Sequence[str] = (),
                   share_tables: Sequence[str] = ()) -> FeatureSchema:
    """``schema`` with its ``COL[:max_len]`` columns made sequence fields (``max_len``
    default ``DEFAULT_MAX_LEN``) and each ``FIELD=TABLE``'s field hashed into the table
    ``TABLE`` (a field's name, or any name fields share); a bad name is a ValueError
    naming the flag."""
    if not sequences and not share_tables:
        return schema
    by_name = {f.name: f for f in schema.fields}
    lengths: dict[str, int] = {}
    for item in sequences:
        col, n = parse_sequence(item)
        spec = by_name.get(col)
        if spec is None or spec.kind != "categorical" or spec.separator is None:
            raise ValueError(f"--sequence {item!r}: {col!r} is not a multi-valued "
                             "categorical column")
        if col in lengths:
            raise ValueError(f"--sequence names {col!r} twice")
        lengths[col] = n if n is not None else DEFAULT_MAX_LEN
    tables: dict[str, str] = {}
    for item in share_tables:
        field, table = parse_share(item)
        if field not in by_name or not by_name[field].sparse:
            raise ValueError(f"--share-table {item!r}: {field!r} is not a categorical "
                             "column")
        if field in tables:
            raise ValueError(f"--share-table names {field!r} twice")
        tables[field] = table
    fields = tuple(replace(f, max_len=lengths.get(f.name, f.max_len),
                           table=tables.get(f.name, f.table)) for f in schema.fields)
    return replace(schema, fields=fields)
