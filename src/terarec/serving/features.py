"""Raw request values -> Batch, column-wise, converting each context value once.

A ``/predict`` request holds one context (user, page) and N candidates; scoring it means
scoring the N merged rows ``{**context, **candidate}``. Parsing and hashing are per
field and independent of the other fields, so the fields no candidate carries (the
context's, and those nobody sent) are converted on a single row and broadcast::

    candidates ──> pa.array: one Arrow column per field (N values)  ─┐ one hashing call,
    context    ──> one Arrow array per kind (1 value per field)    ─┴ one numeric parse
                                                                      -> broadcast Batch

That is the usual request (``_common_columns``). A request it does not cover
(multi-valued fields, a field mixing strings and numbers, a bad value) is converted in
two parts, per field (``batch_from_columns``), or record by record
(``batch_from_records``), whose errors name the record and field. Every way gives
exactly ``batch_from_records(merged rows, schema)``, the keys training saw.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from functools import lru_cache
from itertools import repeat
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from terarec.data.hashing import hash_columns, hash_segments
from terarec.data.readers import (
    FLOAT32_MAX,
    DataError,
    batch_from_columns,
    batch_from_records,
    dense_features,
    numeric_bucket_keys,
)
from terarec.types import Batch, FeatureSchema, FieldSpec, KeyedIds, per_schema


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
        # the field each slot belongs to (a sequence field's slots: that field)
        self.owner = {slot.name: f.name for f in schema.key_fields for slot in f.slots}
        self.sparse_from_row = torch.tensor([self.owner[f.name] in row_names
                                             for f in sparse])
        # Per sparse field of ``schema``: its position in each part (0 where it is not).
        row_sparse = list(self.row.sparse_names)
        shared_sparse = list(self.shared.sparse_names)
        self.row_index = torch.tensor([row_sparse.index(f.name)
                                       if self.owner[f.name] in row_names
                                       else 0 for f in sparse])
        self.shared_index = torch.tensor([0 if self.owner[f.name] in row_names
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
                  schema: FeatureSchema, row_names: frozenset[str] | None = None) -> Batch:
    """The Batch of rows ``{**context, **c}`` for every candidate ``c`` (``row_names``:
    every key of the candidates, where the caller has them).

    Errors are ``DataError``s naming ``context`` or ``candidates[i]`` and the field.
    """
    if not candidates:
        raise DataError("no candidates")
    if row_names is None:
        row_names = frozenset().union(*candidates)
    if row_names.isdisjoint(context):
        fast = _listed_batch(context, candidates, schema, row_names)
        if fast is None:
            columns = _columns(candidates, schema, row_names)
            fast = (None if columns is None
                    else _common_columns(columns, len(candidates), schema, context))
        if fast is not None:
            return fast
    if len(row_names) == len(schema.fields) or not schema.sparse_fields:
        merged = [{**context, **c} for c in candidates]
        return _relabel(lambda: part_batch(merged, schema), "candidates")
    overlap = [k for k in context if k in row_names]
    if overlap:  # a candidate that lacks a field still takes the context's value
        fallback = {k: context[k] for k in overlap}
        candidates = [{**fallback, **c} for c in candidates]
    plan = _plan(schema, row_names)
    n = len(candidates)
    shared = _relabel(lambda: part_batch([context], plan.shared), "context")
    rows = (_relabel(lambda: part_batch(candidates, plan.row), "candidates")
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
        sparse = KeyedIds.one_per_slot_of(schema.sparse_names, ids.reshape(-1).contiguous())
        return Batch(dense, sparse, torch.zeros(n))

    values, lengths = [], []
    for spec in schema.sparse_fields:
        from_row = plan.owner[spec.name] in row_names
        batch = rows if rows is not None and from_row else shared
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


def part_batch(records: Sequence[Mapping[str, Any]], schema: FeatureSchema) -> Batch:
    """``batch_from_records(records, schema)``, built column-wise when pyarrow can type
    the records (it reads all of them into one column per field in C++)."""
    columns = _columns(records, schema)
    if columns is not None:
        try:
            return columns_batch(columns, len(records), schema)
        except (pa.ArrowException, TypeError, ValueError, OverflowError):
            pass  # DataError too: the record path below names the record and the value
    return batch_from_records(records, schema)


def columns_batch(columns: Mapping[str, pa.Array], n: int, schema: FeatureSchema) -> Batch:
    """``batch_from_columns``; the usual request (single-valued fields, strings and
    numbers) in a few calls for the whole request rather than a few per field."""
    fast = _common_columns(columns, n, schema)
    return fast if fast is not None else batch_from_columns(columns, n, schema)


def _common_columns(columns: Mapping[str, pa.Array], n: int, schema: FeatureSchema,
                    shared: Mapping[str, Any] | None = None) -> Batch | None:
    """The Batch of ``n`` rows whose fields are ``columns`` (``n`` values each) or, for
    the other fields, the single values in ``shared`` (a request's context, broadcast).

    Covers the usual request: every field single-valued, categorical values strings or
    integers, numeric ones numbers or numeric strings with finite float32 values. The
    context's values become one Arrow array per kind, every categorical value of the
    request is hashed in one kernel call and every numeric text parsed in one cast.
    Anything else gives None (``batch_from_columns`` / the record path then check each
    value and word the error)."""
    shared = shared or {}
    if any(spec.separator is not None for spec in schema.categorical) \
            or not shared.keys().isdisjoint(columns):
        return None
    cat_names = [s.name for s in schema.categorical]
    num_names = [s.name for s in schema.numeric]
    ctx_cats = _one_row([shared.get(f) for f in cat_names if f not in columns])
    ctx_nums = _one_row([shared.get(f) for f in num_names if f not in columns])
    if ctx_cats is None or ctx_nums is None:
        return None

    cats: list[pa.Array] = []
    j = 0
    for name in cat_names:
        col = columns.get(name)
        if col is None:
            col, j = ctx_cats.slice(j, 1), j + 1
        if pa.types.is_null(col.type):
            col = pa.nulls(len(col), pa.string())
        elif not (pa.types.is_string(col.type) or pa.types.is_integer(col.type)
                  or pa.types.is_binary(col.type)):
            return None
        cats.append(col)
    keys = hash_columns([s.key_space for s in schema.categorical], cats, schema.hash_salt)
    ids = keys[_broadcast_index([len(c) for c in cats], n)].reshape(-1)

    texts: list[tuple[int, pa.Array]] = []  # numeric texts are parsed together
    numbers: list[tuple[int, pa.Array]] = []
    j = 0
    for k, name in enumerate(num_names):
        col = columns.get(name)
        if col is None:
            col, j = ctx_nums.slice(j, 1), j + 1
        if pa.types.is_null(col.type):
            numbers.append((k, pa.nulls(len(col), pa.float64())))
        elif pa.types.is_string(col.type):
            texts.append((k, col))
        elif pa.types.is_integer(col.type) or pa.types.is_floating(col.type):
            numbers.append((k, pc.cast(col, pa.float64(), safe=False)))
        else:
            return None
    parts = list(numbers)
    if texts:
        text = pa.concat_arrays([c for _, c in texts])
        if pc.any(pc.equal(text, "")).as_py():  # a missing value, as in a file: long way
            return None
        try:
            parsed = pc.cast(text, pa.float64())
        except pa.ArrowInvalid:  # text that is no number: the long way names it
            return None
        start = 0
        for k, c in texts:
            parts.append((k, parsed.slice(start, len(c))))
            start += len(c)
    numeric = np.empty((len(num_names), n), dtype=np.float64)
    if parts:
        flat = pa.concat_arrays([c for _, c in parts])
        x = flat.to_numpy(zero_copy_only=False)  # nulls -> NaN
        valid = ~flat.is_null().to_numpy(zero_copy_only=False) if flat.null_count else True
        if np.any(valid & ~(np.abs(x) <= FLOAT32_MAX)):  # NaN, infinite or beyond float32
            return None
        order = [k for k, _ in parts]
        lengths = [len(c) for _, c in parts]
        numeric[order] = x[_broadcast_index(lengths, n)]
    return _assemble(ids, numeric, n, schema)


def _assemble(ids: np.ndarray, numeric: np.ndarray, n: int, schema: FeatureSchema) -> Batch:
    """The Batch of ``n`` rows from the categorical keys (field-major, ``[F * n]``) and
    the clean float64 numeric values ``[fields, n]`` (NaN where missing), or ``[fields,
    1]`` when every row shares them (a request whose numeric values are all context):
    those are transformed once and broadcast."""
    dense = dense_features(numeric, schema)
    buckets = numeric_bucket_keys(numeric, schema)  # slots after the categorical ones
    if numeric.shape[1] != n:
        dense = np.repeat(dense, n, axis=0)
        buckets = [np.repeat(b, n) for b in buckets]
    if buckets:
        ids = np.concatenate([ids, *buckets]).astype(np.int64, copy=False)
    sparse = KeyedIds.one_per_slot_of(_layout(schema).sparse_names, torch.from_numpy(ids))
    return Batch(torch.from_numpy(dense), sparse, torch.zeros(n))


class _Layout:
    """The field lists of a schema that ``_listed_batch`` walks, computed once."""

    def __init__(self, schema: FeatureSchema) -> None:
        self.cats = tuple(s.name for s in schema.categorical)
        self.tables = tuple(s.key_space for s in schema.categorical)  # hashed with these
        self.nums = tuple(s.name for s in schema.numeric)
        self.single_valued = all(s.separator is None for s in schema.categorical)
        self.sparse_names = schema.sparse_names


_layout = per_schema(_Layout)


_DICT_GET: Callable[[Any, str], Any] = dict.get


def _gather(names: tuple[str, ...], context: Mapping[str, Any],
            candidates: Sequence[Mapping[str, Any]], row_names: frozenset[str]
            ) -> tuple[list[Any], list[int]]:
    """Every value of fields ``names`` end to end: a candidate field's ``n`` values, a
    context field's one; and each field's count."""
    values: list[Any] = []
    lengths: list[int] = []
    n = len(candidates)
    for name in names:
        if name in row_names:
            try:  # requests decode to plain dicts: dict.get mapped in C, no Python frame
                values.extend(map(_DICT_GET, candidates, repeat(name, n)))
            except TypeError:  # another Mapping
                del values[sum(lengths):]  # what the failed map appended
                values.extend([c.get(name) for c in candidates])
            lengths.append(n)
        else:
            values.append(context.get(name))
            lengths.append(1)
    return values, lengths


def _listed_batch(context: Mapping[str, Any], candidates: Sequence[Mapping[str, Any]],
                  schema: FeatureSchema, row_names: frozenset[str]) -> Batch | None:
    """The most common request's Batch straight from its Python values: categorical
    values all strings (or null), numeric ones all numbers or all numeric texts (or
    null), every field single-valued. All categorical values of the request become one
    Arrow array (one conversion in C++, no column per field) hashed in one kernel call,
    all numeric ones another; the context's values are converted once and broadcast. Anything else
    (integers as categories, strings and numbers mixed, a bad value) gives None and
    takes ``_common_columns`` or the record path, which check each value and word the
    error."""
    layout = _layout(schema)
    if not layout.single_valued:
        return None
    n = len(candidates)
    cat_values, cat_lengths = _gather(layout.cats, context, candidates, row_names)
    num_values, num_lengths = _gather(layout.nums, context, candidates, row_names)
    # Numeric values all from the context: one row, transformed once and broadcast.
    shared = all(k == 1 for k in num_lengths)
    plain = _plain_numbers(num_values) if shared else None
    try:
        cats = pa.array(cat_values)
        nums = pa.array(num_values) if plain is None else None
    except (pa.ArrowException, TypeError, ValueError, OverflowError):
        return None
    if pa.types.is_null(cats.type):
        cats = pa.nulls(len(cats), pa.string())
    elif not pa.types.is_string(cats.type):  # integers, bytes or a mix: checked elsewhere
        return None
    keys = hash_segments(layout.tables, cats, _bounds(tuple(cat_lengths)), schema.hash_salt)
    ids = keys[_broadcast_index(cat_lengths, n)].reshape(-1)
    numeric = np.empty((len(layout.nums), 1 if shared else n), dtype=np.float64)
    if plain is not None:
        if np.any(np.abs(plain) > FLOAT32_MAX):  # beyond float32: the long way says so
            return None
        numeric[:, 0] = plain
    elif layout.nums:
        assert nums is not None
        if pa.types.is_null(nums.type):
            numeric.fill(np.nan)
            return _assemble(ids, numeric, n, schema)
        if pa.types.is_string(nums.type):  # numeric texts, parsed as a file's are
            if "" in num_values:  # a missing value, as in a file: the long way
                return None
            try:
                x = pc.cast(nums, pa.float64()).to_numpy(zero_copy_only=False)
            except pa.ArrowInvalid:  # text that is no number: the long way names it
                return None
        elif pa.types.is_integer(nums.type) or pa.types.is_floating(nums.type):
            x = pc.cast(nums, pa.float64(), safe=False).to_numpy(zero_copy_only=False)
        else:
            return None  # booleans: the column path converts them
        fine = np.abs(x) <= FLOAT32_MAX  # False for NaN (a null too), inf, beyond float32
        if not fine.all() and not np.all(fine | ~_valid(nums)):
            return None
        numeric[:] = x[:, None] if shared else x[_broadcast_index(num_lengths, n)]
    return _assemble(ids, numeric, n, schema)


# A numeric text Python's float() parses exactly as Arrow's cast to float64 does (both
# round correctly): digits, an optional minus sign and fraction.
_PLAIN_NUMBER = re.compile(r"-?[0-9]+(?:\.[0-9]+)?")


def _plain_numbers(values: list[Any]) -> np.ndarray | None:
    """float64 of a few numeric values (a context's), NaN for a null, when each is null
    or a plain decimal text: parsed in Python, cheaper for a dozen values than an Arrow
    array and a cast. Anything else (numbers, other texts) gives None: the Arrow path."""
    out: list[float] = []
    for v in values:
        if v is None:
            out.append(math.nan)
        elif type(v) is str and _PLAIN_NUMBER.fullmatch(v):
            out.append(float(v))
        else:
            return None
    return np.array(out, dtype=np.float64)


def _valid(values: pa.Array) -> np.ndarray:
    """Bool ``[len(values)]``: not null, read from the Arrow validity bitmap."""
    bitmap = values.buffers()[0]
    if bitmap is None:
        return np.ones(len(values), np.bool_)
    bits = np.unpackbits(np.frombuffer(bitmap, np.uint8), count=values.offset + len(values),
                         bitorder="little")
    return bits[values.offset:].view(np.bool_)


@lru_cache(maxsize=1024)
def _bounds(lengths: tuple[int, ...]) -> np.ndarray:
    """``[0, cumsum(lengths)]``: segment bounds, built once per shape (read only)."""
    bounds = np.zeros(len(lengths) + 1, np.int64)
    np.cumsum(lengths, out=bounds[1:])
    bounds.flags.writeable = False
    return bounds


def _one_row(values: list[Any]) -> pa.Array | None:
    """One row's values of several fields as one Arrow array (None: pyarrow cannot
    give them one type, e.g. strings and numbers mixed)."""
    try:
        return pa.array(values)
    except (pa.ArrowException, TypeError, ValueError, OverflowError):
        return None


_INDEXES: dict[tuple[tuple[int, ...], int], np.ndarray] = {}


def _broadcast_index(lengths: Sequence[int], n: int) -> np.ndarray:
    """``[len(lengths), n]`` positions into the concatenation of segments of
    ``lengths`` (each ``n`` long, or 1 long and repeated). Requests of one shape share
    one (read-only) index, so it is built once per shape."""
    key = (tuple(lengths), n)
    index = _INDEXES.get(key)
    if index is None:
        if len(_INDEXES) >= 1024:  # many shapes (candidate counts): start over
            _INDEXES.clear()
        index = _INDEXES[key] = _build_broadcast_index(lengths, n)
    return index


def _build_broadcast_index(lengths: Sequence[int], n: int) -> np.ndarray:
    lengths_np = np.asarray(lengths, np.int64)
    starts = np.zeros(len(lengths_np), np.int64)
    np.cumsum(lengths_np[:-1], out=starts[1:])
    step = (lengths_np == n) if n > 1 else np.zeros(len(lengths_np), np.bool_)
    index = starts[:, None] + np.arange(n)[None, :] * step[:, None]
    index.flags.writeable = False
    return index


_TYPES: dict[tuple[int, frozenset[str]], tuple[FeatureSchema, pa.DataType]] = {}


def _columns(records: Sequence[Mapping[str, Any]], schema: FeatureSchema,
             names: frozenset[str] | None = None) -> dict[str, pa.Array] | None:
    """One Arrow column per key of ``records`` (null where a record lacks it; ``names``
    are all their keys), or None when pyarrow cannot give a key one type (strings and
    numbers mixed, huge integers).

    Typing the values is half of pyarrow's work, so the types the last such records
    (of this ``schema``, with these keys) had are tried first: requests of one client
    mostly agree. Only types into which pyarrow converts nothing the record path would
    refuse are reused."""
    names = frozenset().union(*records) if names is None else names
    key = (id(schema), names)
    hit = _TYPES.get(key)
    struct = None
    if hit is not None and hit[0] is schema:
        try:
            struct = pa.array(records, type=hit[1])
        except (pa.ArrowException, TypeError, ValueError, OverflowError):
            struct = None
    if struct is None:
        try:
            struct = pa.array(records)
        except (pa.ArrowException, TypeError, ValueError, OverflowError):
            return None
        if not pa.types.is_struct(struct.type) or len(struct) != len(records):
            return None
        _remember_types(key, schema, struct.type)
    return {struct.type.field(i).name: struct.field(i)
            for i in range(struct.type.num_fields)}


def _remember_types(key: tuple[int, frozenset[str]], schema: FeatureSchema,
                    inferred: pa.StructType) -> None:
    """Keep ``inferred`` as the types to try first, if it holds only strings (any
    field) and floats (numeric fields), and only fields of ``schema``: pyarrow refuses a
    value of another type for either (an integer for a string, a string for a float),
    where for an integer type it would take a float like 2.0."""
    numeric = {s.name for s in schema.numeric}
    known = {s.name for s in schema.fields}
    fields = []
    for i in range(inferred.num_fields):
        name, t = inferred.field(i).name, inferred.field(i).type
        if pa.types.is_null(t):
            t = pa.string()
        if name not in known or not (t == pa.string()
                                     or (t == pa.float64() and name in numeric)):
            return
        fields.append((name, t))
    if len(_TYPES) >= 256:
        _TYPES.clear()
    _TYPES[key] = (schema, pa.struct(fields))


def _relabel(build: Callable[[], Batch], where: str) -> Batch:
    """Run ``build``, renaming ``record i`` in its errors to the request's own terms."""
    try:
        return build()
    except DataError as exc:
        raise DataError(relabel(str(exc), where)) from None


def relabel(message: str, where: str) -> str:
    """A conversion error about ``record i`` in the request's terms: ``context``, or
    ``where[i]`` (``candidates[3]: field 'C7': ...``)."""
    if where == "context":
        return message.replace("record 0", "context", 1)
    if message.startswith("record "):
        return f"{where}[" + message[len("record "):].replace(":", "]:", 1)
    return message
